#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>

namespace pyreducer {

void copy_scaled_into(at::Tensor& slot, const at::Tensor& grad, double scale) {
  at::Tensor factor = c10::scalar_to_tensor(at::Scalar(scale));
  factor.unsafeGetTensorImpl()->set_wrapped_number(true);
  at::mul_out(slot, grad, factor);
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

}  // namespace pyreducer
