"""The overlapped optimizer: `optimizer = model.overlap_optimizer(optimizer)`.

Note [Overlapped step]
torch DDP's step barrier: every bucket's all-reduce must finish before optimizer.step(), and the
next forward starts after it. With an overlapped optimizer the loop stays
`loss.backward(); optimizer.step(); optimizer.zero_grad(); model(x)`, but:
  - backward ends without waiting: the Reducer leaves its buckets' reductions in flight
    (Note [Deferred completion] in csrc/reducer.h);
  - step() and zero_grad() only record what to do;
  - the next forward updates each parameter just before it is read: the first read of a
    parameter waits for its bucket's reduction, writes the averages into .grad, steps the
    bucket's parameters with the user's own optimizer (its param_groups cut down to those
    parameters, its state shared: Note [One step, in buckets] in pyreducer/overlap/subset_step.py),
    and zeroes their gradients as zero_grad() asked;
  - whatever the forward did not read is updated at its end, before the next backward.
Where the update runs: lazily, on the Python thread, just before the read (not in a completion
callback or a worker thread): the optimizer's math then runs where torch runs it, in order with
the forward, and never concurrently with another update.
Reads are caught exactly: at step(), every parameter whose update is pending gets a subclass of
its own class (its __class__ is swapped; isinstance checks still hold) whose __torch_function__
updates the parameter's bucket, restores the class and only then runs the operation. Any torch
operation on it, anywhere (its module's forward, a parent reading a tied or child weight,
F.linear(x, m.weight), .data, .grad, detach(), state_dict(), torch.save, printing, a tensor
passed inside a dict to handle_torch_function, pickling) therefore sees the updated value;
copy.deepcopy updates first too, and a copy of the module gets hooks that do nothing (the copy is
not overlapped; tests/multirank/test_overlap_reads.py checks each read against torch DDP's
step). A forward pre-hook on every submodule starts the updates of its own
parameters a little earlier. The wrapper's forward completes whatever the forward did not read
before its backward, and a forward of model.module itself completes everything first (a backward
through it would add into gradients still pending).
"""
from __future__ import annotations

import collections
import contextlib
import weakref

import torch

from pyreducer._ext import _C
from pyreducer.overlap import bypass, pending, subset_step
from pyreducer.overlap.module_hooks import InertHook, ModuleHook
from pyreducer.overlap.clipping import Clipping
from pyreducer.overlap.fences import Fences
from pyreducer.overlap.schedule_tuner import ScheduleTuner
from pyreducer.wrapper import arguments

_InertHook = InertHook  # (its name here before: modules saved then unpickle to it)
HISTORY = 16  # iterations whose overlap events are kept (the timeline keeps 8 by default)


def _keep_eager() -> None:
    """OverlapOptimizer.update_parameter (bookkeeping) runs eagerly, never traced into a graph
    by torch.compile (traced, one of dynamo's guards read an entry the update had popped).
    torch.compiler.disable imports torch._dynamo, about 2 s of CPU, so it is applied when the
    first overlapped optimizer is made, not when pyreducer is imported (every rank imports it)."""
    if not getattr(OverlapOptimizer.update_parameter, "_pyreducer_eager", False):
        eager = torch.compiler.disable(OverlapOptimizer.update_parameter)
        eager._pyreducer_eager = True
        OverlapOptimizer.update_parameter = eager


class OverlapOptimizer(Clipping, torch.optim.Optimizer):
    """A torch optimizer whose updates overlap the next forward (Note [Overlapped step]).

    Shares param_groups, state and defaults with the optimizer it wraps (LR schedulers work on
    either); `step()` and `zero_grad()` take effect bucket by bucket during the next forward,
    with the hyperparameters (lr, ...) in force when `step()` was called.

    Made by `model.overlap_optimizer(optimizer, **options)`, which passes the wrapper's own
    arguments: `reducer` and `params` (the wrapper's C++ Reducer and ReducedParams), `module`
    (the wrapped module: its submodules get the early-update hooks), `tuning` and `autotune`
    (the wrapper's BucketTuning and AutoTuner: `schedule="auto"` waits for the bucket
    autotune to decide), and `replacing` (the wrapper's previous overlapped optimizer, removed
    once the arguments are accepted: a refused replacement leaves it working).

    Args:
        optimizer (torch.optim.Optimizer): any torch optimizer over the wrapped model's
            parameters (`step()` without a closure).
        max_grad_norm (float | None): clip the global gradient norm to this before any
            update, with `torch.nn.utils.clip_grad_norm_`'s arithmetic (every bucket must be
            reduced first).
        schedule (str | float): `"auto"` (default): after a few iterations, the buckets are
            all-reduced in chunks, in the order that serves the next forward first: the step
            model of `pyreducer/overlap/schedule.py` ranks chunk sizes from this run's timeline
            and a link probe, the best few and torch DDP's step barrier are each timed for a
            few steps, and the fastest is kept (on every rank alike; see
            `pyreducer/overlap/schedule_tuner.py`; `schedule_log` says what was planned,
            measured and chosen). `"fifo"`: whole buckets in torch DDP's order (with 3 or more
            ranks, the only schedule whose all-reduce sums are torch DDP's bit for bit). A
            number: chunks of that many MB, in the planned priority order (planned as
            `"auto"` is, without choosing the size; where the link probe or the profile is
            unusable, in torch DDP's bucket order, and `schedule_log` says why).
        hold_back (int): with `schedule="fifo"`: how many of the last buckets (the first
            layers', full last in backward) are launched first-layers-first right after the
            backward, so that the next forward's first reads complete first
            (Note [Launch order] in `csrc/reducer.h`). 0: torch DDP's order.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, reducer, params, module,
                 max_grad_norm: float | None = None, hold_back: int = 0, schedule: str = "auto",
                 tuning=None, autotune=None, replacing: OverlapOptimizer | None = None):
        fixed_mb = arguments.check_overlap_optimizer(optimizer, module, hold_back, schedule)
        if replacing is not None:
            replacing.remove()
        _keep_eager()
        super().__init__([{"params": list(g["params"])} for g in optimizer.param_groups],
                         optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared: schedulers may drive either
        self.optimizer, self.reducer, self.params = optimizer, reducer, params
        self.max_grad_norm, self.hold_back = max_grad_norm, hold_back
        self.tuner = None if schedule == "fifo" else ScheduleTuner(
            tuning, self.events, autotune, settle=self.synchronize, set_barrier=self._set_barrier,
            chunk_bytes=int(schedule * 2**20) if fixed_mb else None)
        # Buckets whose parameters wear the pending class: reduction in flight, and (once
        # step() was called: self.stepped) their update too.
        self.pending: dict[int, list[torch.Tensor]] = {}
        self.bucket_of: dict[int, int] = {}  # id(pending parameter) -> its bucket
        tensors = params.tensors
        self.fences = Fences(self, tensors[0].device if tensors else torch.device("cpu"))
        self.stepped = self.clip_due = self.removed = False
        self.settings: subset_step.Settings | None = None  # fixed by step()
        self.members: set[int] = set()  # ids of the parameters in them then
        self.to_zero: dict[int, bool] = {}  # id(pending parameter) -> zero_grad()'s set_to_none,
        # applied after its update
        self.busy = False  # inside an update: reads pass through
        self.in_forward = False
        self.backward_in_forward = False  # a synced backward ended inside the running forward
        # What the timeline shows (see events()): per synced iteration, the next forward's span
        # and each bucket's update, on the Reducer's host clock.
        self.history: collections.OrderedDict[int, dict] = collections.OrderedDict()
        self.current: dict | None = None
        # A weak reference: the C++ Reducer holding this optimizer strongly would be a cycle the
        # garbage collector cannot see through.
        ended = weakref.WeakMethod(self._backward_ended)
        self.on_deferred = lambda: ended() and ended()()
        self.barrier = False  # torch DDP's step (the tuner measures it against the overlap)
        reducer.set_deferred_completion(True, self.on_deferred)
        # The modules whose forward is running, innermost last: a wait is charged to the
        # module that read the parameter (events(): "module").
        self.names = {id(m): name or "(root)" for name, m in module.named_modules()}
        self.running: list[str] = []
        # (searched for aliases at step(): Note [Reads around the pending class] in bypass.py)
        self.modules = list(module.modules())
        self.handles = [m.register_forward_pre_hook(ModuleHook(self._before_module))
                        for m in self.modules]
        self.handles += [m.register_forward_hook(ModuleHook(self._after_module),
                                                 always_call=True) for m in self.modules]
        self.handles.append(module.register_forward_pre_hook(ModuleHook(self._before_root)))
        self.handles.append(module.register_state_dict_pre_hook(ModuleHook(self._synchronize_for)))

    @property
    def schedule_log(self) -> list[dict]:
        """The schedules chosen so far (schedule="auto"; pyreducer/overlap/schedule_tuner.py)."""
        return self.tuner.log if self.tuner is not None else []

    # -- the optimizer interface -----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Records the update of every parameter whose bucket is still being reduced; they
        happen when the next forward reads them (or at synchronize()). Every other parameter
        with a gradient is stepped at once, as torch does: those whose reduction is done (a
        read after backward waited for it, or a backward without sync) and those outside every
        bucket (ignored by the wrapper, delayed all-reduce, not in the model).

        `closure` (as Lightning steps): run first, with gradients enabled, as torch's
        optimizers run it; it holds the forward (which applies the previous step's pending
        updates) and the backward (which leaves this step's reductions in flight), so the
        step then records as it does without one. Returns the closure's result."""
        loss = self._run_closure(closure)
        if self.stepped:  # a previous step's updates, if no forward ran since
            self._update_all()
        self._step_hooks(self.optimizer._optimizer_step_pre_hooks)
        self.fences.pass_all()  # this stream waits for reads' write-backs on other streams (a
        # hook's too), and the parameters wear their own class (torch's foreach step wants it)
        if not self.pending:  # nothing in flight: a plain step
            if self.max_grad_norm is not None:
                self._clip()
            subset_step.math_step(self.optimizer)
            self._step_done()
            return loss
        self.clip_due = self.max_grad_norm is not None
        self.settings = subset_step.Settings(self.optimizer)  # every bucket steps with them
        self.members = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        now = [p for g in self.optimizer.param_groups for p in g["params"]
               if id(p) not in self.bucket_of and p.grad is not None]
        if now:  # stepped now; clipping first needs every gradient, reduced
            if self.clip_due:
                self.clip_due = False
                self._clip()
            subset_step.step_subset(self.optimizer, {id(p) for p in now}, self.settings)
        self.stepped = True
        self.update_aliased()
        self._step_done()
        return loss

    def _run_closure(self, closure):
        """step()'s start: a step of a replaced overlapped optimizer refused, then the closure
        run (with gradients enabled, as torch's optimizers run it); returns its result."""
        self._check_not_removed()
        with torch.enable_grad():
            return None if closure is None else closure()

    def _check_not_removed(self) -> None:
        if self.removed:
            raise RuntimeError("overlap_optimizer: this overlapped optimizer was replaced by "
                               "another (model.overlap_optimizer called again): step that one")

    def _step_done(self) -> None:
        self._step_hooks(self.optimizer._optimizer_step_post_hooks)
        self.optimizer._opt_called = True  # what an LR scheduler built on it checks

    def _step_hooks(self, hooks) -> None:
        """The wrapped optimizer's own step hooks (its register_step_pre_hook/_post_hook), run
        once per step(), as torch runs them, with its whole param_groups: the per-bucket
        updates run its math alone (pyreducer/overlap/subset_step.py). Pre-hooks cannot change
        step()'s arguments here (it has none but the refused closure)."""
        for hook in list(hooks.values()):
            hook(self.optimizer, (self.optimizer,), {})

    def zero_grad(self, set_to_none: bool = True, params=None) -> None:
        """Zeroes the gradients of the optimizer's parameters (or of `params`: the wrapper's
        zero_grad). After step(), those still pending are zeroed right after their update.
        Before step() (or without one: a skipped step), every reduction is completed and every
        gradient zeroed now, as torch does (the overlap of this step is lost)."""
        self.fences.pass_all()
        if self.pending and not self.stepped:
            self.synchronize()
        if params is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:
            if id(p) in self.bucket_of:
                self.to_zero[id(p)] = set_to_none
                continue
            with torch.no_grad():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @property
    def state(self):
        """The wrapped optimizer's state, once every pending update is done (a parameter's
        state entry is found by the parameter's hash, which no torch function sees: read here
        without waiting, it would be the previous step's)."""
        if getattr(self, "pending", None) and not self.busy:
            self.synchronize()
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        """Sets the wrapped optimizer's state (the empty one torch.optim.Optimizer.__init__ sets
        first, before there is a wrapped optimizer, is dropped)."""
        if "optimizer" in self.__dict__:
            self.optimizer.state = value

    def state_dict(self):
        """The wrapped optimizer's `state_dict()`, once every pending update is done (torch's
        format: a plain optimizer of the same class loads it)."""
        self.synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Loads `state_dict` into the wrapped optimizer, once every pending update is done,
        and shares the optimizer's new param_groups (an LR scheduler may drive either)."""
        self.synchronize()
        self.optimizer.load_state_dict(state_dict)
        # torch's load_state_dict gives the optimizer new param_groups: share them, or an LR
        # scheduler driving this object would set a learning rate no step reads (state: the
        # property reads the optimizer's)
        self.param_groups = self.optimizer.param_groups

    # -- reductions and updates ------------------------------------------------------------------
    def _backward_ended(self) -> None:
        """The Reducer left reductions in flight (autograd thread, after the backward): their
        parameters wear the pending class until read, stepped or synchronized."""
        self.fences.backward_ended()  # (passes the fences a forward that raised left)
        self.to_zero.clear()  # ... and zeroing due after an update that raised
        self.backward_in_forward = self.in_forward  # (Note [A backward inside the forward])
        if self.pending:  # a backward with updates still pending cannot happen (the Reducer
            return        # refuses gradients then); be safe against a re-entrant call
        tensors, layout = self.params.tensors, self.reducer.bucket_layout()
        for b in self.reducer.pending_buckets():
            group = [tensors[i] for i in layout[b]["param_indices"]]
            self.pending[b] = group
            for p in group:
                self.bucket_of[id(p)] = b
                pending.wear(p, self)
        self.stepped = False
        self.current = dict(iteration=self.reducer.num_iterations, forward_start_ns=0,
                            forward_end_ns=0, updates=[])
        self.history[self.current["iteration"]] = self.current
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)

    def events(self, iteration: int) -> dict | None:
        """The overlap of synced iteration `iteration`: {"forward_start_ns", "forward_end_ns"}
        of the forward that followed its backward, and "updates": per bucket {"bucket",
        "read_ns" (a read asked for it, or a sync), "reduced_ns" (its all-reduce waited for and
        written back), "updated_ns" (stepped, or 0 if it was read before step()), "module" (the
        qualified name of the innermost module whose forward was running when the read came,
        "(root)" for the wrapped module itself; None for a read outside any forward, or the
        updates completed at the forward's end)}."""
        return self.history.get(iteration)

    def synchronize(self) -> None:
        """Completes every pending update and every reduction still in flight."""
        self._update_all()
        self.reducer.complete_all()
        self.fences.pass_all()

    def before_plan_change(self) -> None:
        """Before the wrapper installs a new bucket plan (the Reducer then completes what is
        pending itself; a sharded optimizer does its updates first)."""

    def _set_barrier(self, barrier: bool) -> None:
        """Between iterations: torch DDP's step barrier (every reduction completes at the
        backward's end; step() updates everything at once) or the overlapped step."""
        if barrier != self.barrier:
            self.synchronize()
            self.reducer.set_deferred_completion(not barrier, self.on_deferred)
            self.barrier = barrier

    def update_parameter(self, param: torch.Tensor, func=None) -> None:  # (kept eager)
        """A read of `param` (by torch function `func`) is coming: its bucket is reduced (and
        updated if stepped) first."""
        if not self.busy:
            if param in self.fences:
                self.fences.wait(param)
            b = self.bucket_of.get(id(param))
            if b is not None:
                self._read(b, param, func)

    def _read(self, b: int, param: torch.Tensor, func) -> None:
        self._update(b, reading=param)

    def update_aliased(self) -> None:
        """After step(): the pending parameters whose memory a module attribute or buffer shares
        updated now (Note [Reads around the pending class] in bypass.py)."""
        pending = [p for p in self.params.tensors if id(p) in self.bucket_of]
        if pending:
            for p in bypass.aliased(self.modules, pending):
                self.update_parameter(p)

    def _update_all(self) -> None:
        for b in sorted(self.pending):
            self._update(b)

    # Note [Streams]
    # On CUDA a bucket is completed (the current stream waits for its reduction), written back
    # and stepped on the stream current at its first read; torch DDP steps on the stream current
    # at step(), before the forward, which its side streams then wait for. Here a bucket may be
    # updated on a side stream and read on the main one, which never waited for the side (or
    # the other way round). So after an update on CUDA, the bucket's parameters wear the
    # pending class again (fenced: pyreducer/overlap/fences.py) until the fences are passed, and a
    # read on a stream that has not waited yet for the event recorded after the update makes it
    # wait. A bucket completed by a read before step() (its averages written into .grad on the
    # reading stream) is fenced the same way, and the backward's stream waits for it at once
    # (a gradient taken from .grad is plain: torch has it ready there). A clip writes back
    # and scales every bucket on the stream current then: every later update waits for it.
    # step() and zero_grad() (their stream waits: after step(), other streams wait for it, as
    # with torch), the forward's end, synchronize(), and the next forward or backward's end
    # (after a forward that raised) pass every fence. A bucket completed where no read asked
    # for it (synchronize(), state_dict(), zero_grad() before step(), on a side stream) is not
    # fenced: the backward's stream waits for it at once (Fences.settle). Gradients freed after
    # an update are recorded on the update's stream, and a fence's gradients on each stream
    # that waits. After the forward, its updates are in its stream's order alone: a stream that
    # reads parameters then must wait for that stream (with torch DDP, waiting for the stream
    # of step() sufficed: here the updates run in the forward).
    # Compiled, not run: no GPU here (tests/gpu: a two-stream forward, a gradient read on a
    # side stream before step(), each against torch DDP); the bookkeeping runs on CPU with the
    # CUDA calls recorded (tests/multirank/test_overlap_fences.py). On CPU nothing is fenced.

    @torch.no_grad()
    def _update(self, b: int, reading: torch.Tensor | None = None) -> None:
        """Bucket b: its reduction completed; after step(), its parameters stepped with the
        optimizer's own math (param_groups cut down to them, step()'s settings) and their
        gradients zeroed as zero_grad() asked."""
        group = self.pending.pop(b)
        event = dict(bucket=b, read_ns=_C.Reducer.now_ns(), reduced_ns=0, updated_ns=0,
                     module=self.running[-1] if self.running else None)
        if self.current is not None:
            self.current["updates"].append(event)
        for p in group:
            del self.bucket_of[id(p)]
            pending.take_off(p)
        self.busy = True
        try:
            with subset_step.as_step(self.fences.device):  # not the forward's modes
                if self.stepped and self.clip_due:
                    self.clip_due = False
                    self._clip()
                self.fences.wait_clip()
                self.reducer.complete_bucket(b)
                event["reduced_ns"] = _C.Reducer.now_ns()
                if self.stepped:
                    subset_step.step_subset(self.optimizer, {id(p) for p in group} & self.members,
                                            self.settings)
                    event["updated_ns"] = _C.Reducer.now_ns()
        finally:
            self.busy = False
        for p in group:  # (only after step(): zero_grad() before it zeroes at once)
            set_to_none = self.to_zero.pop(id(p), None)
            if set_to_none:
                if p.grad is not None:
                    self.fences.record_freed(p.grad)  # Note [Streams]
                p.grad = None
            elif set_to_none is not None and p.grad is not None:
                p.grad.zero_()
        if reading is not None:
            self.fences.fence(group, early=not self.stepped)
        else:  # synchronize(), state_dict(), ...: the backward's stream waits now
            self.fences.settle(group)
        if not self.pending and self.stepped:
            self.stepped = False

    # -- the wrapper's forward -----------------------------------------------------------------
    @contextlib.contextmanager
    def around_forward(self, tune: bool):
        """The wrapper's module runs inside: pending updates happen as it reads its parameters,
        the rest when it returns. `tune`: the first synced forward since the last synced
        backward (the schedule tuner acts there, on every rank alike)."""
        self.forward_starting(tune)
        self.in_forward = True
        try:
            yield
        finally:
            self.in_forward = False
        self.forward_ended()

    def forward_starting(self, tune: bool) -> None:
        """Before the wrapper's module runs (after any rebuild): the launch order for the coming
        backward, the same on every rank (schedule="fifo": it depends on the bucket count alone;
        "auto": see ScheduleTuner)."""
        self.running = []  # a forward that raised may have left names behind ...
        self.fences.pass_all()  # ... and fences
        if self.tuner is not None:
            if tune:
                self.tuner.before_synced_forward()
        else:
            count = len(self.reducer.bucket_layout())
            held = min(self.hold_back, count)
            order = list(range(count - held)) + list(range(count - 1, count - held - 1, -1))
            if self.reducer.launch_order() != order or set(self.reducer.launch_chunks()) != {1}:
                self.reducer.set_launch_order(order)
        if self.current is not None and not self.current["forward_start_ns"]:
            self.current["forward_start_ns"] = _C.Reducer.now_ns()

    # Note [A backward inside the forward]
    # Lightning's manual optimisation runs training_step, its backward and step() included,
    # inside the wrapper's forward. That backward's updates are the next forward's to apply, as
    # after a backward outside it: this forward's end leaves them pending. What the next forward
    # does not read is updated before its backward by whoever arms a backward inside the forward
    # (pyreducer.lightning's backward: model.synchronize()), as a forward's end updates it.
    def forward_ended(self) -> None:
        """After the wrapper's module ran: what the forward did not read is updated now, before
        the backward adds into gradients (Note [A backward inside the forward])."""
        if self.backward_in_forward:
            self.backward_in_forward = False
            return
        self.synchronize()
        if self.current is not None and not self.current["forward_end_ns"]:
            self.current["forward_end_ns"] = _C.Reducer.now_ns()

    def _before_module(self, module, args) -> None:
        self.running.append(self.names.get(id(module), type(module).__name__))
        if self.pending:
            for p in module.parameters(recurse=False):
                self.update_parameter(p)

    def _after_module(self, module, args, output) -> None:
        if self.running:
            self.running.pop()

    def _before_root(self, module, args) -> None:
        if not self.in_forward and (self.pending or self.reducer.pending_buckets()):
            self.synchronize()  # a forward of the module itself, not through the wrapper

    def _synchronize_for(self, *args) -> None:  # a state_dict() of the module
        self.synchronize()

    def remove(self) -> None:
        """Detaches this optimizer from the wrapper (model.overlap_optimizer called again):
        every pending update done, the hooks removed, backward completing its reductions."""
        self.synchronize()
        for handle in self.handles:
            handle.remove()
        self.reducer.set_deferred_completion(False)
        self.removed = True
