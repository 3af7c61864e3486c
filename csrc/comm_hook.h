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
#include <optional>
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
  // Whether the Reducer checks the result's dtype and device (a user's hook: a result narrower
  // than the bucket, e.g. compressed and never decompressed, or on another device, is an error).
  // Built-in hooks return their reduce dtype by design, cast back into the bucket.
  virtual bool checked_result() const { return false; }
  // Whether the future fails only when its collective failed (a peer died, froze or diverged),
  // so that the Reducer's error names the lost ranks (Reducer::set_failure_context). A user's
  // hook may also fail by its own error.
  virtual bool fails_by_collective() const { return false; }
  // Throws the error of bucket `bucket`'s failed future on `rank`: a CollectiveError where the
  // hook fails_by_collective(), else std::runtime_error.
  [[noreturn]] void throw_failure(size_t bucket, int rank, const std::string& error) const;
  // Every future this hook returned in the last synced backward was waited for (or the
  // iteration was abandoned): what only that backward needed may go. The Reducer calls it at
  // the backward's end (under deferred completion, at its last bucket's completion), under its
  // lock; the hook must not call back into the Reducer. Autograd or Python thread.
  virtual void backward_ended() {}
};

// Built-in compression hook, no Python: casts the bucket to `dtype` (float16 or bfloat16) after
// dividing by the world size in the bucket's own precision (no overflow in the cast),
// all-reduces the compressed copy, and casts the sum back into the bucket when it completes.
class CompressHook : public CommHook {
 public:
  CompressHook(ProcessGroupPtr group, at::ScalarType dtype);
  FuturePtr run(GradBucketView& bucket) override;
  std::string name() const override;
  bool fails_by_collective() const override { return true; }

 private:
  ProcessGroupPtr group_;
  at::ScalarType dtype_;
};

// Built-in hook that reduces each bucket with a chosen precision and scaling, no Python:
//   t = bucket (cast to reduce_dtype if given and different); t *= pre_multiplier (if not 1);
//   SUM all-reduce of t; then t *= post_value (kMultiply) or t /= post_value (kDivide);
// the reduced bucket is t (the Reducer copies it back into the bucket's dtype). It serves
// torch DDP's mixed_precision (reduce_dtype, divide by the world size after the sum, as torch's
// _reducer_allreduce_and_upcast_hook), Apex's allreduce_bucket (float32, 1/f before, f/world
// after) and pyreducer's own gradient_predivide_factor / reduce_dtype. Each scalar is a wrapped
// CPU double, so the rounding is that of the same Python expressions on a tensor.
class AveragingHook : public CommHook {
 public:
  enum class Post { kNone, kMultiply, kDivide };
  struct Options {
    std::optional<at::ScalarType> reduce_dtype;
    double pre_multiplier = 1.0;
    Post post = Post::kNone;
    double post_value = 1.0;
    std::string name = "averaging";  // for messages and the logging data
  };
  AveragingHook(ProcessGroupPtr group, Options options);
  FuturePtr run(GradBucketView& bucket) override;
  std::string name() const override { return options_.name; }
  bool fails_by_collective() const override { return true; }

 private:
  ProcessGroupPtr group_;
  Options options_;
};

}  // namespace pyreducer
