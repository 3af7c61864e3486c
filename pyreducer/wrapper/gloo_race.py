"""Sparse gradients on Gloo, kept away from torch's race (Note [Sparse gradients beside Gloo's
race] in csrc/reducer.h).

torch 2.8 onwards, ProcessGroupGloo::runLoop assigns the group's status string
(lastCompletedWorkName) after every collective from each worker thread, unlocked; a sparse
all-reduce's name is too long for libstdc++'s inline buffer, so two threads finishing at once
can free its heap buffer twice (heap corruption; torch DDP is exposed alike). The plain-torch
reproducer is tests/upstream/gloo_sparse_race.py (about 1 crash in 50 3-rank runs of the sparse
parity scenarios before this guard, and in seconds in the reproducer's own loop).

The guard: a wrapper whose parameters produce sparse gradients, on a Gloo group, all-reduces
its sparse buckets on a second Gloo backend over the same ranks with ONE worker thread, built
on the group's own store under a prefix of its own: only that thread ever writes its string.
The Reducer holds it, so it lives as long as the wrapper (its thread is joined when the wrapper
is freed, as the group's are at destroy_process_group).
Dense buckets stay on the group (their names are short: no heap buffer to free twice). The sums
are the group's (the same Gloo algorithm over the same ranks in the same order). Cost: one
rendezvous and one barrier when such a wrapper is built (collective over the group's ranks,
like the wrapper's construction; milliseconds), one thread and one set of connections per
wrapper, and sparse buckets that no longer run two at a time (one worker). Left exposed: a
communication hook's own all-reduces (the hook runs them on the group) and the user's own sparse
collectives.

GLOO_STATUS_RACE (pyreducer/wrapper/torch_versions.py) says which torch versions need it; lift it by
version once torch fixes the race (the reproducer tells).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pyreducer.wrapper import torch_versions

_made: dict = {}  # group name -> one-thread backends made over groups of that name (process)


def guard_sparse(reducer, params, group) -> bool:
    """Gives `reducer` a one-thread sparse backend over `group`'s ranks if it needs one (sparse
    parameters, a Gloo group, a torch with the race); returns whether it did. Collective when
    it does: every rank of the group builds its wrapper."""
    if not any(params.sparse) or not torch_versions.GLOO_STATUS_RACE or \
            dist.get_world_size(group) < 2 or dist.get_backend(group) != "gloo":
        return False
    reducer.set_sparse_backend(sparse_backend(group))
    return True


def sparse_backend(group):
    """A new one-thread Gloo backend over `group`'s ranks for sparse buckets (collective)."""
    return one_thread_backend(group, "sparse")


def one_thread_backend(group, purpose: str):
    """A new one-thread Gloo backend over `group`'s ranks (collective: every rank of the group,
    in the same order, as the wrappers are built); `purpose` names its store prefix (the sparse
    buckets', or a sharded optimizer's: pyreducer/sharded/comm.py)."""
    group = group if group is not None else dist.group.WORLD
    # a prefix no earlier backend of this process used: another wrapper, or a re-created group
    # of the same name, may rendezvous on the same store (every rank makes the same backends in
    # the same order)
    made = _made.get(group.group_name, 0)
    _made[group.group_name] = made + 1
    store = dist.PrefixStore(f"pyreducer/{purpose}/{group.group_name}/{made}/",
                             dist.distributed_c10d._world.pg_map[group][1])  # the group's store
    options = dist.ProcessGroupGloo._Options()
    options._threads = 1
    options._devices = _devices(group)
    options._timeout = group_timeout(group)
    backend = dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group),
                                    options)
    _wait_until_built_everywhere(backend, group, purpose)
    return backend


def _wait_until_built_everywhere(backend, group, purpose: str) -> None:
    """Returns once every rank of `group` has built its `backend`: a barrier on the backend
    itself (no rank enters it before its constructor has returned).

    Gloo's connectFullMesh returns on a pair's connecting side once that side has written its
    sequence number, before the listening side has taken the connection. A rank that went on and
    left (the wrapper's first backward raising its expected error, then destroy_process_group
    and exit) closed the socket under its peer, whose construction then failed with "Connection
    closed by peer" in place of its own error (tests/multirank/test_errors.py's missing sparse
    gradient: 4 runs in 30 beside a busy process, torch 2.13). A rank whose construction failed
    closes its connections as it lets go of the backend, and the others' barrier fails then
    (a quarter of a second at 2 ranks), not at the group's timeout."""
    try:
        backend.barrier().wait()
    except RuntimeError as error:
        raise RuntimeError(
            f"pyreducer: the one-thread Gloo backend for {purpose} over group "
            f"{group.group_name!r}: expected every one of its {backend.size()} ranks to build "
            f"it; rank {backend.rank()} did, and its barrier over them found: {error}") from error


def _devices(group) -> list:
    """The group's own Gloo devices (its interface: GLOO_SOCKET_IFNAME, or the hostname's
    address, as torch chose it for the group), else the default device. Not the default device
    alone: where the hostname resolves to loopback (hosts in network namespaces, some cluster
    nodes) the backend could not connect across hosts."""
    try:
        devices = list(group._get_backend(torch.device("cpu")).options._devices)
    except (AttributeError, RuntimeError):
        devices = []
    return devices or [dist.ProcessGroupGloo.create_default_device()]


def group_timeout(group) -> timedelta:
    """The group's own timeout (Gloo's options), else torch's default for Gloo."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return timedelta(minutes=30)
