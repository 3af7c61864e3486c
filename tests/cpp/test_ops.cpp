// Checks the torch-dependent core without Python: the copy-in/copy-out kernels against plain
// ATen on random inputs. Built and run by ctest (links libtorch, not libtorch_python).
#include <cstdio>

#include <ATen/ATen.h>

#include "ops.h"

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
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
