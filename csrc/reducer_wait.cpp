// The Reducer's waits: a bucket's reduction waited for, a communication hook's result checked
// and taken, the completion written into the timeline record (Note [Completion stamps] in
// timeline.h). The state machine that calls them lives in reducer.cpp.
#include "reducer.h"

#include <algorithm>
#include <stdexcept>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

namespace pyreducer {

void Reducer::wait_bucket(size_t b) {
  Bucket& bucket = set_.buckets[b];
  if (bucket.skipped) return;
  note_wait_stream(bucket);
  if (bucket.ring_job) {  // See Note [Ring collectives on Gloo]
    bucket.ring_job->wait();
    record_done(b);
    return;
  }
  if (!bucket.future) {
    for (size_t k = 0; k < bucket.works.size(); ++k) {
      wait_or_throw(bucket.works[k], group_,
                    std::string(sharded_ ? "reduce-scatter" : "all-reduce") + " of bucket " +
                        std::to_string(b) +
                        (bucket.works.size() > 1 ? " (chunk " + std::to_string(k) + " of " +
                                                       std::to_string(bucket.works.size()) + ")"
                                                 : std::string()));
      if (k < bucket.done_stamps.size() && bucket.done_stamps[k]) bucket.done_stamps[k]->stamp();
    }
    record_done(b);
    if (bucket.sparse) {  // a sparse all-reduce may return its sum as a new tensor
      const std::vector<at::Tensor> result = bucket.works.front()->result();
      if (!result.empty() && !result.front().is_same(bucket.flat)) {
        at::NoGradGuard no_grad;
        bucket.flat.copy_(result.front());
      }
    }
  } else {
    bucket.future->wait();
    if (bucket.future->hasError()) {
      comm_hook_->throw_failure(b, group_->getRank(), bucket.future->tryRetrieveErrorMessage());
    }
    for (const StampPtr& stamp : bucket.done_stamps) {
      if (stamp) stamp->stamp();
    }
    record_done(b);
    take_hook_result(b);
  }
}

void Reducer::take_hook_result(size_t b) {
  Bucket& bucket = set_.buckets[b];
  at::Tensor result = comm_hook_->parse_result(bucket.future->value());
  if (result.is_same(bucket.flat)) return;
  if (result.numel() != bucket.flat.numel()) {
    throw std::runtime_error("pyreducer: communication hook " + comm_hook_->name() +
                             " returned " + std::to_string(result.numel()) +
                             " elements for bucket " + std::to_string(b) + ", expected " +
                             std::to_string(bucket.flat.numel()));
  }
  // A user's compressing hook that forgot to decompress would otherwise be cast back silently,
  // with the compressed precision (torch DDP casts). A wider result is cast back as torch DDP
  // does.
  const bool narrower =
      c10::elementSize(result.scalar_type()) < c10::elementSize(bucket.flat.scalar_type()) ||
      (bucket.flat.is_floating_point() && !result.is_floating_point());
  if (comm_hook_->checked_result() && (narrower || result.device() != bucket.flat.device())) {
    throw std::runtime_error(
        "pyreducer: communication hook " + comm_hook_->name() + " returned a " +
        std::string(c10::toString(result.scalar_type())) + " tensor on " +
        result.device().str() + " for bucket " + std::to_string(b) + " on rank " +
        std::to_string(group_->getRank()) + ", expected " +
        c10::toString(bucket.flat.scalar_type()) + " on " + bucket.flat.device().str() +
        " (or a wider dtype on that device: decompress or move the result back)");
  }
  at::NoGradGuard no_grad;
  bucket.flat.copy_(bucket.sparse ? result : result.reshape({-1}));
}

void Reducer::record_done(size_t b) {
  Bucket& bucket = set_.buckets[b];
  const int64_t iteration = bucket.record_iteration;
  bucket.record_iteration = -1;  // once per launch
  IterationRecord* record = iteration < 0 ? nullptr : timeline_.find(bucket.record_slot, iteration);
  if (record == nullptr) return;
  // The last of its collectives (chunks) to complete.
  int64_t done_ns = bucket.ring_job ? bucket.ring_job->done_ns() : 0;
  for (const StampPtr& stamp : bucket.done_stamps) {
    if (stamp) done_ns = std::max(done_ns, stamp->ns());
  }
  record->bucket_done_ns[b] = done_ns;
  if (!device_timeline_) return;
  c10::intrusive_ptr<c10::ivalue::Future> future = bucket.future;
  if (!future && !bucket.works.empty()) {
    try {
      future = bucket.works.back()->getFuture();
    } catch (const std::exception&) {
      return;  // a backend without futures: no device done time (as at the launch)
    }
  }
  if (future) device_timeline_->seal_bucket_done(record->slot, b, future);
}

}  // namespace pyreducer
