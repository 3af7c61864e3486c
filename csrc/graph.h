// The Reducer's contact with the autograd graph (no Python): its hooks on the parameters'
// AccumulateGrad nodes, and walks of the graph.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace pyreducer {

// A post-hook on each parameter's AccumulateGrad node (created if the parameter has none yet),
// and those nodes kept alive: a parameter holds its node only weakly.
class GradHooks {
 public:
  // After the gradient of params[i] is accumulated into its .grad, calls on_ready(i), on the
  // thread that runs that node (the backward's caller on CPU, the device's autograd thread on
  // CUDA), without the GIL. Python thread (the Reducer's construction).
  GradHooks(const std::vector<at::Tensor>& params, std::function<void(size_t)> on_ready);
  // Removes every hook: once it returns, on_ready is not called again. Python thread.
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // The AccumulateGrad nodes, in parameter order (for reachable() and backward_accumulates_any).
  const std::vector<torch::autograd::Node*>& nodes() const { return nodes_; }

 private:
  struct Owners;  // the nodes' owning pointers, whose type differs across torch versions
  std::unique_ptr<Owners> owners_;
  std::vector<torch::autograd::Node*> nodes_;
  std::vector<uintptr_t> keys_;
  std::function<void(size_t)> on_ready_;
};

// For each entry of `accumulators`, whether it can be reached from the grad_fn of any of
// `outputs` by walking next edges (i.e. whether that parameter can get a gradient from a
// backward through these outputs). Walks every node once. Python thread.
std::vector<uint8_t> reachable(const std::vector<at::Tensor>& outputs,
                               const std::vector<torch::autograd::Node*>& accumulators);

// Whether the backward running on this thread will run any of `accumulators` (accumulate into
// those parameters' .grad): always for a whole backward; for torch.autograd.grad (which
// accumulates nothing) or backward(inputs=...), only if one of them is needed. Autograd
// thread, inside a backward.
bool backward_accumulates_any(const std::vector<torch::autograd::Node*>& accumulators);

}  // namespace pyreducer
