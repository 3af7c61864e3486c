// How the CUDA kernels scale a gradient: one definition, used by the kernels (ops_cuda.cu) and
// checked on the CPU by tests/cpp/test_ops.cpp, so the formula is tested without a GPU.
//
// Note [Rounding of the scaled copy]
// A bucket must hold bit for bit what torch DDP's batched copy puts there: the gradients copied,
// then the flat bucket divided by the world size with div_(scalar). ATen rounds that division
// differently per device:
//   CPU   true division in opmath (float for float16/bfloat16): x / d;
//   CUDA  with a CPU-scalar divisor, div_true_kernel_cuda (BinaryDivTrueKernel.cu) multiplies
//         by a reciprocal: x * opmath_t(1.0 / d), the reciprocal computed in double and rounded
//         to opmath once (torch before 2.9 computed opmath_t(1) / opmath_t(d); for integer d up
//         to 100000 both give the same float, checked with numpy).
// The two differ in the last bit for many x when d is not a power of two (3 ranks, 6, ...). The
// CPU kernels (ops.cpp) divide; the CUDA kernels use ReciprocalScale. The built-in compression
// hooks' cast_scaled follows the same rule, so it matches `(bucket / d).to(dtype)` on each
// device. The CUDA kernels are compiled, not run: no GPU has run them yet.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

namespace pyreducer {

template <typename scalar_t>
struct ReciprocalScale {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t inverse;

  // As ATen: the reciprocal in double, rounded once to opmath.
  explicit ReciprocalScale(double divisor) : inverse(static_cast<opmath_t>(1.0 / divisor)) {}

  // x / divisor as ATen's CUDA `x / divisor` rounds it, cast to out_t.
  template <typename out_t = scalar_t>
  C10_HOST_DEVICE out_t apply(scalar_t x) const {
    return static_cast<out_t>(static_cast<opmath_t>(x) * inverse);
  }
};

}  // namespace pyreducer
