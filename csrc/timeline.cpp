#include "timeline.h"

#include <algorithm>

namespace pyreducer {

void CompletionStamp::stamp() { stamp_at(Timeline::now_ns()); }

void CompletionStamp::stamp_at(int64_t ns) {
  int64_t unset = 0;
  ns_.compare_exchange_strong(unset, ns, std::memory_order_acq_rel);
}

Timeline::Timeline(size_t capacity, size_t num_params) : slots_(capacity) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    IterationRecord& slot = slots_[i];
    slot.slot = i;
    slot.grad_ready_ns.assign(num_params, 0);
    slot.bucket_ready_ns.assign(num_params, 0);
    slot.bucket_launch_ns.assign(num_params, 0);
    slot.bucket_done_ns.assign(num_params, 0);
  }
}

IterationRecord* Timeline::begin(int64_t iteration, int64_t plan_version, size_t num_buckets,
                                 int64_t start_ns) {
  if (slots_.empty()) return nullptr;
  IterationRecord& slot = slots_[next_];
  next_ = (next_ + 1) % slots_.size();
  slot.iteration = iteration;
  slot.plan_version = plan_version;
  slot.complete = false;
  slot.backward_start_ns = start_ns;
  slot.backward_end_ns = slot.wait_start_ns = slot.wait_end_ns = slot.finalize_end_ns = 0;
  slot.num_buckets = num_buckets;
  std::fill(slot.grad_ready_ns.begin(), slot.grad_ready_ns.end(), 0);
  std::fill(slot.bucket_ready_ns.begin(), slot.bucket_ready_ns.end(), 0);
  std::fill(slot.bucket_launch_ns.begin(), slot.bucket_launch_ns.end(), 0);
  std::fill(slot.bucket_done_ns.begin(), slot.bucket_done_ns.end(), 0);
  return &slot;
}

EventTimes host_times(const IterationRecord& record) {
  EventTimes times;
  times.backward_start_ns = record.backward_start_ns;
  times.backward_end_ns = record.backward_end_ns;
  times.wait_start_ns = record.wait_start_ns;
  times.wait_end_ns = record.wait_end_ns;
  times.finalize_end_ns = record.finalize_end_ns;
  times.grad_ready_ns = record.grad_ready_ns;
  const size_t buckets = record.num_buckets;
  times.bucket_ready_ns.assign(record.bucket_ready_ns.begin(),
                               record.bucket_ready_ns.begin() + buckets);
  times.bucket_launch_ns.assign(record.bucket_launch_ns.begin(),
                                record.bucket_launch_ns.begin() + buckets);
  times.bucket_done_ns.assign(record.bucket_done_ns.begin(),
                              record.bucket_done_ns.begin() + buckets);
  return times;
}

std::vector<const IterationRecord*> Timeline::completed(size_t last) const {
  std::vector<const IterationRecord*> records;
  for (const IterationRecord& slot : slots_) {
    if (slot.complete) records.push_back(&slot);
  }
  std::sort(records.begin(), records.end(),
            [](const IterationRecord* a, const IterationRecord* b) {
              return a->iteration < b->iteration;
            });
  if (records.size() > last) records.erase(records.begin(), records.end() - last);
  return records;
}

}  // namespace pyreducer
