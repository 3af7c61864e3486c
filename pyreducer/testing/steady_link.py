"""A link probe that measures nothing, for the tests of what the tuners decide (bucket
autotune, the tuning cache, the overlapped optimizer's schedule), not of what the probe measures.

The real probe (BucketTuning.probe_steps, pyreducer/tuning/control.py) fits a latency and a
bandwidth to all-reduces of 4 KiB to 16 MiB timed on loopback. On a loaded machine those times
are the scheduler's more than the link's: beside four to six busy loops on 2 cores, about 1
probe in 30 timed e.g. 3.9, 22, 14, 3.0 and 79 ms, the fit failed ("times do not grow with
size"), and autotune kept its starting plan at its 4th piece instead of searching (as designed:
test_autotune_keeps_the_plan_when_the_link_probe_is_unusable); a test counting on the search
then failed. install() replaces the probe in the calling rank's process: as many pieces as the
real one has on CPU (so decisions come at the same synced steps), each a small all-reduce (so a
rank out of step still hangs, as with the real one), and a fixed link. The real probe keeps its
own test (test_autotune.py: test_the_real_link_probe_...).
"""
import torch
import torch.distributed as dist

from pyreducer.tuning import LinkModel

LINK = LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=1e9, contention=0.2, queue_s=0.0)
# the real probe's pieces on CPU: three of the link's (PIECE_BYTES each), two contention samples,
# the latency under load; the next one returns the link
PIECES = 6


def _steady_probe_steps(self):
    for _ in range(PIECES):
        dist.all_reduce(torch.ones(1024), group=self.params.process_group)
        yield "piece"
    return LINK


def install() -> None:
    """In this rank's process (call it in the worker, before the wrappers are built)."""
    from pyreducer.tuning import control

    control.BucketTuning.probe_steps = _steady_probe_steps
