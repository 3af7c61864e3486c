// The Reducer's timeline read-out: host records copied under the lock, device times read
// outside it (see Note [Timeline], Note [Device timeline]).
#include "reducer.h"

namespace pyreducer {

std::vector<IterationTimes> Reducer::timeline(size_t last) const {
  std::vector<IterationTimes> result;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const IterationRecord* record : timeline_.completed(last)) {
      IterationTimes times;
      times.slot = record->slot;
      times.iteration = record->iteration;
      times.plan_version = record->plan_version;
      times.plan = plan_history_.at(static_cast<size_t>(record->plan_version));
      times.times = host_times(*record);
      result.push_back(std::move(times));
    }
  }
  if (!device_timeline_) return result;
  // One clock per list: records whose device times cannot be read (their slot was reused
  // meanwhile, or events did not complete in time) are left out; if none can be read (a peer
  // failed, say), all are reported on the host's clock.
  std::vector<IterationTimes> on_device;
  for (const IterationTimes& host : result) {
    DeviceTimes device;
    try {  // waits for the slot's events: no lock held, so backward passes go on meanwhile
      device = device_timeline_->read(host.slot, params_.size(),
                                      host.times.bucket_ready_ns.size());
    } catch (const std::exception&) {
      break;  // timed out (later iterations would too) or unreadable
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const IterationRecord* now = timeline_.at(host.slot);
    if (now == nullptr || now->iteration != host.iteration || !now->complete) continue;
    IterationTimes times = host;
    times.host = host.times;
    times.times = anchor_device_times(host.times, device);
    times.device_clock = true;
    on_device.push_back(std::move(times));
  }
  if (!on_device.empty()) result = std::move(on_device);
  return result;
}

}  // namespace pyreducer
