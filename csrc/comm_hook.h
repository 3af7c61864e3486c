// Communication hooks: what a bucket's communication does, with torch DDP's interface.
//
// Note [Communication hooks]
// Without a hook, the Reducer scales gradients by 1/world_size while copying them into the
// bucket and all-reduces the bucket (SUM). With a hook, gradients are copied unscaled and the
// hook owns the whole communication: it receives the bucket, returns a future whose value is the
// reduced bucket (averaging included), and the Reducer writes that value back into the
// gradients at the end of backward. Hooks run on the autograd thread, in bucket order, on every
// rank. A Python hook (bindings.cpp) takes the GIL for its own call only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "comm.h"

namespace pyreducer {

// What a hook sees of one bucket (torch's GradBucket): gradients are views into `buffer`.
struct GradBucketView {
  size_t index = 0;
  bool is_last = false;
  at::Tensor buffer;
  std::vector<at::Tensor> gradients;
  std::vector<at::Tensor> parameters;
};

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts this bucket's communication; the future's value is the reduced bucket.
  virtual FuturePtr run(GradBucketView& bucket) = 0;
  // The reduced bucket from the future's value (a Tensor, or a list holding one).
  virtual at::Tensor parse_result(const c10::IValue& value);
  // For error messages and logs.
  virtual std::string name() const = 0;
};

// Built-in compression hook, no Python: casts the bucket to `dtype` (float16 or bfloat16) after
// dividing by the world size in the bucket's own precision (no overflow in the cast),
// all-reduces the compressed copy, and casts the sum back into the bucket when it completes.
class CompressHook : public CommHook {
 public:
  CompressHook(ProcessGroupPtr group, at::ScalarType dtype);
  FuturePtr run(GradBucketView& bucket) override;
  std::string name() const override;

 private:
  ProcessGroupPtr group_;
  at::ScalarType dtype_;
};

}  // namespace pyreducer
