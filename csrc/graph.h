// Autograd-graph utilities for the Reducer (no Python).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace pyreducer {

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
