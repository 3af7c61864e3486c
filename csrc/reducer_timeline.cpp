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
  for (IterationTimes& times : result) {
    // Waits for the slot's events: no lock held, so backward passes go on meanwhile.
    DeviceTimes device;
    try {
      device = device_timeline_->read(times.slot, params_.size(), times.times.bucket_ready_ns.size());
    } catch (const std::exception&) {
      continue;  // an event could not be read (e.g. the slot is being re-recorded): host times
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const IterationRecord* now = timeline_.at(times.slot);
    if (now == nullptr || now->iteration != times.iteration || !now->complete) continue;
    times.host = times.times;
    times.times = anchor_device_times(times.host, device);
    times.device_clock = true;
  }
  return result;
}

}  // namespace pyreducer
