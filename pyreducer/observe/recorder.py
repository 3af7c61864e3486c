"""PYREDUCER_TRACE: record any training script's timeline, with no code change.

    PYREDUCER_TRACE=out/ torchrun --nproc-per-node 2 train.py
    python -m pyreducer report out/

With PYREDUCER_TRACE set (on every rank: torchrun passes the environment to all), every
pyreducer.DistributedDataParallel attaches a Recorder at construction. It measures each rank's
clock offset to rank 0 there (a few barriers, while the process group is certainly alive), times
every synced forward, and at exit (or when the wrapper is freed) writes, without any collective,
`rank<R>.json` (R: the global rank; `rank<R>.model<K>.json` for the K-th further wrapper built
in that process): the rank's last timeline_iterations iterations of the timeline, its step
profile (for `python -m pyreducer simulate`), its rank in the wrapper's process group, the clock
offset, a run id shared by the ranks of one run (so that a report never mixes runs), and under
torch.compile how the captured graphs were split at buckets (`compiled`, the wrapper's
compiled_summary()). `python -m pyreducer report out/` merges the ranks' files into
the Chrome trace, plots and summary (pyreducer/observe/report.py).

The profile's forward_ms is the median synced forward; optimizer_ms is the rest of the step:
from the end of one iteration's gradient write-back to the next synced forward (optimizer step,
zero_grad, data loading). Both are host times, also on a GPU, where the timeline itself is on the
device's clock (the write-back's host time is then taken from the record's "host" times).
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import socket
import statistics
import weakref

import torch
import torch.distributed as dist

from pyreducer._ext import _C
from pyreducer.observe.trace import clock_offsets_ns
from pyreducer.tuning.stepmodel import Profile
from pyreducer.wrapper import timeline as timeline_module

FORMAT = "pyreducer.rank_trace"
_attached: "weakref.WeakSet[Recorder]" = weakref.WeakSet()
_wrappers_built = itertools.count()  # wrappers recorded in this process, freed ones included


class Recorder:
    """One wrapper's recording; see the module docstring."""

    def __init__(self, params, reducer, out_dir: str, index: int):
        self.params, self.reducer, self.out_dir = params, reducer, out_dir
        self.rank, self.world_size = params.rank, params.world_size  # in the wrapper's group
        self.global_rank = dist.get_rank()
        self.index = index
        self.clock_offset_ns = clock_offsets_ns(params.process_group, params.device)[self.rank]
        self.run_id = _run_id(params)
        self.forward_ns: collections.deque = collections.deque(maxlen=1024)  # (start, end) ns
        self.phases: collections.deque = collections.deque(maxlen=1024)  # ... the tuners' phase
        self.tuning_logs: dict = {}  # the tuners' decision logs (lists they append to)
        self.hook_ids: set = set()  # the forward hooks attach() registered on the wrapper
        self._started = 0
        self.written: str | None = None
        self.compiled = None  # pyreducer.compiled.CompiledSplits, set by attach()

    @staticmethod
    def attach(ddp, params, reducer, out_dir: str, compiled=None) -> "Recorder":
        """Records `ddp` (collective: measures clock offsets); writes at exit or when `ddp` is
        freed, whichever comes first."""
        recorder = Recorder(params, reducer, out_dir, next(_wrappers_built))
        recorder.compiled = compiled  # CompiledSplits: how torch.compile's graphs were split
        recorder.hook_ids = {
            ddp.register_forward_pre_hook(lambda module, args: recorder._forward_start()).id,
            ddp.register_forward_hook(lambda module, args, output: recorder._forward_end(module)).id}
        weakref.finalize(ddp, recorder.write)  # also runs at interpreter exit
        _attached.add(recorder)
        return recorder

    def without_hooks(self, hooks: dict) -> dict:
        """A copy of a module's hook dict without this recorder's hooks (for pickling)."""
        return type(hooks)((key, hook) for key, hook in hooks.items() if key not in self.hook_ids)

    def _forward_start(self) -> None:
        self._started = _C.Reducer.now_ns()

    def _forward_end(self, ddp) -> None:
        if self.reducer.armed:  # a synced forward: its backward will be recorded
            self.forward_ns.append((self._started, _C.Reducer.now_ns()))
            # what the tuners did in this step (they act at its start, in the wrapper's forward)
            phase, self.tuning_logs = ddp.tuning_phase()
            self.phases.append(phase)

    def path(self) -> str:
        suffix = f".model{self.index}" if self.index else ""
        return os.path.join(self.out_dir, f"rank{self.global_rank}{suffix}.json")

    def profile(self, records: list[dict]) -> dict | None:
        """The step profile of the recorded iterations (see the module docstring)."""
        if not records:
            return None
        starts = sorted(start for start, _ in self.forward_ns)
        forward_ms = statistics.median((end - start) / 1e6 for start, end in self.forward_ns) \
            if self.forward_ns else 0.0
        rest_ms = []
        for r in records:  # the first synced forward after this iteration's write-back
            written_back = r.get("host", r)["finalize_end_ns"]  # host clock, as the forwards
            later = [s for s in starts if s > written_back]
            if later:
                rest_ms.append((later[0] - written_back) / 1e6)
        profile = Profile.from_timeline(records, self.params.sizes_bytes, forward_ms,
                                        statistics.median(rest_ms) if rest_ms else 0.0,
                                        self.params.group_keys)
        return vars(profile)

    def tuning(self) -> dict:
        """The tuning phase: each recorded synced forward's start (ns, this rank's clock) and
        the tuners' phase in that step (tuning.announce.phase), and their decision logs."""
        logs = {what: [{k: v for k, v in entry.items() if k not in ("profile", "candidates",
                                                                     "contention_in_place")}
                       for entry in log] for what, log in self.tuning_logs.items()}
        return dict(forward_start_ns=[start for start, _ in self.forward_ns],
                    phases=list(self.phases), logs=logs)

    def write(self) -> str | None:
        """Writes this rank's file (once); returns its path."""
        if self.written is not None:
            return self.written
        records = timeline_module.records(self.params, self.reducer, 1 << 30, rank=self.rank)
        os.makedirs(self.out_dir, exist_ok=True)
        document = dict(format=FORMAT, version=1, rank=self.rank, world_size=self.world_size,
                        global_rank=self.global_rank, run_id=self.run_id,
                        host=socket.gethostname(), pid=os.getpid(),
                        clock_offset_ns=self.clock_offset_ns, timeline=records,
                        profile=self.profile(records),
                        tuning=self.tuning() if any(self.phases) else None,
                        compiled=self.compiled.summary() if self.compiled is not None else None)
        with open(self.path(), "w") as f:
            json.dump(document, f, default=str)  # (tuning logs: numbers, names, lists)
        self.written = self.path()
        return self.written


def _run_id(params) -> int:
    """Rank 0's clock at this moment, the same number on every rank of the group (collective)."""
    stamp = torch.tensor([_C.Reducer.now_ns()], dtype=torch.int64, device=params.device)
    dist.broadcast(stamp, dist.get_global_rank(params.process_group, 0), group=params.process_group)
    return int(stamp.item())


def write_all() -> list[str]:
    """Writes every attached recorder of this process now (for processes that end with
    os._exit, which skips the exit handlers); returns the paths."""
    return [path for r in list(_attached) if (path := r.write()) is not None]
