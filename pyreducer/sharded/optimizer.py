"""The sharded overlapped optimizer: `model.overlap_optimizer(optimizer, shard=True)` (Note
[Sharded step] in pyreducer/sharded/__init__.py)."""
from __future__ import annotations

import collections
import copy

import torch

from pyreducer._ext import _C
from pyreducer.overlap import pending, subset_step
from pyreducer.overlap.optimizer import OverlapOptimizer
from pyreducer.sharded import checks, clip, gather_plan, pieces as pieces_module
from pyreducer.sharded.comm import ShardComm
from pyreducer.sharded.layout import Layout

_GRAD_GET = torch.Tensor.grad.__get__


class ShardedOptimizer(OverlapOptimizer):
    """An overlapped optimizer whose state and update are sharded across the ranks (Note
    [Sharded step]): each bucket is reduce-scattered, each rank steps the elements it owns with
    the wrapped optimizer's class and settings, and all-gathers the bucket's parameters, which
    the next forward waits for parameter by parameter.

    Args as OverlapOptimizer's, but the schedule is "fifo" (whole buckets: one reduce-scatter
    each; hold_back applies), and every optimizer parameter must be one the wrapper reduces.
    The optimizer's class must update elementwise (checks.ELEMENTWISE); its state moves into the
    shards (a state it already holds, e.g. a loaded checkpoint, is cut into them).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, reducer, params, module,
                 max_grad_norm: float | None = None, hold_back: int = 0, schedule: str = "fifo",
                 tuning=None, autotune=None, replacing=None):
        checks.check_sharded(optimizer, params, schedule, autotune)
        whole = checks.whole_state(optimizer, params)  # a state it holds, in torch's format
        super().__init__(optimizer, reducer, params, module, max_grad_norm=max_grad_norm,
                         hold_back=hold_back, schedule="fifo", tuning=tuning, autotune=autotune,
                         replacing=replacing)
        self.comm = ShardComm(params.process_group)  # (collective on Gloo: a backend made)
        reducer.set_sharded(True, self.comm.backend, self.comm.ring)
        self.index = {id(p): i for i, p in enumerate(params.tensors)}
        self.due = False  # a synced backward's reduced shards wait for step() (or zero_grad())
        self.grads_taken = False  # the pieces' .grad already view those shards (a clip took them)
        self.cleared: dict[int, bool] = {}  # id -> whether it was a bucket view: parameters
        # whose .grad the update set to None without a zero_grad() asking (see zero_grad())
        self.gathers: dict[int, tuple] = {}  # bucket -> (its parameters' all-gather in flight,
        # its timeline event)
        self.plans: tuple = (None, {})  # (layout, {bucket: its GatherPlan}), made when first used
        self.clipper = clip.Clip()  # (max_grad_norm and clip_grad_norm_ on the shards)
        self.inner = self._make_inner()
        self.pieces = pieces_module.Pieces(self.inner, params.tensors)
        self._follow_plan()
        self.pieces.load_whole(whole)
        optimizer.state.clear()  # its whole state now lives in the shards

    def _make_inner(self) -> torch.optim.Optimizer:
        """An optimizer of the wrapped one's class and instance settings over the pieces (its
        param groups mirror the wrapped one's, in order; their parameters are set by Pieces)."""
        inner = copy.copy(self.optimizer)
        inner.state = collections.defaultdict(dict)
        inner.param_groups = []
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            if hasattr(inner, name):
                setattr(inner, name, collections.OrderedDict())
        for group in self.optimizer.param_groups:
            inner.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                   "params": []})
        return inner

    def _follow_plan(self) -> None:
        """The pieces of the Reducer's current buckets: on a new plan (a rebuild), the state
        moves to the new pieces (collective, on every rank at the same step)."""
        layout_now = [entry["param_indices"] for entry in self.reducer.bucket_layout()]
        tensors = self.params.tensors
        layout = Layout(layout_now, [p.numel() for p in tensors],
                        [p.element_size() for p in tensors], self.comm.world_size, self.comm.rank)
        flats = self.reducer.bucket_buffers()
        if layout.same_as(self.pieces.layout):
            self.pieces.rebind(flats)
        else:
            self.pieces.move_to(layout, flats, self.comm, self.optimizer.param_groups)

    # -- the optimizer interface -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Records the update of every bucket reduced by the last synced backward: stepped,
        shard by shard, when the next forward first reads a parameter (or now, when nothing
        waits for a read). RuntimeError when no reduced gradients wait for a step."""
        loss = self._run_closure(closure)
        if self.stepped:  # a previous step's updates, if no forward ran since
            self.synchronize()
        if not self.due:
            raise RuntimeError(
                f"overlap_optimizer(shard=True): step() on rank {self.comm.rank} without "
                "reduced gradients to step: each synced backward's gradients are stepped once "
                "(their shards are consumed by the step, or dropped by zero_grad())")
        self._step_hooks(self.optimizer._optimizer_step_pre_hooks)
        self.fences.pass_all()
        self.settings = subset_step.Settings(self.optimizer)
        self.pieces.assign_groups(self.optimizer.param_groups)  # a group added since
        self.stepped = True
        self.update_aliased()
        if not self.pending:  # every parameter was read since the backward: step now
            self.synchronize()
        self._step_done()
        return loss

    def zero_grad(self, set_to_none: bool = True, params=None) -> None:
        """As OverlapOptimizer.zero_grad; before step() (a skipped step) the reduced shards are
        dropped: no step follows from them."""
        if self.due and not self.stepped:
            self.reducer.complete_all()
            self._release_all()
            self.due = False
        super().zero_grad(set_to_none, params)
        # A parameter whose .grad the update let go without a zero_grad() (Note [Sharded step])
        # had a gradient with torch's step, which zero_grad(set_to_none=False) makes zeros: in
        # its bucket's slot where it was a bucket view (the next backward then divides it in
        # place, as torch DDP does a view, not while copying: the roundings differ at 3 ranks).
        if params is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:
            viewed = self.cleared.pop(id(p), None)
            if viewed is not None and not set_to_none and p.grad is None:
                p.grad = self._zeroed_slot(p) if viewed else torch.zeros_like(p)

    def _zeroed_slot(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s slot in its bucket's buffer, zeroed, laid out as `param` (its gradient as a
        bucket view), once its bucket's gather no longer sends from there."""
        b, begin, _ = self.pieces.slot(self.index[id(param)])
        gather, _ = self.gathers.get(b, (None, None))
        if gather is not None:
            gather.wait_all()
        flat = self.pieces.flats[b]
        with torch.no_grad():
            slot = flat.as_strided(param.size(), param.stride(), flat.storage_offset() + begin)
            return slot.zero_()

    @property
    def state(self):
        """The wrapped optimizer's state: empty, its state lives in the shards (state_dict()
        gathers it whole; shard_state_bytes() measures this rank's)."""
        return self.optimizer.state if "optimizer" in self.__dict__ else {}

    @state.setter
    def state(self, value) -> None:
        if "optimizer" in self.__dict__:
            self.optimizer.state = value

    def state_dict(self):
        """The whole state in torch's format (a plain optimizer of the same class loads it).
        Collective: every rank calls it (each gets the whole state)."""
        self.synchronize()
        return self.pieces.whole_state_dict(self.optimizer, self.comm)

    def load_state_dict(self, state_dict) -> None:
        """Loads torch's format (a plain optimizer's checkpoint, or state_dict()'s) or a
        sharded checkpoint (sharded_state_dict()'s, same world size). Collective when a sharded
        checkpoint's buckets differ from the current ones."""
        self.synchronize()
        self.pieces.load_state_dict(state_dict, self.optimizer, self.comm)
        self.param_groups = self.optimizer.param_groups

    def sharded_state_dict(self) -> dict:
        """This rank's pieces of the state, with what locates them (no collective)."""
        self.synchronize()
        return self.pieces.sharded_state_dict(self.optimizer)

    def shard_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state tensors."""
        return self.pieces.state_bytes()

    def memory_bytes(self) -> dict:
        """This rank's memory, by what holds it: parameters, gradients (the .grad tensors not
        aliasing a bucket), the bucket buffers, their reduce-scattered shards, optimizer
        state."""
        return pieces_module.memory_bytes(self.params.tensors, self.reducer,
                                          self.pieces.state_bytes())

    # -- reductions and updates ------------------------------------------------------------------
    def _backward_ended(self) -> None:
        super()._backward_ended()
        self.cleared.clear()  # (a backward gave them gradients again)
        if self.pending:
            self.due = True
            self.grads_taken = False
            self.gathers.clear()

    # -- clipping between backward and step() (Note [Clipping shards]) --------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        parameters=None) -> torch.Tensor:
        """As OverlapOptimizer.clip_grad_norm_ (`parameters`: the order of the norms), on the
        shards (Note [Clipping shards]): bit for bit torch's, collective (every rank calls
        it). The 2-norm only."""
        if float(norm_type) != 2.0:
            raise ValueError(f"overlap_optimizer(shard=True): clip_grad_norm_ takes the 2-norm "
                             f"(norm_type=2.0) on shards, got norm_type={norm_type!r}; use "
                             "shard=False for another norm")
        order = self._clip_order(parameters, "clip_grad_norm_")
        self._take_shard_grads("clip_grad_norm_")
        return self.clipper(self.pieces, [self.index[id(p)] for p in order], max_norm,
                            self.comm, set(self.reducer.globally_unused()))

    def clip_grad_value_(self, clip_value: float) -> None:
        """As OverlapOptimizer.clip_grad_value_, on this rank's shards (elementwise: each
        element clamped where it is stepped, torch's result bit for bit)."""
        self._take_shard_grads("clip_grad_value_")
        stepped = {id(t) for g in self.inner.param_groups for t in g["params"]}
        with torch.no_grad():
            for tensor in self.pieces.tensors:
                if id(tensor) in stepped and tensor.grad is not None:
                    tensor.grad.clamp_(min=-clip_value, max=clip_value)

    def _take_shard_grads(self, what: str) -> None:
        """Every reduction completed and the pieces' .grad set to this step's shards, for a clip
        before step(); once per step: a second clip (clip_grad_value_ then clip_grad_norm_)
        clips what the first left."""
        self._check_not_removed()
        if self.stepped or not self.due:
            raise RuntimeError(
                f"overlap_optimizer(shard=True): {what} on rank {self.comm.rank} "
                f"{'after step()' if self.stepped else 'without reduced gradients'}: expected "
                "it between a synced backward and step() (the shards it clips exist then)")
        if self.grads_taken:
            return
        self.busy = True
        try:
            self._follow_plan()
            self.reducer.complete_all()
            self.pieces.take_grads(range(len(self.pieces.flats)), self.reducer.shard_buffers(),
                                   set(self.reducer.globally_unused()))
            self.grads_taken = True
        finally:
            self.busy = False

    def forward_starting(self, tune: bool) -> None:
        if tune and self.due and not self.stepped:
            raise RuntimeError(
                f"overlap_optimizer(shard=True): a synced forward on rank {self.comm.rank} "
                "while the last synced backward's gradients wait for step(): each rank holds "
                "1/N of them, which the next backward would overwrite. Call optimizer.step() "
                "or zero_grad() first, or accumulate under model.no_sync()")
        if torch.is_grad_enabled() and self.due and not self.stepped:
            raise RuntimeError(
                f"overlap_optimizer(shard=True): a forward with grad enabled under no_sync() on "
                f"rank {self.comm.rank} between a synced backward and step(): its gradients "
                "would add to the parameters' .grad, which the sharded step does not read (it "
                "steps the reduced shards). Accumulate under no_sync() before the synced "
                "backward, or run this forward under torch.no_grad()")
        super().forward_starting(tune)

    def before_plan_change(self) -> None:
        """Before the wrapper rebuilds its buckets: every pending update done, and the pieces'
        views of the buffers let go (the Reducer replaces them: the old ones are freed then)."""
        self.synchronize()
        self.pieces.let_go()

    def _read(self, b: int, param: torch.Tensor, func) -> None:
        """A read of `param` (bucket b): after step(), the update runs; before, a read of its
        .grad is refused, any other read sees the unchanged value."""
        if self.stepped:
            self._run_updates()
            self._finish_param(b, param)
        elif func == _GRAD_GET:  # (a new method-wrapper at each access: ==, not is)
            raise RuntimeError(
                f"overlap_optimizer(shard=True): {self.params.names[self.index[id(param)]]}.grad "
                f"was read on rank {self.comm.rank} between backward and step(): its averaged "
                "gradient exists only as shards (each rank reduced 1/N). Clip with "
                "max_grad_norm=, or use shard=False to read averaged gradients")

    def synchronize(self) -> None:
        """After step(): every update done and every parameter gathered. Before: the
        reductions completed, the shards kept for step(), and the parameters kept pending
        (Note [Pending until written]); the next forward, or a synchronize() after step(),
        writes them."""
        if self.stepped:
            self._run_updates()
            for b in sorted(self.pending):
                self._finish(b)
        else:
            self.reducer.complete_all()
        self.fences.pass_all()

    # Note [Pending until written]
    # A sharded bucket's parameters are written from its all-gathered buffer, by _finish_param
    # for each parameter still pending. So from the backward that reduced a bucket until its
    # update's gather is written, its parameters stay pending: whatever completes the
    # reductions between backward and step() (an evaluation forward, state_dict(), a forward of
    # model.module, synchronize()) only completes them, and reads pass with the unchanged
    # values; only zero_grad() before step() (a skipped step) takes the parameters off, with
    # the shards. An update of a bucket whose parameters are not pending would advance the
    # optimizer state and write no parameter: _run_updates refuses it.

    def _release_all(self) -> None:
        """Every pending parameter wears its own class again (its value is unchanged)."""
        for b in sorted(self.pending):
            self._release(b)

    def _release(self, b: int) -> list[torch.Tensor]:
        group = self.pending.pop(b)
        for p in group:
            del self.bucket_of[id(p)]
            pending.take_off(p)
        return group

    def _run_updates(self) -> None:
        """Steps every reduced bucket's shard and launches its all-gather, first-read buckets
        first (the forward reads the last buckets first); once per step(), on every rank in
        the same order."""
        if not self.due:
            return
        self.due = False
        self.busy = True
        try:
            with subset_step.as_step(self.fences.device):
                self._follow_plan()
                if self.current is not None:  # (the timeline's record of this iteration)
                    self.current["memory"] = self.memory_bytes()
                order = sorted(range(len(self.pieces.flats)), reverse=True)
                lost = [b for b in order if not self.pending.get(b)]
                if lost:  # See Note [Pending until written]
                    raise RuntimeError(
                        f"overlap_optimizer(shard=True): internal error on rank "
                        f"{self.comm.rank}: buckets {lost} would be stepped with none of their "
                        "parameters pending, so their update would never be written; please "
                        "report this with the script")
                if self.max_grad_norm is not None:  # every bucket reduced first
                    self.reducer.complete_all()
                    if not self.grads_taken:
                        self.pieces.take_grads(order, self.reducer.shard_buffers(),
                                               set(self.reducer.globally_unused()))
                        self.grads_taken = True
                    stepped = [self.index[id(p)] for g in self.optimizer.param_groups
                               for p in g["params"]]
                    self.clipper(self.pieces, stepped, self.max_grad_norm, self.comm,
                                 set(self.reducer.globally_unused()))
                for b in order:
                    self._update_bucket(b)
        finally:
            self.busy = False

    def _plan(self, b: int) -> gather_plan.GatherPlan:
        """Bucket b's all-gather plan (Note [Gathers in read order]), made once per layout."""
        layout = self.pieces.layout
        if self.plans[0] is not layout:
            self.plans = (layout, {})
        plans = self.plans[1]
        if b not in plans:
            indices = layout.buckets[b]
            plans[b] = gather_plan.plan_bucket(
                indices, layout.numels, layout.slot_offsets[b], layout.shard_numel[b],
                layout.world_size, layout.element_sizes[indices[0]],
                links=self.comm.ring is not None)
        return plans[b]

    def _update_bucket(self, b: int) -> None:
        """Bucket b's reduction waited for; its shard stepped segment by segment, each segment
        sent as soon as it is stepped (see Note [Gathers in read order])."""
        event = dict(bucket=b, read_ns=_C.Reducer.now_ns(), reduced_ns=0, updated_ns=0,
                     module=self.running[-1] if self.running else None)
        if self.current is not None:
            self.current["updates"].append(event)
        self.reducer.complete_bucket(b)
        event["reduced_ns"] = _C.Reducer.now_ns()
        if not self.grads_taken:  # (the unused map is resolved for bucket b's parameters)
            self.pieces.take_grads([b], self.reducer.shard_buffers(),
                                   set(self.reducer.globally_unused()))
        self.reducer.acquire_bucket_buffer(b)  # (released, if no gradient reached it since)
        plan = self._plan(b)
        gather = self.comm.gather_bucket(self.pieces.flats[b], self.pieces.own_region(b), plan,
                                         self.fences.current_stream)
        event["gather_launch_ns"] = _C.Reducer.now_ns()
        self.gathers[b] = (gather, event)
        try:
            for segment in plan.step_order(self.comm.rank):
                members = self.pieces.load_values(b, set(segment.params))
                if members:
                    subset_step.step_subset(self.inner, members, self.settings)
                gather.ready(segment.begin, segment.end)
        except BaseException as error:  # its peers' gathers fail by their timeout, not hang
            gather.cancel(f"the step of bucket {b} raised {type(error).__name__}: {error}")
            raise
        event["updated_ns"] = _C.Reducer.now_ns()

    # Note [Streams of a sharded step]
    # On CUDA (NCCL) the update of every bucket runs on the stream current at the step's first
    # read (as in Note [Streams] in pyreducer/overlap/optimizer.py), and each parameter is then
    # written from its bucket's gathered buffer on the stream current at its own first read,
    # which a forward on several streams makes different ones. On NCCL a wait makes only the
    # current stream wait. So:
    #   - a bucket's all-gather is waited for by every stream that writes a parameter from its
    #     buffer, once per stream (WholeGather keeps its work);
    #   - each written parameter is fenced (Fences.fence_written): a read on another stream
    #     waits for the write, and so for the gather before it. Its event is recorded at that
    #     read, on the writing stream (it covers every write queued there before), not after
    #     each write: an event per stream that another reads from, none in a forward on one
    #     stream, where an event per parameter would add a CUDA call to each first read;
    #   - the buffer, released once its parameters are all written (Note [Released bucket
    #     buffers]), is first recorded on every stream that waited for its gather (those that
    #     read it), beside the streams that waited for its reduce-scatter (the update's: the
    #     Reducer records those): the caching allocator hands its memory out again only once
    #     each is past its reads (the all-gather's own NCCL stream is before all of them).
    # The fences are passed where Note [Streams] passes them (step(), zero_grad(), the forward's
    # end, synchronize()). Compiled, not run: no GPU here (tests/gpu: the two-stream forward
    # with shard=True against torch DDP); the bookkeeping runs on CPU with the CUDA calls
    # recorded (tests/multirank/test_overlap_fences.py). On CPU nothing is fenced.

    def _finish(self, b: int) -> None:
        """Every parameter of bucket b still pending written (_finish_param)."""
        for param in list(self.pending.get(b, ())):
            self._finish_param(b, param)

    def _finish_param(self, b: int, param: torch.Tensor) -> None:
        """`param` (bucket b): the gather of its own elements waited for, not the bucket's
        (Note [Gathers in read order]), its value written from the buffer, its gradient zeroed
        as zero_grad() asked, else set to None (no rank holds its average). The bucket's last
        parameter waits for the whole gather and gives the buffer back."""
        group = self.pending.get(b)
        if group is None or not any(p is param for p in group):
            return
        gather, event = self.gathers.get(b, (None, None))
        i = self.index[id(param)]
        if gather is not None:
            _, begin, end = self.pieces.slot(i)
            gather.wait(begin, end)
            if not event.get("first_ready_ns"):
                event["first_ready_ns"] = _C.Reducer.now_ns()
        self.pending[b] = [p for p in group if p is not param]
        del self.bucket_of[id(param)]
        pending.take_off(param)
        self.busy = True
        try:
            with torch.no_grad():
                self.pieces.write_param(i)
        finally:
            self.busy = False
        asked = id(param) in self.to_zero
        set_to_none = self.to_zero.pop(id(param), True)  # no zero_grad() since step(): None,
        if set_to_none:                                   # as if it was called (Note [Sharded
            if not asked and i not in set(self.reducer.globally_unused()):  # step])
                self.cleared[id(param)] = param.grad is not None and \
                    param.grad.untyped_storage().data_ptr() == \
                    self.pieces.flats[b].untyped_storage().data_ptr()  # (a bucket view)
            param.grad = None
        elif param.grad is not None:
            if gather is not None and param.grad.untyped_storage().data_ptr() == \
                    self.pieces.flats[b].untyped_storage().data_ptr():
                gather.wait_all()  # a bucket view: the gather may still send from there
            param.grad.zero_()
        elif i not in set(self.reducer.globally_unused()):  # its .grad went into the bucket,
            param.grad = torch.zeros_like(param)  # let go (Note [Sharded gradients]): zeros
        self.fences.fence_written(param)  # See Note [Streams of a sharded step]
        if not self.pending[b]:
            self._bucket_done(b)

    def _bucket_done(self, b: int) -> None:
        """Bucket b's parameters all written: its gather waited for whole, its buffer given back
        until the next backward reaches the bucket (Note [Released bucket buffers])."""
        del self.pending[b]
        gather, event = self.gathers.pop(b, (None, None))
        if gather is not None:
            gather.wait_all()
            event["gathered_ns"] = gather.done_ns()  # (when it was all there)
            # the streams that read it since the gather (Note [Streams of a sharded step]);
            # the Reducer records those that waited for its reduce-scatter
            self.fences.record_uses(self.pieces.flats[b], gather.streams)
            self.reducer.release_bucket_buffer(b)
        if not self.pending:
            self.stepped = False
            if self.current is not None:  # what the forward holds (Note [Released bucket buffers])
                self.current["memory_after_update"] = self.memory_bytes()

    def remove(self) -> None:
        """Detaches this optimizer (model.overlap_optimizer called again): the wrapped
        optimizer gets the whole state back (collective), the buckets are all-reduced again."""
        whole = self.state_dict()
        super().remove()
        self.reducer.set_sharded(False, None)
        self.optimizer.load_state_dict(whole)
