// CUDA events for the device timeline (see Note [Device timeline] in device_timeline.h).
// CUDA builds only. Compiled, not run: no GPU has run this yet.
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../device_timeline.h"

namespace pyreducer {
namespace {

// The events of one iteration slot. Events are created lazily by their first record (so the
// per-parameter and per-bucket ones cost nothing until used) with timing enabled
// (cudaEventDefault). `recorded` flags say which were recorded in the slot's current iteration:
// set on the autograd thread under the Reducer's lock, and for done events from the future's
// callback thread, hence atomics.
struct Slot {
  enum Fixed : size_t { kBegin, kBackwardEnd, kWaitStart, kWaitEnd, kEnd, kFixed };

  explicit Slot(size_t num_params)
      : fixed(timed_events(kFixed)), grad(timed_events(num_params)),
        ready(timed_events(num_params)), launch(timed_events(num_params)),
        done(timed_events(num_params)),
        recorded(std::make_unique<std::atomic<uint8_t>[]>(kFixed + 4 * num_params)) {}

  // The default CUDAEvent disables timing; these time (cudaEventDefault), as torch's CudaTimer.
  static std::vector<at::cuda::CUDAEvent> timed_events(size_t count) {
    std::vector<at::cuda::CUDAEvent> events;
    events.reserve(count);
    for (size_t i = 0; i < count; ++i) events.emplace_back(cudaEventDefault);
    return events;
  }

  std::vector<at::cuda::CUDAEvent> fixed, grad, ready, launch, done;
  std::unique_ptr<std::atomic<uint8_t>[]> recorded;  // fixed, then grad, ready, launch, done
  // Done events: written by a future's callback or by the waiter, whichever comes first, and
  // never by a callback of an earlier iteration of this slot (Note [Completion stamps]).
  std::mutex done_mutex;
  uint64_t generation = 0;           // begin() calls so far
  std::vector<uint8_t> done_claimed;  // per bucket, this generation
};

// How long read() waits for a slot's events: they belong to completed iterations, so they are
// normally done; if a peer died, the NCCL kernels (and the events after them) never finish, and
// the timeline is then read on the host's clock instead of hanging (see Reducer::timeline).
constexpr std::chrono::seconds kReadTimeout{30};

// A stream of our own for the done events (not the shared pool's, where other users' work would
// make it wait for unrelated kernels). Non-blocking: it never syncs with the legacy default
// stream. One per device for the life of the process, never destroyed (as torch's pool
// streams): the done callback's future.wait() records every storage the future holds (bucket
// buffers, NCCL outputs) on this stream for the caching allocator, which records an event on
// the stream when such a storage is freed, possibly long after the Reducer is gone. Destroying
// the stream with its Reducer would make that event record fail inside the allocator's deleter.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;  // by device index; leaked on purpose (see above)
  const std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= streams.size()) streams.resize(device + 1, nullptr);
  if (streams[device] == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(streams[device], device);
}

class CudaTimeline : public DeviceTimeline {
 public:
  CudaTimeline(c10::DeviceIndex device, size_t slots, size_t num_params)
      : device_(device), num_params_(num_params), side_(side_stream(device)) {
    for (size_t s = 0; s < slots; ++s) slots_.push_back(std::make_shared<Slot>(num_params));
  }

  void begin(size_t slot) override {
    Slot& s = *slots_[slot];
    {
      const std::lock_guard<std::mutex> lock(s.done_mutex);
      s.generation += 1;
      s.done_claimed.assign(num_params_, 0);
    }
    for (size_t i = 0; i < Slot::kFixed + 4 * num_params_; ++i) {
      s.recorded[i].store(0, std::memory_order_relaxed);
    }
    record(s, s.fixed[Slot::kBegin], Slot::kBegin);
  }
  void grad_ready(size_t slot, size_t index) override {
    Slot& s = *slots_[slot];
    record(s, s.grad[index], Slot::kFixed + index);
  }
  void bucket_ready(size_t slot, size_t b) override {
    Slot& s = *slots_[slot];
    record(s, s.ready[b], Slot::kFixed + num_params_ + b);
  }
  void bucket_launch(size_t slot, size_t b) override {
    Slot& s = *slots_[slot];
    record(s, s.launch[b], Slot::kFixed + 2 * num_params_ + b);
  }
  void backward_end(size_t slot) override { fixed(slot, Slot::kBackwardEnd); }
  void wait_start(size_t slot) override { fixed(slot, Slot::kWaitStart); }
  void wait_end(size_t slot) override { fixed(slot, Slot::kWaitEnd); }
  void end(size_t slot) override { fixed(slot, Slot::kEnd); }

  void bucket_done(size_t slot, size_t b,
                   const c10::intrusive_ptr<c10::ivalue::Future>& done) override {
    // The slot is held by shared_ptr: a late callback never touches freed events.
    std::shared_ptr<Slot> s = slots_[slot];
    uint64_t generation = 0;
    {
      const std::lock_guard<std::mutex> lock(s->done_mutex);
      generation = s->generation;
    }
    const size_t flag = Slot::kFixed + 3 * num_params_ + b;
    const c10::cuda::CUDAStream side = side_;
    done->addCallback([s, b, flag, side, generation](c10::ivalue::Future& future) {
      record_done(*s, b, flag, side, generation, future);
    });
  }

  void seal_bucket_done(size_t slot, size_t b,
                        const c10::intrusive_ptr<c10::ivalue::Future>& done) override {
    Slot& s = *slots_[slot];
    uint64_t generation = 0;
    {
      const std::lock_guard<std::mutex> lock(s.done_mutex);
      generation = s.generation;
    }
    record_done(s, b, Slot::kFixed + 3 * num_params_ + b, side_, generation, *done);
  }

  DeviceTimes read(size_t slot, size_t num_params, size_t num_buckets) override {
    const c10::cuda::CUDAGuard guard(device_);
    Slot& s = *slots_[slot];
    DeviceTimes times;
    times.backward_end_ms = since_begin(s, s.fixed[Slot::kBackwardEnd], Slot::kBackwardEnd);
    times.wait_start_ms = since_begin(s, s.fixed[Slot::kWaitStart], Slot::kWaitStart);
    times.wait_end_ms = since_begin(s, s.fixed[Slot::kWaitEnd], Slot::kWaitEnd);
    times.end_ms = since_begin(s, s.fixed[Slot::kEnd], Slot::kEnd);
    for (size_t i = 0; i < num_params && i < num_params_; ++i) {
      times.grad_ready_ms.push_back(since_begin(s, s.grad[i], Slot::kFixed + i));
    }
    for (size_t b = 0; b < num_buckets && b < num_params_; ++b) {
      times.bucket_ready_ms.push_back(since_begin(s, s.ready[b], Slot::kFixed + num_params_ + b));
      times.bucket_launch_ms.push_back(
          since_begin(s, s.launch[b], Slot::kFixed + 2 * num_params_ + b));
      times.bucket_done_ms.push_back(
          since_begin(s, s.done[b], Slot::kFixed + 3 * num_params_ + b));
    }
    return times;
  }

 private:
  void record(Slot& s, at::cuda::CUDAEvent& event, size_t flag) {
    event.record(c10::cuda::getCurrentCUDAStream(device_));
    s.recorded[flag].store(1, std::memory_order_release);
  }
  // Bucket b's done event, once per generation of the slot: on `side`, after its launch event
  // and the (completed) future's events.
  static void record_done(Slot& s, size_t b, size_t flag, const c10::cuda::CUDAStream& side,
                          uint64_t generation, c10::ivalue::Future& future) {
    const std::lock_guard<std::mutex> lock(s.done_mutex);
    if (s.generation != generation || b >= s.done_claimed.size() || s.done_claimed[b]) return;
    s.done_claimed[b] = 1;
    c10::cuda::CUDAStreamGuard guard(side);
    s.launch[b].block(side);  // done never before launch, also for a future without events
    future.wait();  // completed: makes the side stream wait for the communication's events
    s.done[b].record(side);
    s.recorded[flag].store(1, std::memory_order_release);
  }
  void fixed(size_t slot, size_t which) {
    Slot& s = *slots_[slot];
    record(s, s.fixed[which], which);
  }
  // Milliseconds from the begin event to `event`, both waited for first (CUDAEvent::elapsed_time
  // requires both completed, as torch's CudaTimer does); -1 if either was not recorded. Throws if
  // they do not complete within kReadTimeout.
  static double since_begin(Slot& s, at::cuda::CUDAEvent& event, size_t flag) {
    at::cuda::CUDAEvent& begin = s.fixed[Slot::kBegin];
    if (!s.recorded[Slot::kBegin].load(std::memory_order_acquire) ||
        !s.recorded[flag].load(std::memory_order_acquire) || !begin.isCreated() ||
        !event.isCreated()) {
      return -1.0;
    }
    wait_bounded(begin);
    wait_bounded(event);
    return static_cast<double>(begin.elapsed_time(event));
  }

  // cudaEventSynchronize has no timeout: poll instead, up to kReadTimeout.
  static void wait_bounded(at::cuda::CUDAEvent& event) {
    const auto deadline = std::chrono::steady_clock::now() + kReadTimeout;
    while (!event.query()) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("pyreducer: device timeline events did not complete within " +
                                 std::to_string(kReadTimeout.count()) +
                                 " s (a peer may have failed)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  c10::DeviceIndex device_;
  size_t num_params_;
  c10::cuda::CUDAStream side_;  // done events: see bucket_done and side_stream()
  std::vector<std::shared_ptr<Slot>> slots_;
};

}  // namespace

std::unique_ptr<DeviceTimeline> make_cuda_timeline(c10::DeviceIndex device, size_t slots,
                                                   size_t num_params) {
  return std::make_unique<CudaTimeline>(device, slots, num_params);
}

}  // namespace pyreducer
