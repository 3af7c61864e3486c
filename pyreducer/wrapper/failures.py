"""When a collective fails: which ranks were lost, and in which phase.

A collective fails when a peer died, froze or diverged; Gloo's error names a peer's address, not
its rank, and says nothing of what the wrapper was doing. So every rank that sees a failure
reports it in the process group's store (key pyreducer/failed/<wrapper>/<n>/<rank>: the n-th
failure of that wrapper) and waits up to REPORT_WINDOW_S for the other ranks' reports. The ranks
must name a wrapper alike: <wrapper> counts the wrappers constructed on that process group (a
collective construction: the same sequence on every member), and copies (unpickled or
deep-copied wrappers, made without the other ranks) count apart ("copy<k>"), so that a copy made
on one rank, or a wrapper on a subgroup, does not shift the names of the wrappers built after
it. The error then names the phase (construction, forward of iteration i, backward of iteration
i) and the ranks that did not report: dead, frozen (SIGSTOP), or still blocked in a collective
that has not failed for them yet. The window adds at most REPORT_WINDOW_S to the
process group's timeout. The store outlives a dead worker where it is hosted elsewhere
(torchrun's agent, a FileStore); where it is not reachable, the error says so instead.

Backward's failures are seen in C++ (csrc/reducer.cpp finalize); the Reducer calls describe()
through set_failure_context. The Python collectives (construction, forward) run under phase().
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

import torch.distributed as dist

REPORT_WINDOW_S = 3.0
# per process group name (and "copy" of it): wrappers made so far (see the module doc)
_wrappers: dict[tuple[str, bool], itertools.count] = {}


def _wrapper_id(group, copy: bool) -> str:
    name = (group or dist.group.WORLD).group_name
    number = next(_wrappers.setdefault((name, copy), itertools.count()))
    return f"copy{number}" if copy else str(number)


def is_collective_failure(error: BaseException) -> bool:
    """A failed or timed-out collective (not a check's own error, such as a model mismatch)."""
    text = str(error)
    return (isinstance(error, getattr(dist, "DistError", ())) or "gloo/" in text
            or "a peer may have died" in text)


def _store(group):
    return dist.distributed_c10d._get_process_group_store(group or dist.group.WORLD)


class LostRanks:
    """One wrapper's failure reports (see the module docstring)."""

    def __init__(self, group, copy: bool = False):
        """copy: the wrapper was made without the other ranks (unpickled, deep-copied)."""
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.wrapper = _wrapper_id(group, copy)
        self.failures = 0

    def describe(self, phase: str) -> str:
        """Reports this rank's failure, waits for the others' reports; the text to append."""
        prefix = f"pyreducer/failed/{self.wrapper}/{self.failures}/"
        self.failures += 1
        try:
            store = _store(self.group)
            store.set(prefix + str(self.rank), phase)
            deadline = time.monotonic() + REPORT_WINDOW_S
            while True:
                reported = [r for r in range(self.world_size) if store.check([prefix + str(r)])]
                if len(reported) == self.world_size or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception as error:  # noqa: BLE001 - the collective's error must still be raised
            return (f" [phase: {phase}; the lost ranks could not be named: the process group's "
                    f"store is unreachable ({error})]")
        lost = [r for r in range(self.world_size) if r not in reported]
        if not lost:
            return (f" [phase: {phase}; every rank reported this failure: none was lost (a "
                    "collective timed out or the ranks diverged)]")
        return (f" [phase: {phase}; lost rank(s) {', '.join(map(str, lost))} of "
                f"{self.world_size}: no report within {REPORT_WINDOW_S:g} s of this failure "
                f"(dead, frozen, or still blocked in a collective); reported by rank(s) "
                f"{', '.join(map(str, reported))}]")

    @contextmanager
    def phase(self, name: str):
        """Runs the block; a collective failure in it is raised again naming phase and ranks."""
        try:
            yield
        except RuntimeError as error:
            if not is_collective_failure(error) or "[phase: " in str(error):
                raise
            message = (f"pyreducer: a collective failed on rank {self.rank} of "
                       f"{self.world_size}: {error}{self.describe(name)}")
            try:  # keep torch's type (DistBackendError, ...), for code that catches it
                wrapped = type(error)(message)
            except Exception:  # noqa: BLE001 - a type that takes other arguments
                wrapped = RuntimeError(message)
            raise wrapped from error


class Alone:
    """In place of LostRanks for a wrapper whose group is this process alone (pyreducer.torchft's:
    the replicas' failures are the Manager's to handle): no peer to report to or to lose."""

    def describe(self, phase: str) -> str:
        return f" [phase: {phase}]"

    @contextmanager
    def phase(self, name: str):
        yield
