#include "graph.h"

#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace pyreducer {

std::vector<uint8_t> reachable(const std::vector<at::Tensor>& outputs,
                               const std::vector<torch::autograd::Node*>& accumulators) {
  std::unordered_map<torch::autograd::Node*, size_t> index_of;
  for (size_t i = 0; i < accumulators.size(); ++i) index_of[accumulators[i]] = i;
  std::vector<uint8_t> result(accumulators.size(), 0);

  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const at::Tensor& output : outputs) {
    if (!output.defined()) continue;
    if (auto fn = output.grad_fn()) {
      if (seen.insert(fn.get()).second) stack.push_back(fn.get());
    } else if (output.requires_grad()) {  // a parameter returned as is
      auto accumulator = torch::autograd::impl::try_get_grad_accumulator(output);
      if (accumulator && index_of.count(accumulator.get())) {
        result[index_of[accumulator.get()]] = 1;
      }
    }
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    auto found = index_of.find(node);
    if (found != index_of.end()) result[found->second] = 1;
    for (const auto& edge : node->next_edges()) {
      torch::autograd::Node* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  return result;
}

bool backward_accumulates_any(const std::vector<torch::autograd::Node*>& accumulators) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  // Empty: a whole backward, every node runs (the engine fills it only when given inputs).
  if (exec_info == nullptr || exec_info->empty()) return true;
  for (torch::autograd::Node* accumulator : accumulators) {
    auto found = exec_info->find(accumulator);
    // needed_, not should_execute(): a node only captured (autograd.grad with the parameter
    // among its inputs) returns its gradient without running, so its hooks never fire
    if (found != exec_info->end() && found->second.needed_) return true;
  }
  return false;
}

}  // namespace pyreducer
