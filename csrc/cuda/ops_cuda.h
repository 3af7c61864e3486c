// CUDA launchers (cuda/ops_cuda.cu), registered as the CUDA implementations of the pyreducer ops
// by cuda/register_cuda.cpp. Only in CUDA builds (setup.py, PYREDUCER_CUDA).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace pyreducer {

// Copy-in/out for contiguous gradients in one launch per bucket (see bucket_copy_in in ops.h).
void bucket_copy_in_cuda_contiguous(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                                    const std::vector<int64_t>& offsets, double divisor);
void bucket_copy_out_cuda_contiguous(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                                     const std::vector<int64_t>& offsets);
at::Tensor cast_scaled_cuda(const at::Tensor& src, at::ScalarType dtype, double divisor);

}  // namespace pyreducer
