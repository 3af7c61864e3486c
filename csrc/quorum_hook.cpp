#include "quorum_hook.h"

#include <stdexcept>
#include <utility>

#include <ATen/ATen.h>

#include "ops.h"

namespace pyreducer {

namespace {

// The bucket as it is, as a completed future (a skipped or failed step).
FuturePtr completed(const at::Tensor& buffer) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  future->markCompleted(c10::IValue(buffer));
  return future;
}

}  // namespace

bool QuorumHook::Step::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!error.empty()) return false;
  error = message;
  return true;
}

bool QuorumHook::Step::failed() {
  std::lock_guard<std::mutex> lock(mutex);
  return !error.empty();
}

QuorumHook::QuorumHook(ErrorSink on_error) : on_error_(std::move(on_error)) {}

void QuorumHook::begin_step(ProcessGroupPtr group, int64_t participants, bool participating) {
  if (!group) {
    throw std::invalid_argument("QuorumHook::begin_step: expected a process group, got none");
  }
  if (participants < 1) {
    throw std::invalid_argument("QuorumHook::begin_step: expected at least 1 participant, got " +
                                std::to_string(participants));
  }
  auto step = std::make_shared<Step>();
  step->group = std::move(group);
  step->participants = participants;
  step->participating = participating;
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = std::move(step);
}

void QuorumHook::skip_step(const std::string& why) {
  auto step = std::make_shared<Step>();
  step->error = why.empty() ? "skipped" : why;
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = std::move(step);
}

void QuorumHook::refuse_step(const std::string& why) {
  auto step = std::make_shared<Step>();
  step->refused = why.empty() ? "no quorum for this backward" : why;
  step->error = step->refused;
  std::lock_guard<std::mutex> lock(mutex_);
  step_ = std::move(step);
}

void QuorumHook::backward_ended() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (step_) step_->group.reset();  // run() reads it on the autograd thread of this backward
}

bool QuorumHook::holds_group() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return step_ && step_->group;
}

std::string QuorumHook::step_error() const {
  std::shared_ptr<Step> step;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    step = step_;
  }
  if (!step) return "no step begun";
  std::lock_guard<std::mutex> lock(step->mutex);
  return step->error;
}

FuturePtr QuorumHook::run(GradBucketView& bucket) {
  at::NoGradGuard no_grad;
  std::shared_ptr<Step> step;
  ProcessGroupPtr group;  // (backward_ended lets the step's go, under mutex_)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    step = step_;
    if (step) group = step->group;
  }
  at::Tensor buffer = bucket.buffer;
  if (!step) {
    const std::string message = "pyreducer.torchft: bucket " + std::to_string(bucket.index) +
                                " reached its all-reduce before the step's quorum was known";
    auto fresh = std::make_shared<Step>();
    fresh->error = message;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      step_ = fresh;
    }
    if (on_error_) on_error_(message);
    return completed(buffer);
  }
  if (!step->refused.empty()) throw std::runtime_error(step->refused);
  if (!group || step->failed()) return completed(buffer);  // skipped, or already failed
  if (!step->participating) buffer.zero_();
  const size_t index = bucket.index;
  // A copy of the sink: a continuation may run after this hook is gone (a Reducer dropped
  // while a failed step's all-reduces were still in flight).
  auto report = [sink = on_error_, step, index](const std::string& what) {
    const std::string message =
        "all-reduce of bucket " + std::to_string(index) + " failed: " + what;
    if (step->fail(message) && sink) sink(message);
  };
  WorkPtr work;
  try {
    work = allreduce_sum_async(group, buffer);
  } catch (const std::exception& error) {
    report(error.what());
    return completed(buffer);
  }
  return work->getFuture()->then(
      [buffer, step, report](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          report(done.tryRetrieveErrorMessage());
          return c10::IValue(buffer);
        }
        at::NoGradGuard no_grad;
        at::Tensor sum = buffer;
        sum.div_(wrapped_scalar(static_cast<double>(step->participants)));
        return c10::IValue(sum);
      },
      c10::TensorType::get());
}

}  // namespace pyreducer
