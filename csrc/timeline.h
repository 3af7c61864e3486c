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
// Slots are allocated once, sized for the worst case (one bucket per parameter), so recording
// allocates nothing after construction, also across a bucket rebuild.
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
  // Set from the communication thread by a future's callback, which may run after the Reducer
  // has seen the work complete (and after the Reducer is gone): the callback holds a share.
  std::shared_ptr<std::atomic<int64_t>[]> bucket_done_ns;
};

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
