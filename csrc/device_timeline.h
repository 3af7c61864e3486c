// Device-side event times of the Reducer's iterations (CUDA builds, CUDA parameters).
//
// Note [Device timeline]
// On CUDA, host times say when work was enqueued, not when it ran: a gradient's hook runs as soon
// as autograd's CPU thread reaches it, and ProcessGroupNCCL completes a work's future when the
// collective is enqueued, so host done - launch is about 0 and every overlap looks perfect. CUDA
// builds therefore also record, for parameters on one CUDA device, an event at each point of
// Note [Timeline]:
//   begin                 the current stream at backward start (the anchor);
//   grad_ready[i]         the gradient's stream, after its copy into the bucket;
//   bucket ready, launch  the stream the bucket was completed on, and launched from;
//   bucket done           a side stream made to wait for the bucket's work (or hook) future: it
//                         completes when the communication has;
//   backward_end, wait_start, wait_end, end   the stream finalize_backward runs on.
// Reducer::timeline() reads them once they completed, outside the Reducer's lock, and reports
// every time on the device's clock, anchored at the host's backward start (anchor_device_times):
// overlap statistics, profile(), the planner and autotune then all use device times.
// Compiled, not run: no GPU has run this yet.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include "timeline.h"

namespace pyreducer {

// Milliseconds after the slot's begin event; negative where the event was not recorded.
struct DeviceTimes {
  std::vector<double> grad_ready_ms;
  std::vector<double> bucket_ready_ms;
  std::vector<double> bucket_launch_ms;
  std::vector<double> bucket_done_ms;
  double backward_end_ms = -1;
  double wait_start_ms = -1;
  double wait_end_ms = -1;
  double end_ms = -1;
};

class DeviceTimeline {
 public:
  virtual ~DeviceTimeline() = default;
  // Each records an event on the current stream of the parameters' device, for iteration slot
  // `slot` (an IterationRecord's index in the ring); `index` a parameter, `b` a bucket. Autograd
  // thread, under the Reducer's lock.
  virtual void begin(size_t slot) = 0;
  virtual void grad_ready(size_t slot, size_t index) = 0;
  virtual void bucket_ready(size_t slot, size_t b) = 0;
  virtual void bucket_launch(size_t slot, size_t b) = 0;
  virtual void backward_end(size_t slot) = 0;
  virtual void wait_start(size_t slot) = 0;
  virtual void wait_end(size_t slot) = 0;
  virtual void end(size_t slot) = 0;
  // Records bucket b's done event on a side stream made to wait for `done` (the bucket's work
  // or hook future), when `done` completes (at once for NCCL), unless seal_bucket_done has
  // recorded it, or the slot was begun again meanwhile (a late callback never writes a later
  // iteration's event). Any thread.
  virtual void bucket_done(size_t slot, size_t b,
                           const c10::intrusive_ptr<c10::ivalue::Future>& done) = 0;
  // The Reducer has waited for `done` (completed): records bucket b's done event now if
  // bucket_done's callback has not yet (see Note [Completion stamps] in timeline.h), so that
  // the event is recorded when the wait returns. Python or autograd thread, under the
  // Reducer's lock.
  virtual void seal_bucket_done(size_t slot, size_t b,
                                const c10::intrusive_ptr<c10::ivalue::Future>& done) = 0;
  // Waits for the slot's recorded events to complete and returns their times. Python thread,
  // without the Reducer's lock (the caller discards the result if the slot was reused meanwhile);
  // throws if an event cannot be read.
  virtual DeviceTimes read(size_t slot, size_t num_params, size_t num_buckets) = 0;
};

// The device timeline for parameters on `device`, with `slots` iteration slots for `num_params`
// parameters (and up to as many buckets): a CUDA timeline for a CUDA device in a CUDA build
// (chosen here at compile time, no registration), else null. Python thread (construction).
std::unique_ptr<DeviceTimeline> make_device_timeline(c10::Device device, size_t slots,
                                                     size_t num_params);

// `host` with every time replaced by the device's, anchored at host.backward_start_ns:
// t_ns = backward_start_ns + round(ms * 1e6); a time the device did not record becomes 0 (not
// recorded). Pure: see Note [Device timeline].
EventTimes anchor_device_times(const EventTimes& host, const DeviceTimes& device);

#ifdef PYREDUCER_WITH_CUDA
// cuda/cuda_timeline.cpp (CUDA builds only).
std::unique_ptr<DeviceTimeline> make_cuda_timeline(c10::DeviceIndex device, size_t slots,
                                                   size_t num_params);
#endif

}  // namespace pyreducer
