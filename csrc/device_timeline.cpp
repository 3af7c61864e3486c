#include "device_timeline.h"

#include <cmath>

namespace pyreducer {

std::unique_ptr<DeviceTimeline> make_device_timeline(c10::Device device, size_t slots,
                                                     size_t num_params) {
  if (slots == 0) return nullptr;
#ifdef PYREDUCER_WITH_CUDA
  if (device.is_cuda()) return make_cuda_timeline(device.index(), slots, num_params);
#endif
  return nullptr;
}

namespace {

int64_t anchored(int64_t anchor_ns, double ms) {
  return ms < 0 ? 0 : anchor_ns + static_cast<int64_t>(std::llround(ms * 1e6));
}

std::vector<int64_t> anchored(int64_t anchor_ns, const std::vector<double>& ms, size_t count) {
  std::vector<int64_t> result(count, 0);
  for (size_t i = 0; i < count && i < ms.size(); ++i) result[i] = anchored(anchor_ns, ms[i]);
  return result;
}

}  // namespace

EventTimes anchor_device_times(const EventTimes& host, const DeviceTimes& device) {
  const int64_t anchor = host.backward_start_ns;
  EventTimes times;
  times.backward_start_ns = anchor;
  times.backward_end_ns = anchored(anchor, device.backward_end_ms);
  times.wait_start_ns = anchored(anchor, device.wait_start_ms);
  times.wait_end_ns = anchored(anchor, device.wait_end_ms);
  times.finalize_end_ns = anchored(anchor, device.end_ms);
  times.grad_ready_ns = anchored(anchor, device.grad_ready_ms, host.grad_ready_ns.size());
  const size_t buckets = host.bucket_ready_ns.size();
  times.bucket_ready_ns = anchored(anchor, device.bucket_ready_ms, buckets);
  times.bucket_launch_ns = anchored(anchor, device.bucket_launch_ms, buckets);
  times.bucket_done_ns = anchored(anchor, device.bucket_done_ms, buckets);
  return times;
}

}  // namespace pyreducer
