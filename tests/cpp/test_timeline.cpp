// The device timeline's clock conversion without a GPU (csrc/device_timeline.h,
// Note [Device timeline]): device event times in ms after the begin event become ns on the host
// clock, anchored at the host's backward start; events the device did not record become 0.
// Then the completion stamps (Note [Completion stamps] in timeline.h): the first writer wins,
// and a record is found by its iteration only while its slot holds it.
#include <cstdio>
#include <thread>

#include "device_timeline.h"

int main() {
  pyreducer::EventTimes host;
  host.backward_start_ns = 1'000'000'000;
  host.backward_end_ns = 1'000'100'000;  // host times: enqueue times, not used below
  host.grad_ready_ns = {1'000'010'000, 1'000'020'000, 0};
  host.bucket_ready_ns = {1'000'020'000, 1'000'030'000};
  host.bucket_launch_ns = {1'000'020'000, 1'000'030'000};
  host.bucket_done_ns = {1'000'021'000, 1'000'031'000};

  pyreducer::DeviceTimes device;
  device.grad_ready_ms = {2.5, 4.0, -1.0};  // the third parameter got no gradient
  device.bucket_ready_ms = {4.0, 6.25};
  device.bucket_launch_ms = {4.0, 6.5};
  device.bucket_done_ms = {9.0, 12.000001};
  device.backward_end_ms = 7.0;
  device.wait_start_ms = 7.0;
  device.wait_end_ms = 12.5;
  device.end_ms = -1.0;  // not recorded

  const pyreducer::EventTimes t = pyreducer::anchor_device_times(host, device);
  const int64_t a = host.backward_start_ns;
  const bool ok = t.backward_start_ns == a && t.backward_end_ns == a + 7'000'000 &&
                  t.wait_start_ns == a + 7'000'000 && t.wait_end_ns == a + 12'500'000 &&
                  t.finalize_end_ns == 0 &&
                  t.grad_ready_ns == std::vector<int64_t>{a + 2'500'000, a + 4'000'000, 0} &&
                  t.bucket_ready_ns == std::vector<int64_t>{a + 4'000'000, a + 6'250'000} &&
                  t.bucket_launch_ns == std::vector<int64_t>{a + 4'000'000, a + 6'500'000} &&
                  t.bucket_done_ns == std::vector<int64_t>{a + 9'000'000, a + 12'000'001};
  std::printf("%s anchor_device_times\n", ok ? "ok  " : "FAIL");

  pyreducer::DeviceTimes short_device;  // fewer entries than buckets: the rest is not recorded
  short_device.bucket_done_ms = {1.0};
  const pyreducer::EventTimes s = pyreducer::anchor_device_times(host, short_device);
  const bool ok_short = s.bucket_done_ns == std::vector<int64_t>{a + 1'000'000, 0} &&
                        s.grad_ready_ns == std::vector<int64_t>{0, 0, 0};
  std::printf("%s anchor_device_times with missing events\n", ok_short ? "ok  " : "FAIL");

  pyreducer::CompletionStamp stamp;
  const bool unset = stamp.ns() == 0;
  stamp.stamp_at(100);
  stamp.stamp_at(50);  // a later writer (the waiter after a callback, or the reverse) loses
  stamp.stamp();
  bool ok_stamp = unset && stamp.ns() == 100;
  pyreducer::CompletionStamp raced;  // two threads at once: one time wins, and it stays
  std::thread other([&raced] { raced.stamp(); });
  raced.stamp();
  other.join();
  const int64_t first = raced.ns();
  raced.stamp();
  ok_stamp = ok_stamp && first > 0 && raced.ns() == first;
  std::printf("%s completion stamp: first writer wins\n", ok_stamp ? "ok  " : "FAIL");

  pyreducer::Timeline timeline(/*capacity=*/1, /*num_params=*/2);
  pyreducer::IterationRecord* one = timeline.begin(1, 0, 2, 10);
  const bool found = timeline.find(one->slot, 1) == one && timeline.find(one->slot, 2) == nullptr;
  timeline.begin(2, 0, 2, 20);  // the one slot is reused: iteration 1's record is gone
  const bool ok_find = found && timeline.find(0, 1) == nullptr && timeline.find(0, 2) != nullptr &&
                       timeline.find(1, 2) == nullptr;
  std::printf("%s a record is found only while its slot holds it\n", ok_find ? "ok  " : "FAIL");
  return ok && ok_short && ok_stamp && ok_find ? 0 : 1;
}
