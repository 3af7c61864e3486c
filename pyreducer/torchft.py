"""torchft: `pyreducer.torchft.DistributedDataParallel(manager, module, **options)`, training that
goes on when a replica group dies (torchft's Lighthouse, a Manager per replica group, healing).

torchft's signature and protocol: the Manager of this replica group, torchft's `Optimizer`
wrapper around the optimizer (its `zero_grad()` starts the step's quorum, its `step()` steps
only if `manager.should_commit()`), and `load_state_dict`/`state_dict` callbacks through which a
rejoining replica heals from a live peer. pyreducer's options are as for its own wrapper, less
those refused below by name.

Note [pyreducer under torchft]
Each step's quorum names the replica groups that reduce together; the Manager builds a Gloo
group among them whenever it changes. The wrapper asks for the quorum once per step, when the
forward ends (the Manager forms it while the forward runs), and hands that group, the number of
participants and whether this replica contributes to the C++ QuorumHook (Note [Quorum
all-reduce] in csrc/quorum_hook.h). Every bucket is then all-reduced from C++ as it fills, and
awaited when backward ends, before the optimizer's step: the overlap of communication with
backward that torchft's own DDP gives up (its hook waits for each bucket inside backward). The
arithmetic is the Manager's allreduce (SUM, then divided by the participants; zeros from a
healing replica), so the results are torchft's own DDP's.

What differs from pyreducer's own wrapper, and why:
  - no collective at construction: no quorum exists yet. Replicas start equal by healing (the
    Manager's init_sync), not by a broadcast of rank 0's parameters (there is no fixed rank 0).
  - the buckets never rebuild: a rebuild follows an order one rank observed, and a replica that
    restarts and heals must build the same buckets as those that did not. They are the caps
    along the reverse of the parameters' definition order, from the model alone: what torch
    DDP's rebuild finds for layers that run in that order, the order gradients are ready in.
    (torchft's own DDP keeps torch DDP's first-iteration plan, by turning find_unused_parameters
    on for that reason alone. That plan walks the definition order, so each bucket but the
    last holds one layer's bias with the next layer's weight, and is full one layer late: 1.094
    of plain pyreducer's step on emulated hosts, against 0.999 with these buckets;
    benchmarks/results/torchft_20261129.md. `bucket_plan=` takes any plan, that one included:
    tests/multirank/test_torchft.py gives it to compare with torchft's DDP bit for bit at 3
    replicas.)
  - a failed all-reduce is not an error of backward: it is reported to the Manager, whose
    should_commit() then says no, and the next step's quorum goes on without the lost replica.
    `failed_steps` lists what failed.
  - buffers are not broadcast: each replica keeps its own (healing copies a peer's).

Refused by name (REFUSED): what needs a collective among the replicas outside the Manager's
all-reduce (the unused-parameter map, the static graph's first reduction, the finite check,
bucket autotuning, join), a second communication hook (the Manager's all-reduce is the hook),
the overlapped and sharded optimizers (their per-bucket updates run before should_commit says
whether the step counts, and a healing replica loads its peer's state inside should_commit),
sparse gradients, parameters off the CPU, and torchft process groups other than its
ProcessGroupGloo (the all-reduces run on the Gloo group inside it, CPU tensors only; NCCL: not
yet). A backward without a quorum of its own raises (Note [One quorum, one backward]).

torchft is imported here only: `import pyreducer` does not load it. Versions: SUPPORTED.
"""
from __future__ import annotations

import importlib.metadata
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from pyreducer import _C
from pyreducer.distributed import DistributedDataParallel as _PyreducerDDP
from pyreducer.wrapper import failures
from pyreducer.wrapper.params import reduced_parameters

# torchft releases whose Manager (wait_quorum, num_participants, is_participating, errored,
# report_error) and ProcessGroupGloo (the quorum's Gloo group as `._pg`) this module was written
# and tested against
SUPPORTED = ("0.2",)

# option -> (the value it must keep, why)
REFUSED = {
    "process_group": (None, "the Manager's process group is the one: each step's quorum's"),
    "device_mesh": (None, "the Manager's process group is the one: each step's quorum's"),
    "init_sync": (False, "replicas start equal by healing from a peer (the Manager's "
                         "init_sync), not by a broadcast from a fixed rank 0"),
    "broadcast_buffers": (False, "there is no fixed rank 0 to broadcast from; each replica "
                                 "keeps its buffers (healing copies a peer's)"),
    "forward_sync_buffers": (False, "there is no fixed rank 0 to broadcast from; each replica "
                                    "keeps its buffers (healing copies a peer's)"),
    "find_unused_parameters": (False, "the used-parameter map would need an all-reduce among "
                                      "the quorum; every parameter must get a gradient each "
                                      "step (the buckets never rebuild without it)"),
    "static_graph": (False, "its first iteration reduces everything at once, outside the "
                            "quorum's all-reduce"),
    "check_finite": (False, "the finite check is an all-reduce outside the quorum's"),
    "mixed_precision": (None, "the Manager's all-reduce is the communication hook; its "
                              "reduce_dtype hook cannot be combined with it"),
    "reduce_dtype": (None, "the Manager's all-reduce is the communication hook"),
    "gradient_predivide_factor": (None, "the Manager's all-reduce is the communication hook"),
    "delay_all_reduce_named_params": (None, "delayed all-reduces run outside the quorum's"),
    "param_to_hook_all_reduce": (None, "delayed all-reduces run outside the quorum's"),
}


def check_torchft():
    """The torchft module, if an installed version is SUPPORTED; ImportError naming what is."""
    try:
        version = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("pyreducer.torchft needs torchft: pip install 'pyreducer[torchft]' "
                          f"(torchft {' or '.join(v + '.x' for v in SUPPORTED)})") from None
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED):
        raise ImportError(f"pyreducer.torchft supports torchft "
                          f"{' or '.join(v + '.x' for v in SUPPORTED)} (their Manager and "
                          f"ProcessGroupGloo); found torchft {version}")
    import torchft

    return torchft


def check_options(options: dict) -> None:
    """ValueError naming the first option that cannot be used under torchft, and why."""
    for name, (allowed, why) in REFUSED.items():
        if name in options and options[name] is not allowed and options[name] != allowed:
            raise ValueError(f"pyreducer.torchft: {name}={options[name]!r} cannot be used under "
                             f"torchft ({why}); expected {name}={allowed!r} or no {name}")
    if options.get("bucket_cap_mb") == "auto" or \
            type(options.get("bucket_cap_mb")).__name__ == "AutotuneConfig":
        raise ValueError("pyreducer.torchft: bucket_cap_mb='auto' cannot be used under torchft "
                         "(its probes and trials are collectives outside the quorum's "
                         "all-reduce, and a healing replica must build the same buckets); "
                         "give a number in MB")


def _quorum_gloo(manager, torchft):
    """The Manager's torchft ProcessGroupGloo; TypeError for any other process group."""
    pg = getattr(manager, "_pg", None)
    if not isinstance(pg, torchft.process_group.ProcessGroupGloo):
        raise TypeError("pyreducer.torchft all-reduces on the Gloo group inside torchft's "
                        "ProcessGroupGloo (Manager(pg=torchft.ProcessGroupGloo(...))); the "
                        f"Manager's is {type(pg).__name__}")
    return pg


def local_group(timeout: timedelta = timedelta(seconds=60)):
    """A process group of this process alone (Gloo, rank 0 of 1), registered with no one: the
    wrapper's own, for what pyreducer's wrapper does on its group at this replica's scale."""
    store = dist.HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    backend = dist.ProcessGroupGloo(store, 0, 1, timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class DistributedDataParallel(_PyreducerDDP):
    """pyreducer's DistributedDataParallel under torchft (Note [pyreducer under torchft])."""

    def __init__(self, manager, module, **options):
        """
        Args:
            manager (torchft.Manager): this replica group's Manager, made with
                `pg=torchft.ProcessGroupGloo(timeout=...)` (its timeout bounds every
                all-reduce's wait).
            module (nn.Module): the model, the same on every replica.
            **options (Any): pyreducer's DistributedDataParallel options, less REFUSED.
        """
        torchft = check_torchft()
        if not isinstance(manager, torchft.Manager):
            raise TypeError("pyreducer.torchft.DistributedDataParallel(manager, module, ...): "
                            f"expected a torchft.Manager first, got {type(manager).__name__}")
        check_options(options)
        _quorum_gloo(manager, torchft)
        named, sparse = reduced_parameters(module, ())
        for name, param in named:
            if param.device.type != "cpu":
                raise ValueError(
                    f"pyreducer.torchft: parameter {name} is on {param.device}; the quorum's "
                    "all-reduces run on the Gloo group inside torchft's ProcessGroupGloo, which "
                    "takes CPU tensors only (torchft's NCCL groups are not supported yet)")
        if any(sparse):
            raise ValueError(f"pyreducer.torchft: {[n for (n, _), s in zip(named, sparse) if s]} "
                             "produce sparse gradients; the Manager all-reduces dense buckets")
        self.manager = manager
        self.failed_steps: list[dict] = []  # {"step", "error"} of each step whose all-reduce failed
        # (the Manager's quorum future a forward last armed on, and the Manager's (step, commit
        # failures) then: should_commit() changes one of them; Note [One quorum, one backward])
        self._quorum_of: tuple | None = None
        # A weak reference: the C++ hook holding this wrapper's bound method would be a cycle the
        # garbage collector cannot see through (the wrapper, its Reducer and the hooks on the
        # module's parameters would live forever).
        report = weakref.WeakMethod(self._report)
        self._quorum = _C.QuorumHook(lambda message: report() and report()(message))
        options = {k: v for k, v in options.items() if k not in REFUSED}
        super().__init__(module, process_group=local_group(), init_sync=False,
                         forward_sync_buffers=False, **options)

    # -- construction (pyreducer's steps, at this replica's scale) --------------------------------
    _never_rebuild = True  # the buckets along the reverse definition order (the module doc)

    def _lost_ranks(self, copy: bool = False):
        return failures.Alone()  # the Manager handles the replicas' failures

    def _averaging_settings(self, predivide_factor, reduce_dtype):
        return None  # the QuorumHook averages (Note [Quorum all-reduce])

    def _own_comm_hook(self):
        return self._quorum

    # -- each step ---------------------------------------------------------------------------------
    def prepare_for_backward(self, output):
        self._begin_step()
        return super().prepare_for_backward(output)

    def _begin_step(self) -> None:
        """The quorum of the coming backward, to the QuorumHook; as torchft's allreduce: nothing
        reduced if the Manager has errored, else this quorum's group and participants. Without
        a quorum of its own (none started, or the last one already judged by should_commit()),
        a forward may end without a backward (an evaluation with grad on), but the backward
        that follows raises before any all-reduce (Note [One quorum, one backward])."""
        manager = self.manager
        replica = getattr(manager, "_replica_id", None)
        future = getattr(manager, "_quorum_future", None)
        if future is None:
            self._quorum.refuse_step(
                f"pyreducer.torchft: a backward on replica {replica} with no "
                "quorum started: call manager.start_quorum() before each step's forward "
                "(torchft.Optimizer's zero_grad() does)")
            return
        judged = (manager.current_step(), getattr(manager, "_commit_failures", 0))
        if self._quorum_of is not None and self._quorum_of[0] is future and \
                self._quorum_of[1] != judged:
            self._quorum.refuse_step(
                f"pyreducer.torchft: a backward on replica {replica} after "
                f"should_commit() judged step {self._quorum_of[1][0]}'s quorum, before the "
                "next start_quorum(): its all-reduce would run on that quorum's group. Call "
                "manager.start_quorum() (torchft.Optimizer's zero_grad()) before the forward")
            return
        self._quorum_of = (future, judged)
        if manager.errored() is not None:
            self._quorum.skip_step(f"the Manager had errored before it: {manager.errored()}")
            return
        manager.wait_quorum()
        participants = manager.num_participants()
        inner = getattr(manager._pg, "_pg", None)
        if manager.errored() is not None or inner is None or participants < 1:
            why = manager.errored() or f"no quorum group ({participants} participants)"
            self._quorum.skip_step(f"the quorum could not be used: {why}")
            return
        self._quorum.begin_step(inner, participants, manager.is_participating())

    # Note [One quorum, one backward]
    # torchft's protocol is one quorum per step: start_quorum(), the forward, the backward whose
    # all-reduces run on that quorum's group, should_commit(), step(). A forward with grad on
    # arms the Reducer, and the wrapper hands the hook the quorum then. A forward without a
    # quorum of its own is legitimate when no backward follows (an evaluation with grad on,
    # before training or after a step), so it only arms a refusal: the first bucket of a
    # backward that does follow raises, naming the replica, before any collective. A quorum is
    # a step's own until should_commit() judged it (the Manager's step, or its count of failed
    # commits, moved on).

    def _report(self, message: str) -> None:
        """The QuorumHook's error sink: the step's first failed all-reduce."""
        step = self.manager.current_step()
        self.failed_steps.append(dict(step=step, error=message))
        self.manager.report_error(RuntimeError(f"pyreducer.torchft: step {step}: {message}"))

    # -- refused -----------------------------------------------------------------------------------
    def register_comm_hook(self, state, hook):
        raise RuntimeError("pyreducer.torchft: the Manager's all-reduce is this wrapper's "
                           "communication hook; another cannot be registered")

    def register_builtin_hook(self, name):
        raise RuntimeError("pyreducer.torchft: the Manager's all-reduce is this wrapper's "
                           "communication hook; another cannot be registered")

    def overlap_optimizer(self, optimizer, shard: bool = False, **options):
        raise RuntimeError(
            "pyreducer.torchft: the overlapped and sharded optimizers cannot be used under "
            "torchft: they update each bucket's parameters as its reduction completes, before "
            "should_commit() says whether the step counts, and a healing replica loads its "
            "peer's state inside should_commit, after those updates; use torchft.Optimizer")

    def join(self, *args, **kwargs):
        raise RuntimeError("pyreducer.torchft: join() shadows collectives on a fixed group; "
                           "under torchft a replica that stops leaves the quorum instead")

    def _set_static_graph(self) -> None:
        raise RuntimeError(f"pyreducer.torchft: static_graph ({REFUSED['static_graph'][1]})")
