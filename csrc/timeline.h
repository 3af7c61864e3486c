// Per-iteration, per-rank event times of the Reducer, kept in a bounded ring buffer.
//
// Note [Timeline]
// Every synced iteration records these events, on the host's monotonic clock in nanoseconds:
//   backward_start  the sink node's backward (the outer backward begins; else the first hook);
//   grad_ready[i]   parameter i's gradient was taken into its slot;
//   bucket ready    the bucket's last slot was filled; launch: its all-reduce was issued;
//   bucket done     the all-reduce's future completed (set from the communication thread);
//   backward_end    the end-of-backward callback started (autograd's compute is over);
//   wait_start/end  around the final wait for all buckets (without find_unused_parameters, bucket
//                   b is written back inside it, while later buckets are still in flight);
//                   finalize_end: all gradients written back.
// Slots are allocated once, sized for the worst case (one bucket per parameter), so a record
// allocates nothing after construction, also across a bucket rebuild; each recorded collective
// allocates its completion stamp (Note [Completion stamps]) at its launch, beside its work.
//
// Note [Completion stamps]
// A collective's completion time is stamped by a callback on its future, on the thread that
// completes it. c10's Future::markCompleted wakes the waiters before it runs the callbacks, and
// callbacks registered before the Reducer's (a user's, torchft's, a hook's continuation's) run
// first, so the wait at the end of backward can return before the stamp is written. So each
// collective's CompletionStamp is written once, by whichever comes first: its callback, or the
// waiter as soon as its wait returned (the earlier time wins; both are after the completion).
// The Reducer reads a bucket's stamps only after waiting for it, and writes the record's done
// time itself, under its lock, before the wait returns: a finished step's timeline is final, and
// a late callback writes only its own stamp, never a record slot a later iteration has reused.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

namespace pyreducer {

struct IterationRecord {
  size_t slot = 0;           // index in the ring (see DeviceTimeline)
  int64_t iteration = -1;    // synced iteration number (1-based); -1: slot unused
  int64_t plan_version = 0;  // which bucket plan was in force (see Reducer::plan_history)
  bool complete = false;
  int64_t backward_start_ns = 0;
  int64_t backward_end_ns = 0;
  int64_t wait_start_ns = 0;
  int64_t wait_end_ns = 0;
  int64_t finalize_end_ns = 0;
  size_t num_buckets = 0;
  std::vector<int64_t> grad_ready_ns;     // per parameter; 0 = not ready in this iteration
  std::vector<int64_t> bucket_ready_ns;   // per bucket (capacity: one per parameter)
  std::vector<int64_t> bucket_launch_ns;
  // Written by the waiter once the bucket's reduction was waited for (Note [Completion stamps]).
  std::vector<int64_t> bucket_done_ns;
};

// One collective's completion time (see Note [Completion stamps]); shared by the callback that
// stamps it and the Reducer, either of which may go first.
class CompletionStamp {
 public:
  // Stores Timeline::now_ns() unless a time is there already: the first writer wins. Any thread.
  void stamp();
  // Stores `ns` unless a time is there already (a time taken elsewhere). Any thread.
  void stamp_at(int64_t ns);
  // The time, 0 before the first stamp. Any thread.
  int64_t ns() const { return ns_.load(std::memory_order_acquire); }

 private:
  std::atomic<int64_t> ns_{0};
};
using StampPtr = std::shared_ptr<CompletionStamp>;

class Timeline {
 public:
  // `capacity` iterations (0 disables recording), `num_params` parameters.
  Timeline(size_t capacity, size_t num_params);

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool enabled() const { return !slots_.empty(); }

  // Starts recording iteration `iteration` in the oldest slot and returns it; nullptr when
  // disabled. Caller holds the Reducer's mutex.
  IterationRecord* begin(int64_t iteration, int64_t plan_version, size_t num_buckets,
                         int64_t start_ns);

  // Completed records, oldest first, at most `last`. Caller holds the Reducer's mutex.
  std::vector<const IterationRecord*> completed(size_t last) const;

  // The record in ring slot `slot` (null past the end). Caller holds the Reducer's mutex.
  const IterationRecord* at(size_t slot) const {
    return slot < slots_.size() ? &slots_[slot] : nullptr;
  }
  // The record of iteration `iteration` if ring slot `slot` still holds it, else null (the slot
  // was reused, or recording is off). Caller holds the Reducer's mutex.
  IterationRecord* find(size_t slot, int64_t iteration) {
    if (slot >= slots_.size() || slots_[slot].iteration != iteration) return nullptr;
    return &slots_[slot];
  }

  size_t capacity() const { return slots_.size(); }

 private:
  std::vector<IterationRecord> slots_;
  size_t next_ = 0;
};

// A copy of the times of one completed iteration (Reducer::timeline takes it under the
// Reducer's lock, so nothing else needs the lock to read it). All times in ns; 0 = not recorded.
struct EventTimes {
  int64_t backward_start_ns = 0;
  int64_t backward_end_ns = 0;
  int64_t wait_start_ns = 0;
  int64_t wait_end_ns = 0;
  int64_t finalize_end_ns = 0;
  std::vector<int64_t> grad_ready_ns;    // per parameter
  std::vector<int64_t> bucket_ready_ns;  // per bucket of the plan then in force
  std::vector<int64_t> bucket_launch_ns;
  std::vector<int64_t> bucket_done_ns;
};

struct IterationTimes {
  size_t slot = 0;
  int64_t iteration = 0;
  int64_t plan_version = 0;
  std::vector<std::vector<int64_t>> plan;  // the bucket plan then in force, launch order
  EventTimes times;  // the host's clock, or the device's (see Note [Device timeline])
  bool device_clock = false;
  EventTimes host;  // the host's times again, when `times` are the device's
};

// The host times of a completed record.
EventTimes host_times(const IterationRecord& record);

}  // namespace pyreducer
