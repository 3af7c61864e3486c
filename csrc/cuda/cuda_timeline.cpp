// CUDA events for the timeline's device-side times (see DeviceTimeline in timeline.h).
// CUDA builds only. Compiled here, not run (no GPU on this machine).
#include <memory>
#include <vector>

#include <c10/core/DeviceType.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include "../timeline.h"

namespace pyreducer {
namespace {

class CudaTimeline : public DeviceTimeline {
 public:
  CudaTimeline(c10::DeviceIndex device, size_t slots, size_t max_buckets) : device_(device) {
    for (size_t s = 0; s < slots; ++s) {
      Slot slot;
      slot.start = std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault);
      slot.end = std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault);
      for (size_t b = 0; b < max_buckets; ++b) {
        slot.ready.push_back(std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault));
        slot.done.push_back(std::make_unique<c10::cuda::CUDAEvent>(cudaEventDefault));
      }
      slots_.push_back(std::move(slot));
    }
  }

  void begin(size_t slot) override {
    slots_[slot].start->record(stream());
    slots_[slot].recorded.assign(slots_[slot].ready.size(), 0);
  }
  void bucket_ready(size_t slot, size_t b) override {
    slots_[slot].ready[b]->record(stream());
    slots_[slot].recorded[b] |= 1;
  }
  void bucket_done(size_t slot, size_t b) override {
    slots_[slot].done[b]->record(stream());
    slots_[slot].recorded[b] |= 2;
  }
  void end(size_t slot) override { slots_[slot].end->record(stream()); }

  DeviceTimes read(size_t slot, size_t num_buckets) override {
    Slot& s = slots_[slot];
    DeviceTimes times;
    s.end->synchronize();
    for (size_t b = 0; b < num_buckets && b < s.ready.size(); ++b) {
      const bool both = b < s.recorded.size() && s.recorded[b] == 3;
      times.bucket_ready_ms.push_back(both ? s.start->elapsed_time(*s.ready[b]) : -1.0f);
      times.bucket_done_ms.push_back(both ? s.start->elapsed_time(*s.done[b]) : -1.0f);
    }
    times.end_ms = s.start->elapsed_time(*s.end);
    times.valid = true;
    return times;
  }

 private:
  struct Slot {
    std::unique_ptr<c10::cuda::CUDAEvent> start, end;
    std::vector<std::unique_ptr<c10::cuda::CUDAEvent>> ready, done;
    std::vector<uint8_t> recorded;
  };
  c10::cuda::CUDAStream stream() const { return c10::cuda::getCurrentCUDAStream(device_); }

  c10::DeviceIndex device_;
  std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<DeviceTimeline> make_cuda_timeline(c10::DeviceIndex device, size_t slots,
                                                   size_t max_buckets) {
  return std::make_unique<CudaTimeline>(device, slots, max_buckets);
}

}  // namespace pyreducer
