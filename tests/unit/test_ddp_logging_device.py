"""_get_ddp_logging_data's durations with parameters off the CPU (pyreducer/wrapper/ddp_logging.py),
on CPU: the backward's compute, communication and overlap come from the device timeline's record
of the iteration, as torch's logger takes them from CUDA events there, and are not measured (0)
where there is none; forward_compute_time and the timestamps stay the host's. A stub stands for
the C++ Reducer (its device timeline runs on GPUs only: tests/gpu checks it against NCCL); on the
CPU the host's stats give every duration, as before (tests/multirank/test_ddp_private_api.py
compares them with torch DDP's)."""
import pytest

from pyreducer.wrapper.ddp_logging import DDPLogger

HOST = dict(iteration=1, backward_start_ns=2000, comm_start_ns=2100, backward_end_ns=2500,
            comm_end_ns=2600, buckets_reduced=2, ready_order=[1, 0], unused=[])
FORWARD_START_NS = 1000


def _record(clock="device", waited=True, iteration=1):
    """A record as Reducer.timeline gives it: device times anchored at the host's backward start
    (2000); bucket 1 launched first."""
    return dict(iteration=iteration, clock=clock, backward_start_ns=2000, backward_end_ns=9000,
                wait_start_ns=8200 if waited else 0, wait_end_ns=8500 if waited else 0,
                finalize_end_ns=9500,
                buckets=[dict(launch_ns=2300, done_ns=7000), dict(launch_ns=2200, done_ns=8000)])


class StubReducer:
    def __init__(self, records):
        self.num_iterations, self.records, self.reads = 0, records, 0

    def backward_stats(self):
        return dict(HOST)

    def timeline(self, last):
        self.reads += 1
        return self.records[-last:]


def _logged(records, off_cpu=True) -> tuple[dict, StubReducer]:
    reducer = StubReducer(records)
    logger = DDPLogger(reducer, lambda: FORWARD_START_NS, [4, 4], off_cpu=off_cpu)
    logger.before_synced_forward(False)  # iteration 1's forward starts (timed: sampled)
    reducer.num_iterations = 1  # ... its backward ends; the next forward publishes it
    logger.before_synced_forward(False)
    return logger.ints, reducer


DEVICE = dict(backward_compute_time=9000 - 2000, backward_comm_time=9500 - 2200,
              backward_compute_comm_overlap_time=9000 - 2200)
NOT_MEASURED = dict(backward_compute_time=0, backward_comm_time=0,
                    backward_compute_comm_overlap_time=0)
CASES = {
    "device record": ([_record()], DEVICE),
    # deferred completion (an overlapped optimizer): the backward did not wait; the reductions
    # were done on the device when the last bucket's was
    "deferred": ([_record(waited=False)], dict(DEVICE, backward_comm_time=8000 - 2200)),
    "no record": ([], NOT_MEASURED),  # timeline_iterations=0
    "host clock": ([_record(clock="host")], NOT_MEASURED),  # its events could not be read
    "another iteration": ([_record(iteration=2)], NOT_MEASURED),
}


@pytest.mark.parametrize("name", CASES)
def test_off_the_cpu_the_backwards_durations_are_the_device_timelines(name):
    records, expected = CASES[name]
    ints, reducer = _logged(records)
    assert reducer.reads == 1
    for key, value in expected.items():
        assert ints[key] == value, (key, ints[key])
        assert ints[f"avg_{key}"] == value, key  # (one sampled iteration)
    assert ints["forward_compute_time"] == HOST["backward_start_ns"] - FORWARD_START_NS
    for key, event in (("backward_comm_time_start", "comm_start_ns"),
                       ("backward_comm_time_end", "comm_end_ns")):  # the host's, as torch's
        assert ints[key] - HOST[event] == ints["forward_compute_time_start"] - FORWARD_START_NS


def test_on_the_cpu_the_host_stats_give_every_duration():
    ints, reducer = _logged([_record()], off_cpu=False)
    assert reducer.reads == 0  # (the timeline is not read)
    assert (ints["backward_compute_time"], ints["backward_comm_time"],
            ints["backward_compute_comm_overlap_time"]) == (500, 500, 400)
