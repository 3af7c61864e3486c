// Stateless copy/scale kernels used by the Reducer's per-gradient path.
// CPU implementations live in ops.cpp; they work on any device through ATen.
#pragma once

#include <ATen/core/Tensor.h>

namespace pyreducer {

// Writes `grad * scale` into `slot` (same shape; strides may differ) in one pass.
// The multiply uses a wrapped scalar, so it rounds exactly as torch DDP's copy-in does.
// Called from the autograd hook thread; no allocation.
void copy_scaled_into(at::Tensor& slot, const at::Tensor& grad, double scale);

// Writes the reduced `slot` back into `grad`; if `grad` is undefined, makes it a copy of `slot`
// laid out like `param` (dense, same strides), as AccumulateGrad would have.
// Called from the end-of-backward callback.
void copy_out_of_slot(at::Tensor& grad, const at::Tensor& slot, const at::Tensor& param);

}  // namespace pyreducer
