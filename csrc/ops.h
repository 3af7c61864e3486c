// Stateless copy/scale/cast kernels of the Reducer (CPU here; CUDA in cuda/ops_cuda.cu).
//
// They are also registered as torch ops (namespace "pyreducer", see ops.cpp) so Python and
// torch.library.opcheck can call them; the Reducer calls the C++ functions directly.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace pyreducer {

// A 0-dim CPU tensor marked as a wrapped number: what ATen makes of a Python number operand, so
// binary ops with it round as the same Python expression does, on every device.
at::Tensor wrapped_scalar(double value);

// Writes `grad * scale` into `slot` (same shape; strides may differ) in one pass.
// The multiply uses a wrapped scalar, so it rounds exactly as torch DDP's per-gradient copy-in.
// Called from the autograd hook thread.
void copy_scaled_into(at::Tensor& slot, const at::Tensor& grad, double scale);

// Writes `grad / divisor` into `slot` (same shape; strides may differ), rounded exactly as ATen's
// `grad / divisor` with a Python-number divisor on grad's device (see Note [Rounding of the
// scaled copy] in cuda/scale.h): the divisor is a wrapped CPU scalar, never a device tensor (no
// allocation or fill kernel per gradient). For the strided slots of the batched copy-in.
void divide_into(at::Tensor& slot, const at::Tensor& grad, double divisor);

// Writes the reduced `slot` back into `grad`; if `grad` is undefined, makes it a copy of `slot`
// laid out like `param` (dense, same strides), as AccumulateGrad would have.
void copy_out_of_slot(at::Tensor& grad, const at::Tensor& slot, const at::Tensor& param);

// Fused copy-in of a whole bucket: flat[offsets[k] : offsets[k] + grads[k].numel()] =
// grads[k] / divisor in row-major (logical) order, for every k, in one pass (the division rounds as torch DDP's batched copy
// does: copy, then divide). `flat` is 1-D contiguous; grads match its dtype and device and may
// be non-contiguous (channels-last included). Dispatches on the device (CPU: parallel over
// tensors; CUDA: one launch).
void bucket_copy_in(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                    const std::vector<int64_t>& offsets, double divisor);

// Fused copy-out: grads[k] = flat[offsets[k] : ...] read in row-major order, viewed in grads[k]'s
// shape. The Reducer uses both for parameters whose slot is row-major (contiguous parameters).
void bucket_copy_out(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                     const std::vector<int64_t>& offsets);

// (src / divisor) cast to `dtype`, computed in src's precision before the cast, so large values
// do not overflow float16. Returns a new contiguous 1-D tensor.
at::Tensor cast_scaled(const at::Tensor& src, at::ScalarType dtype, double divisor);

// Checks the arguments of bucket_copy_in/out (all devices): a 1-D contiguous bucket, one offset
// per gradient, matching dtype and device, every slot inside the bucket. `op` names the op in
// the error.
void check_bucket_args(const at::Tensor& flat, const std::vector<at::Tensor>& grads,
                       const std::vector<int64_t>& offsets, const char* op);

// Per-device implementations, registered by the files that define them.
void bucket_copy_in_cpu(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                        const std::vector<int64_t>& offsets, double divisor);
void bucket_copy_out_cpu(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                         const std::vector<int64_t>& offsets);
at::Tensor cast_scaled_cpu(const at::Tensor& src, at::ScalarType dtype, double divisor);

}  // namespace pyreducer
