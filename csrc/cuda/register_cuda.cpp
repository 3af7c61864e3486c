// Registers the CUDA implementations of the pyreducer ops (CUDA builds only).
// Non-contiguous gradients (e.g. channels-last) go through ATen's strided kernels one by one;
// contiguous ones through one fused launch per bucket.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops_cuda.h"

namespace pyreducer {
namespace {

void copy_in_cuda(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets,
                  double divisor) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "pyreducer::bucket_copy_in: expected a "
              "1-D contiguous bucket, got shape ", flat.sizes());
  TORCH_CHECK(grads.size() == offsets.size(), "pyreducer::bucket_copy_in: expected one offset "
              "per gradient, got ", offsets.size(), " offsets for ", grads.size(), " gradients");
  std::vector<at::Tensor> fused;
  std::vector<int64_t> fused_offsets;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    TORCH_CHECK(g.scalar_type() == flat.scalar_type() && g.device() == flat.device(),
                "pyreducer::bucket_copy_in: gradient ", k, " is ", g.scalar_type(), " on ",
                g.device(), ", expected ", flat.scalar_type(), " on ", flat.device());
    TORCH_CHECK(offsets[k] >= 0 && offsets[k] + g.numel() <= flat.numel(),
                "pyreducer::bucket_copy_in: gradient ", k, " does not fit the bucket");
    if (g.is_contiguous()) {
      fused.push_back(g);
      fused_offsets.push_back(offsets[k]);
    } else {
      at::Tensor slot = flat.narrow(0, offsets[k], g.numel()).view(g.sizes());
      at::div_out(slot, g, at::scalar_tensor(divisor, g.options().dtype(at::kDouble)));
    }
  }
  at::Tensor out = flat;
  bucket_copy_in_cuda_contiguous(out, fused, fused_offsets, divisor);
}

void copy_out_cuda(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets) {
  TORCH_CHECK(grads.size() == offsets.size(), "pyreducer::bucket_copy_out: expected one offset "
              "per gradient, got ", offsets.size(), " offsets for ", grads.size(), " gradients");
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
