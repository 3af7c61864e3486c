"""The overlapped optimizer's fences (Note [Streams] in pyreducer/overlap/optimizer.py,
pyreducer/overlap/fences.py) run on CPU with their CUDA calls recorded: a recorder stands for the
streams, and the test says which stream is current. On CUDA they decide which stream waits for
which write-back; here, that each wait happens where the Note says, that reading a fenced
parameter does not come back into the fence (it recursed once, unseen: that path had never run),
and that the training is the same as without the recorder."""
import copy

import torch
from torch import nn


class Recorder:
    """pyreducer.overlap.fences.CudaStreams' calls, recorded; `now` is the current stream."""

    def __init__(self):
        self.now, self.log, self.count = "main", [], 0

    def applies(self, device) -> bool:
        return True

    def current(self, device):
        return self.now

    def record(self, stream):
        self.count += 1
        event = f"e{self.count}@{stream}"
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def record_use(self, tensor, stream) -> None:
        self.log.append(("use", stream, tuple(tensor.shape)))


class TwoStreams(nn.Module):
    """`a` is read on stream "x", `b` on stream "y" (the recorder's current stream is switched
    as a forward that forks a side stream would)."""

    def __init__(self, recorder):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.recorder = recorder

    def forward(self, x):
        if self.recorder is not None:
            self.recorder.now = "x"
        h = torch.tanh(self.a(x))
        if self.recorder is not None:
            self.recorder.now = "y"
        out = self.b(h)
        if self.recorder is not None:
            self.recorder.now = "main"
        return out


def _setup(rank, recorded: bool, **options):
    from pyreducer import DistributedDataParallel

    torch.manual_seed(0)
    recorder = Recorder() if recorded else None
    model = DistributedDataParallel(TwoStreams(recorder), bucket_cap_mb=1e-6)  # one bucket
    # per parameter (from the second iteration)
    opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  schedule="fifo", **options)
    if recorded:
        opt.fences.streams = recorder
    gen = torch.Generator().manual_seed(rank)
    return model, opt, recorder, lambda: torch.randn(4, 8, generator=gen)


def _steps(model, opt, batch, n):
    for _ in range(n):
        model(batch()).sum().backward()
        opt.step()
        opt.zero_grad()


def early_read_worker(rank, world_size):
    """A gradient read on stream "side" after backward completes its bucket there; read again
    on "main", then step() on "main"."""
    out = {}
    for recorded in (True, False):
        model, opt, recorder, batch = _setup(rank, recorded)
        _steps(model, opt, batch, 2)
        model(batch()).sum().backward()  # every bucket pending
        weight = model.module.a.weight
        if recorded:
            recorder.log.clear()
            recorder.now = "side"
        _ = weight.grad  # completes a.weight's bucket here
        if recorded:
            out["after_side_read"] = list(recorder.log)
            recorder.now = "main"
        _ = weight.grad
        if recorded:
            out["after_reads"] = list(recorder.log)
        opt.step()
        if recorded:
            out["after_step"] = recorder.log[len(out["after_reads"]):]
            out["classes"] = {n: type(p).__name__ for n, p in model.module.named_parameters()}
            # a copy reads the pending parameters, each fenced after its update: copied as
            # Parameter all the same
            out["copied"] = sorted({type(p).__name__ for p in
                                    copy.deepcopy(model.module).parameters()})
            out["after_copy"] = {n: type(p).__name__ for n, p in model.module.named_parameters()}
        opt.zero_grad()
        _steps(model, opt, batch, 2)
        model.synchronize()
        out["recorded" if recorded else "plain"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_a_read_on_another_stream_waits_for_an_early_write_back(ranks_once):
    for rank, r in enumerate(ranks_once(early_read_worker, 2, ())):
        # the backward's stream ("main") waits at once: a gradient taken from .grad on "side"
        # is a plain tensor, and torch has it ready there; the gradient is recorded as used on
        # "main" (the write-back may have allocated it on "side"); the read on "main" then
        # finds the fence waited for
        record = ("record", "side", r["after_reads"][0][2])
        expected = [record, ("wait", "main", record[2]), ("use", "main", (8, 8))]
        assert r["after_side_read"] == expected, (rank, r["after_side_read"])
        assert r["after_reads"] == expected, (rank, r["after_reads"])
        # step() passes the fence ("main" waited already) and the parameter wears its own class
        # (torch's foreach step checks it); the buckets still pending keep the pending class
        assert r["after_step"] == [], r["after_step"]
        assert r["classes"]["a.weight"] == "Parameter", r["classes"]
        assert r["classes"]["b.weight"] == "PendingParameter", r["classes"]
        assert r["copied"] == ["Parameter"], r["copied"]
        fenced = {n: c for n, c in r["after_copy"].items() if n != "a.weight"}  # (a.weight: done)
        assert set(fenced.values()) == {"PendingParameter"}, r["after_copy"]
        for recorded, plain in zip(r["recorded"], r["plain"]):
            assert torch.equal(recorded, plain), f"rank {rank}"


def clip_worker(rank, world_size):
    """max_grad_norm with the forward of TwoStreams: `a`'s first read on "x" clips every bucket
    there; `b`'s update on "y" must wait for that clip."""
    out = {}
    for recorded in (True, False):
        model, opt, recorder, batch = _setup(rank, recorded, max_grad_norm=0.05)
        _steps(model, opt, batch, 3)  # the third step's updates pending, clipping due
        if recorded:
            recorder.log.clear()
        loss = model(batch()).sum()
        if recorded:
            out["forward"] = list(recorder.log)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if recorded:  # backward, step() and zero_grad() find nothing fenced
            out["after"] = recorder.log[len(out["forward"]):]
        _steps(model, opt, batch, 1)
        model.synchronize()
        out["recorded" if recorded else "plain"] = [p.detach().clone() for p in model.parameters()]
    out["buckets"] = len(model.bucket_plan())
    return out


def test_an_update_on_another_stream_waits_for_the_clip(ranks_once):
    for rank, r in enumerate(ranks_once(clip_worker, 2, ())):
        assert r["buckets"] == 4, r["buckets"]
        assert r["after"] == [], r["after"]
        forward = r["forward"]
        records = [entry for entry in forward if entry[0] == "record"]
        clip = records[0][2]  # the clip, on "x", before a's first update
        assert records[0][1] == "x", forward
        y_first = next(i for i, entry in enumerate(forward) if entry[1] == "y")
        assert forward[y_first] == ("wait", "y", clip), forward  # before anything on "y"
        # a's two buckets fenced on "x", b's two on "y"; at the forward's end "main" waits
        # for each fence and the clip
        assert [entry[1] for entry in records] == ["x", "x", "x", "y", "y"], forward
        waited_by_main = {entry[2] for entry in forward if entry[:2] == ("wait", "main")}
        assert waited_by_main == {entry[2] for entry in records}, forward
        # zero_grad() after step() frees each gradient after its update, recorded as used on
        # the update's stream first
        freed = sorted(entry[1:] for entry in forward if entry[0] == "use")
        assert freed == [("x", (8,)), ("x", (8, 8)), ("y", (2,)), ("y", (2, 8))], forward
        for recorded, plain in zip(r["recorded"], r["plain"]):
            assert torch.equal(recorded, plain), f"rank {rank}"


def unread_completion_worker(rank, world_size):
    """Buckets completed where no read asked for them, on stream "side": opt.state_dict()
    before step() (write-backs alone), then after step() (updates)."""
    out = {}
    for recorded in (True, False):
        model, opt, recorder, batch = _setup(rank, recorded)
        _steps(model, opt, batch, 2)
        for phase in ("before_step", "after_step"):
            model(batch()).sum().backward()  # every bucket pending
            if phase == "after_step":
                opt.step()
                opt.zero_grad()
            if recorded:
                recorder.log.clear()
                recorder.now = "side"
            opt.state_dict()
            if recorded:
                out[phase] = list(recorder.log)
                recorder.log.clear()
                recorder.now = "main"
            if phase == "before_step":  # a plain step: nothing is pending any more
                opt.step()
                opt.zero_grad()
                if recorded:
                    out["plain_step"] = list(recorder.log)
        _steps(model, opt, batch, 2)
        model.synchronize()
        out["recorded" if recorded else "plain"] = [p.detach().clone() for p in model.parameters()]
    return out


def _each_waited_for_by_main(log):
    """The events recorded in `log`, each on "side" and waited for by "main" right after."""
    events = []
    for i, entry in enumerate(log):
        if entry[0] == "record":
            assert entry[1] == "side" and log[i + 1] == ("wait", "main", entry[2]), log
            events.append(entry[2])
    return events


def test_a_completion_no_read_asked_for_is_waited_for_by_the_backwards_stream(ranks_once):
    shapes = [(2,), (2, 8), (8,), (8, 8)]
    for rank, r in enumerate(ranks_once(unread_completion_worker, 2, ())):
        # before step(): each bucket written back on "side"; "main" (the backward's stream,
        # where step() then reads .grad) waits for each, and the gradient is used there
        before = r["before_step"]
        assert len(_each_waited_for_by_main(before)) == 4, before
        assert sorted(e[2] for e in before if e[:2] == ("use", "main")) == shapes, before
        assert r["plain_step"] == [], r["plain_step"]
        # after step() and zero_grad(): each bucket updated on "side", its gradient freed there
        after = r["after_step"]
        assert len(_each_waited_for_by_main(after)) == 4, after
        assert sorted(e[2] for e in after if e[:2] == ("use", "side")) == shapes, after
        for recorded, plain in zip(r["recorded"], r["plain"]):
            assert torch.equal(recorded, plain), f"rank {rank}"


class SharedRead(nn.Module):
    """`a` is read on stream "x"; `b`, then `a.weight` again, on stream "y" (`one_stream`: all
    on the recorder's current stream)."""

    def __init__(self, recorder):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.recorder, self.one_stream = recorder, False

    def _on(self, stream):
        if self.recorder is not None and not self.one_stream:
            self.recorder.now = stream

    def forward(self, x):
        self._on("x")
        h = torch.tanh(self.a(x))
        self._on("y")
        out = self.b(h) + self.a.weight.sum()
        self._on("main")
        return out


def sharded_worker(rank, world_size):
    """Note [Streams of a sharded step] in pyreducer/sharded/optimizer.py: shard=True with one
    bucket, gathered whole (comm.WholeGather, NCCL's kind: one collective of the group, waited
    for per stream), the forward of SharedRead after step(): the update and a's writes on "x",
    b's writes on "y", then a read of a.weight on "y"; then a forward on one stream."""
    from pyreducer import DistributedDataParallel

    out = {}
    for recorded in (True, False):
        torch.manual_seed(0)
        recorder = Recorder() if recorded else None
        module = SharedRead(recorder)
        model = DistributedDataParallel(module)  # torch's default caps: one bucket
        opt = model.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      shard=True)
        opt.comm.ring = None  # every gather whole, as on NCCL
        gathers, start = set(), opt.comm.gather_bucket
        opt.comm.gather_bucket = lambda *args: _noted(gathers, start(*args))
        if recorded:
            opt.fences.streams = recorder
        gen = torch.Generator().manual_seed(rank)
        batch = lambda: torch.randn(4, 8, generator=gen)  # noqa: E731
        _steps(model, opt, batch, 3)  # the third step's update pending
        if recorded:
            recorder.log.clear()
        loss = model(batch()).sum()
        if recorded:
            out["forward"] = list(recorder.log)
            out["classes"] = sorted({type(p).__name__ for p in model.parameters()})
            out["flat"] = tuple(opt.pieces.flats[0].shape)
        loss.backward()
        opt.step()
        opt.zero_grad()
        module.one_stream = True
        if recorded:
            recorder.log.clear()
        model(batch()).sum().backward()
        if recorded:
            out["one_stream"] = list(recorder.log)
        opt.step()
        opt.zero_grad()
        _steps(model, opt, batch, 1)
        model.synchronize()
        out["recorded" if recorded else "plain"] = [p.detach().clone() for p in model.parameters()]
    out["buckets"], out["gathers"] = len(model.bucket_plan()), sorted(gathers)
    return out


def _noted(names: set, gather):
    names.add(type(gather).__name__)
    return gather


def test_a_sharded_steps_reads_wait_for_the_gather_and_the_write_on_their_stream(ranks_once):
    for rank, r in enumerate(ranks_once(sharded_worker, 2, ())):
        assert r["buckets"] == 1 and r["gathers"] == ["WholeGather"], r
        flat = r["flat"]
        events = [entry[2] for entry in r["forward"] if entry[0] == "record"]
        assert len(events) == 2, r["forward"]
        # the buffer, released after b.bias's write on "y", is recorded on both streams that
        # waited for its gather (a's writes on "x", b's on "y"); a.weight's read on "y" waits
        # for the writes on "x" (an event recorded then, there); at the forward's end "main"
        # waits for each stream's writes, an event each
        assert r["forward"] == [
            ("use", "x", flat), ("use", "y", flat),
            ("record", "x", events[0]), ("wait", "y", events[0]), ("wait", "main", events[0]),
            ("record", "y", events[1]), ("wait", "main", events[1])], r["forward"]
        assert r["classes"] == ["Parameter"], r["classes"]  # the fences passed
        # one stream: no event, the buffer recorded on that stream alone (a no-op for the
        # caching allocator where it was allocated)
        assert r["one_stream"] == [("use", "main", flat)], r["one_stream"]
        for recorded, plain in zip(r["recorded"], r["plain"]):
            assert torch.equal(recorded, plain), f"rank {rank}"
