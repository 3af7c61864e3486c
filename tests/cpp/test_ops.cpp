// Checks the torch-dependent core without Python: the copy-in/copy-out kernels against plain
// ATen on random inputs. Built and run by ctest (links libtorch, not libtorch_python).
#include <cstdio>

#include <ATen/ATen.h>

#include "cuda/scale.h"
#include "ops.h"

namespace {

// The CUDA kernels' rounding (cuda/scale.h, Note [Rounding of the scaled copy]) on the CPU,
// against the same formula computed by ATen's CPU ops: x in opmath times (1 / d computed in
// double, rounded to opmath), rounded once to the element type. Also checks that the formula matters: for d = 3 it differs
// from true division (what the CPU kernels do) for some x, for d = 2 never.
template <typename scalar_t>
int check_reciprocal_scale(at::ScalarType dtype, double divisor) {
  using opmath_t = at::opmath_type<scalar_t>;
  const at::ScalarType opmath = c10::CppTypeToScalarType<opmath_t>::value;
  at::Tensor x = at::randn({4096}, at::TensorOptions().dtype(at::kDouble)).mul(1e3).to(dtype);
  at::Tensor inverse = at::full({}, 1.0 / divisor, at::TensorOptions().dtype(at::kDouble))
                           .to(opmath);
  at::Tensor expected = x.to(opmath).mul(inverse).to(dtype);
  at::Tensor divided = x.to(opmath).div(at::full({}, divisor, at::TensorOptions().dtype(opmath)))
                           .to(dtype);
  const pyreducer::ReciprocalScale<scalar_t> scale(divisor);
  at::Tensor ours = at::empty_like(x);
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* out = ours.data_ptr<scalar_t>();
  for (int64_t i = 0; i < x.numel(); ++i) out[i] = scale.apply(in[i]);
  const bool same = at::equal(ours, expected);
  const int64_t differ_from_division = ours.ne(divided).sum().item<int64_t>();
  const bool sensitive = divisor == 2.0 ? differ_from_division == 0
                                        : (dtype != at::kFloat && dtype != at::kDouble) ||
                                              differ_from_division > 0;
  std::printf("%s reciprocal scale dtype=%s divisor=%g (%lld of %lld differ from x / d)\n",
              same && sensitive ? "ok  " : "FAIL", c10::toString(dtype), divisor,
              static_cast<long long>(differ_from_division), static_cast<long long>(x.numel()));
  return same && sensitive ? 0 : 1;
}

}  // namespace

int main() {
  int failures = 0;
  at::manual_seed(0);
  for (double scale : {1.0, 0.5, 1.0 / 3.0}) {
    for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      at::Tensor grad = at::randn({7, 5}, at::TensorOptions().dtype(dtype)).t();  // non-contiguous
      at::Tensor flat = at::zeros({40}, grad.options());
      at::Tensor slot = flat.narrow(0, 3, 35).view({5, 7});
      pyreducer::copy_scaled_into(slot, grad, scale);
      at::Tensor expected = grad * scale;
      const bool ok = at::equal(slot, expected) && flat[0].item<double>() == 0.0;
      std::printf("%s copy_scaled_into dtype=%s scale=%.4f\n", ok ? "ok  " : "FAIL",
                  c10::toString(dtype), scale);
      failures += ok ? 0 : 1;
    }
  }
  at::Tensor param = at::randn({4, 3});
  at::Tensor slot = at::randn({4, 3});
  at::Tensor undefined;
  pyreducer::copy_out_of_slot(undefined, slot, param);
  at::Tensor existing = at::zeros({4, 3});
  pyreducer::copy_out_of_slot(existing, slot, param);
  const bool ok = undefined.defined() && at::equal(undefined, slot) && at::equal(existing, slot) &&
                  undefined.strides() == param.strides();
  std::printf("%s copy_out_of_slot (defined and undefined grad)\n", ok ? "ok  " : "FAIL");
  failures += ok ? 0 : 1;
  for (double divisor : {2.0, 3.0, 7.0}) {
    failures += check_reciprocal_scale<float>(at::kFloat, divisor);
    failures += check_reciprocal_scale<double>(at::kDouble, divisor);
    failures += check_reciprocal_scale<at::Half>(at::kHalf, divisor);
    failures += check_reciprocal_scale<at::BFloat16>(at::kBFloat16, divisor);
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
