#include "timeline.h"

#include <algorithm>

namespace pyreducer {

Timeline::Timeline(size_t capacity, size_t num_params) : slots_(capacity) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    IterationRecord& slot = slots_[i];
    slot.slot = i;
    slot.grad_ready_ns.assign(num_params, 0);
    slot.bucket_ready_ns.assign(num_params, 0);
    slot.bucket_launch_ns.assign(num_params, 0);
    slot.bucket_done_ns = std::make_unique<std::atomic<int64_t>[]>(num_params);
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
  for (size_t b = 0; b < slot.grad_ready_ns.size(); ++b) {
    slot.bucket_done_ns[b].store(0, std::memory_order_relaxed);
  }
  return &slot;
}

namespace {
DeviceTimelineFactory& device_timeline_factory() {
  static DeviceTimelineFactory factory = nullptr;
  return factory;
}
}  // namespace

void register_device_timeline_factory(DeviceTimelineFactory factory) {
  device_timeline_factory() = factory;
}

std::unique_ptr<DeviceTimeline> make_device_timeline(int device_type, int device_index,
                                                     size_t slots, size_t max_buckets) {
  DeviceTimelineFactory factory = device_timeline_factory();
  if (factory == nullptr || slots == 0) return nullptr;
  return factory(device_type, device_index, slots, max_buckets);
}

double measure_recording_cost_ns(size_t num_params, size_t num_buckets, size_t iterations) {
  Timeline timeline(8, num_params);
  const int64_t start = Timeline::now_ns();
  for (size_t it = 0; it < iterations; ++it) {
    IterationRecord* r = timeline.begin(static_cast<int64_t>(it), 0, num_buckets,
                                        Timeline::now_ns());
    for (size_t i = 0; i < num_params; ++i) r->grad_ready_ns[i] = Timeline::now_ns();
    for (size_t b = 0; b < num_buckets; ++b) {
      r->bucket_ready_ns[b] = Timeline::now_ns();
      r->bucket_launch_ns[b] = Timeline::now_ns();
      r->bucket_done_ns[b].store(Timeline::now_ns(), std::memory_order_release);
    }
    r->backward_end_ns = Timeline::now_ns();
    r->wait_start_ns = Timeline::now_ns();
    r->wait_end_ns = Timeline::now_ns();
    r->finalize_end_ns = Timeline::now_ns();
    r->complete = true;
  }
  return static_cast<double>(Timeline::now_ns() - start) / static_cast<double>(iterations);
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
