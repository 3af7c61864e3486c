// Registers the CUDA implementations of the pyreducer ops (CUDA builds only).
// Non-contiguous gradients (e.g. channels-last) go through ATen's strided kernels one by one;
// contiguous ones through one fused launch per bucket.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../ops.h"
#include "ops_cuda.h"

namespace pyreducer {
namespace {

void copy_in_cuda(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets,
                  double divisor) {
  check_bucket_args(flat, grads.vec(), offsets.vec(), "pyreducer::bucket_copy_in");
  std::vector<at::Tensor> fused;
  std::vector<int64_t> fused_offsets;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    if (g.is_contiguous()) {
      fused.push_back(g);
      fused_offsets.push_back(offsets[k]);
    } else {
      at::Tensor slot = flat.narrow(0, offsets[k], g.numel()).view(g.sizes());
      divide_into(slot, g, divisor);  // See Note [Rounding of the scaled copy]
    }
  }
  at::Tensor out = flat;
  bucket_copy_in_cuda_contiguous(out, fused, fused_offsets, divisor);
}

void copy_out_cuda(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets) {
  check_bucket_args(flat, grads.vec(), offsets.vec(), "pyreducer::bucket_copy_out");
  std::vector<at::Tensor> fused;
  std::vector<int64_t> fused_offsets;
  for (size_t k = 0; k < grads.size(); ++k) {
    at::Tensor g = grads[k];
    if (g.is_contiguous()) {
      fused.push_back(g);
      fused_offsets.push_back(offsets[k]);
    } else {
      g.copy_(flat.narrow(0, offsets[k], g.numel()).view(g.sizes()));
    }
  }
  bucket_copy_out_cuda_contiguous(flat, fused, fused_offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyreducer, CUDA, m) {
  m.impl("bucket_copy_in", &copy_in_cuda);
  m.impl("bucket_copy_out", &copy_out_cuda);
  m.impl("cast_scaled", &cast_scaled_cuda);
}

}  // namespace pyreducer
