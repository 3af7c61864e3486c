#include "comm_hook.h"

#include <stdexcept>

#include <ATen/ATen.h>

#include "ops.h"

namespace pyreducer {

namespace {

// A continuation (Future::then) runs whether its parent succeeded or failed, and completes its
// own future with what it returns: it must pass a failed collective's error on, or the Reducer
// would write the unreduced bucket back as if it were the average.
void rethrow_if_failed(c10::ivalue::Future& done) {
  if (done.hasError()) std::rethrow_exception(done.exception_ptr());
}

}  // namespace

at::Tensor CommHook::parse_result(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList() && value.toTensorList().size() == 1) return value.toTensorList()[0];
  if (value.isList() && value.toList().size() == 1 && value.toList().get(0).isTensor()) {
    return value.toList().get(0).toTensor();
  }
  throw std::runtime_error("pyreducer: communication hook " + name() +
                           " returned a future of " + value.tagKind() +
                           "; expected a Future[Tensor] holding the reduced bucket");
}

void CommHook::throw_failure(size_t bucket, int rank, const std::string& error) const {
  const std::string message = "pyreducer: communication hook " + name() + " failed for bucket " +
                              std::to_string(bucket) + " on rank " + std::to_string(rank) + ": " +
                              error;
  if (fails_by_collective()) throw CollectiveError(message);
  throw std::runtime_error(message);
}

CompressHook::CompressHook(ProcessGroupPtr group, at::ScalarType dtype)
    : group_(std::move(group)), dtype_(dtype) {
  if (dtype_ != at::kHalf && dtype_ != at::kBFloat16) {
    throw std::invalid_argument(std::string("CompressHook: expected float16 or bfloat16, got ") +
                                c10::toString(dtype_));
  }
}

std::string CompressHook::name() const {
  return std::string("builtin ") + (dtype_ == at::kHalf ? "fp16" : "bf16") + " compression";
}

FuturePtr CompressHook::run(GradBucketView& bucket) {
  at::Tensor compressed = cast_scaled(bucket.buffer, dtype_, static_cast<double>(group_->getSize()));
  WorkPtr work = allreduce_sum_async(group_, compressed);
  at::Tensor buffer = bucket.buffer;
  // On CUDA, `compressed` is read back in the callback below, on another stream than it was
  // written on. That is safe without record_stream: the work's future is CUDA-aware, so
  // ivalue::Future runs the callback on a pool stream that has first waited for the
  // all-reduce's events, and records the value's storage (`compressed`) on that stream for the
  // caching allocator; the child future's own events then order the Reducer's wait after the
  // copy. (Compiled, not run: no GPU.)
  return work->getFuture()->then(
      [buffer, compressed](c10::ivalue::Future& done) -> c10::IValue {
        rethrow_if_failed(done);
        at::Tensor target = buffer;  // a handle to the same storage
        target.copy_(compressed);    // decompress in place
        return c10::IValue(buffer);
      },
      c10::TensorType::get());
}

AveragingHook::AveragingHook(ProcessGroupPtr group, Options options)
    : group_(std::move(group)), options_(std::move(options)) {
  if (options_.post == Post::kDivide && options_.post_value == 0.0) {
    throw std::invalid_argument("AveragingHook: expected a non-zero divisor, got 0");
  }
}

FuturePtr AveragingHook::run(GradBucketView& bucket) {
  at::NoGradGuard no_grad;
  at::Tensor reduced = bucket.buffer;
  if (options_.reduce_dtype && reduced.scalar_type() != *options_.reduce_dtype) {
    reduced = reduced.to(*options_.reduce_dtype);
  }
  if (options_.pre_multiplier != 1.0) reduced.mul_(wrapped_scalar(options_.pre_multiplier));
  WorkPtr work = allreduce_sum_async(group_, reduced);
  // The callback runs once the sum is done (on CUDA: on a stream that waited for it; see
  // CompressHook::run).
  return work->getFuture()->then(
      [reduced, post = options_.post, value = options_.post_value](
          c10::ivalue::Future& done) -> c10::IValue {
        rethrow_if_failed(done);
        at::NoGradGuard no_grad;
        at::Tensor t = reduced;
        if (post == Post::kMultiply) t.mul_(wrapped_scalar(value));
        if (post == Post::kDivide) t.div_(wrapped_scalar(value));
        return c10::IValue(t);
      },
      c10::TensorType::get());
}

}  // namespace pyreducer
