#include "graph.h"

#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

namespace pyreducer {

namespace {

// Post-hook on a parameter's AccumulateGrad node: runs after the gradient is in param.grad.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(const std::function<void(size_t)>* on_ready, size_t index)
      : on_ready_(on_ready), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    (*on_ready_)(index_);
    return outputs;
  }

 private:
  const std::function<void(size_t)>* on_ready_;  // GradHooks' own, which outlives the hook
  size_t index_;
};

}  // namespace

// grad_accumulator() returns a std::shared_ptr<Node> in torch 2.11 and a c10::intrusive_ptr<Node>
// in torch 2.13 and later: the type is the function's own, so one source builds against every
// supported torch (pyreducer/wrapper/torch_versions.py).
struct GradHooks::Owners {
  using Owner =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<Owner> nodes;
};

GradHooks::GradHooks(const std::vector<at::Tensor>& params, std::function<void(size_t)> on_ready)
    : owners_(std::make_unique<Owners>()), on_ready_(std::move(on_ready)) {
  owners_->nodes.reserve(params.size());
  nodes_.reserve(params.size());
  keys_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    keys_.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(&on_ready_, i)));
    nodes_.push_back(accumulator.get());
    owners_->nodes.push_back(std::move(accumulator));
  }
}

GradHooks::~GradHooks() {
  for (size_t i = 0; i < keys_.size(); ++i) owners_->nodes[i]->del_post_hook(keys_[i]);
}

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
