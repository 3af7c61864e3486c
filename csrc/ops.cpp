#include "ops.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

namespace pyreducer {

void check_bucket_args(const at::Tensor& flat, const std::vector<at::Tensor>& grads,
                       const std::vector<int64_t>& offsets, const char* op) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), op,
              ": expected a 1-D contiguous bucket, got shape ", flat.sizes());
  TORCH_CHECK(grads.size() == offsets.size(), op, ": expected one offset per gradient, got ",
              offsets.size(), " offsets for ", grads.size(), " gradients");
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    TORCH_CHECK(g.scalar_type() == flat.scalar_type() && g.device() == flat.device(), op,
                ": gradient ", k, " is ", g.scalar_type(), " on ", g.device(),
                ", expected ", flat.scalar_type(), " on ", flat.device());
    TORCH_CHECK(offsets[k] >= 0 && offsets[k] + g.numel() <= flat.numel(), op, ": gradient ", k,
                " (", g.numel(), " elements at offset ", offsets[k],
                ") does not fit a bucket of ", flat.numel());
  }
}

at::Tensor wrapped_scalar(double value) {
  at::Tensor scalar = c10::scalar_to_tensor(at::Scalar(value));
  scalar.unsafeGetTensorImpl()->set_wrapped_number(true);
  return scalar;
}

void copy_scaled_into(at::Tensor& slot, const at::Tensor& grad, double scale) {
  at::mul_out(slot, grad, wrapped_scalar(scale));
}

void divide_into(at::Tensor& slot, const at::Tensor& grad, double divisor) {
  at::div_out(slot, grad, wrapped_scalar(divisor));
}

void copy_out_of_slot(at::Tensor& grad, const at::Tensor& slot, const at::Tensor& param) {
  if (grad.defined()) {
    grad.copy_(slot);
    return;
  }
  if (param.is_non_overlapping_and_dense()) {
    grad = at::empty_strided(param.sizes(), param.strides(), slot.options());
  } else {
    grad = at::empty(param.sizes(), slot.options());
  }
  grad.copy_(slot);
}

void bucket_copy_in_cpu(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                        const std::vector<int64_t>& offsets, double divisor) {
  check_bucket_args(flat, grads, offsets, "pyreducer::bucket_copy_in");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "bucket_copy_in",
                                  [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const opmath_t d = static_cast<opmath_t>(divisor);
    scalar_t* out = flat.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(grads.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        const at::Tensor& g = grads[k];
        if (g.is_contiguous()) {
          const scalar_t* in = g.const_data_ptr<scalar_t>();
          scalar_t* dst = out + offsets[k];
          if constexpr (std::is_same_v<scalar_t, opmath_t>) {  // float, double: SIMD division
            using Vec = at::vec::Vectorized<scalar_t>;
            at::vec::map([d](Vec x) { return x / Vec(d); }, dst, in, g.numel());
          } else {  // float16, bfloat16: divide in float, round once
            for (int64_t i = 0; i < g.numel(); ++i) {
              dst[i] = static_cast<scalar_t>(static_cast<opmath_t>(in[i]) / d);
            }
          }
        } else {  // strided (e.g. channels-last): ATen walks the strides
          at::Tensor slot = flat.narrow(0, offsets[k], g.numel()).view(g.sizes());
          divide_into(slot, g, divisor);
        }
      }
    });
  });
}

void bucket_copy_out_cpu(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                         const std::vector<int64_t>& offsets) {
  check_bucket_args(flat, grads, offsets, "pyreducer::bucket_copy_out");
  const auto* src = static_cast<const char*>(flat.const_data_ptr());
  const size_t element_bytes = flat.element_size();
  at::parallel_for(0, static_cast<int64_t>(grads.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      at::Tensor& g = grads[k];
      if (g.is_contiguous()) {  // same dtype (checked): a plain memory copy
        std::memcpy(g.data_ptr(), src + offsets[k] * element_bytes, g.numel() * element_bytes);
      } else {
        g.copy_(flat.narrow(0, offsets[k], g.numel()).view(g.sizes()));
      }
    }
  });
}

at::Tensor cast_scaled_cpu(const at::Tensor& src, at::ScalarType dtype, double divisor) {
  at::Tensor out = at::empty({src.numel()}, src.options().dtype(dtype));
  at::Tensor flat = src.reshape({-1});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "cast_scaled", [&] {
    using in_t = scalar_t;
    using opmath_t = at::opmath_type<in_t>;
    const in_t* in = flat.contiguous().const_data_ptr<in_t>();
    const opmath_t d = static_cast<opmath_t>(divisor);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "cast_scaled_out", [&] {
      scalar_t* dst = out.data_ptr<scalar_t>();
      at::parallel_for(0, flat.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          dst[i] = static_cast<scalar_t>(static_cast<opmath_t>(in[i]) / d);
        }
      });
    });
  });
  return out;
}

// Device dispatch for the C++ callers goes through the registered ops (so a CUDA build adds
// its kernels without this file knowing about CUDA).
void bucket_copy_in(at::Tensor& flat, const std::vector<at::Tensor>& grads,
                    const std::vector<int64_t>& offsets, double divisor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyreducer::bucket_copy_in", "")
                       .typed<void(const at::Tensor&, at::TensorList, at::IntArrayRef, double)>();
  op.call(flat, grads, offsets, divisor);
}

void bucket_copy_out(const at::Tensor& flat, std::vector<at::Tensor>& grads,
                     const std::vector<int64_t>& offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyreducer::bucket_copy_out", "")
                       .typed<void(const at::Tensor&, at::TensorList, at::IntArrayRef)>();
  op.call(flat, grads, offsets);
}

at::Tensor cast_scaled(const at::Tensor& src, at::ScalarType dtype, double divisor) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyreducer::cast_scaled", "")
                       .typed<at::Tensor(const at::Tensor&, at::ScalarType, double)>();
  return op.call(src, dtype, divisor);
}

namespace {

void copy_in_op_cpu(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets,
                    double divisor) {
  at::Tensor out = flat;
  bucket_copy_in_cpu(out, grads.vec(), offsets.vec(), divisor);
}

void copy_out_op_cpu(const at::Tensor& flat, at::TensorList grads, at::IntArrayRef offsets) {
  std::vector<at::Tensor> targets = grads.vec();  // aliases: copy_ writes the caller's tensors
  bucket_copy_out_cpu(flat, targets, offsets.vec());
}

void copy_in_op_meta(const at::Tensor&, at::TensorList, at::IntArrayRef, double) {}
void copy_out_op_meta(const at::Tensor&, at::TensorList, at::IntArrayRef) {}
at::Tensor cast_scaled_meta(const at::Tensor& src, at::ScalarType dtype, double) {
  return at::empty_symint({src.sym_numel()}, src.options().dtype(dtype));  // dynamic shapes
}

}  // namespace

TORCH_LIBRARY(pyreducer, m) {
  m.def("bucket_copy_in(Tensor(a!) flat, Tensor[] grads, int[] offsets, float divisor) -> ()");
  m.def("bucket_copy_out(Tensor flat, Tensor(a!)[] grads, int[] offsets) -> ()");
  m.def("cast_scaled(Tensor src, ScalarType dtype, float divisor) -> Tensor");
}

TORCH_LIBRARY_IMPL(pyreducer, CPU, m) {
  m.impl("bucket_copy_in", &copy_in_op_cpu);
  m.impl("bucket_copy_out", &copy_out_op_cpu);
  m.impl("cast_scaled", &cast_scaled_cpu);
}

TORCH_LIBRARY_IMPL(pyreducer, Meta, m) {
  m.impl("bucket_copy_in", &copy_in_op_meta);
  m.impl("bucket_copy_out", &copy_out_op_meta);
  m.impl("cast_scaled", &cast_scaled_meta);
}

}  // namespace pyreducer
