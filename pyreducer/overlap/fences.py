"""The overlapped optimizer's fences on CUDA (Note [Streams] in pyreducer/overlap/optimizer.py):
events recorded after a bucket's write-back or update, or after a clip (or, for a sharded step's
parameter writes, at the first read on another stream), and which streams have waited for each. The bookkeeping is the same on every device; the CUDA calls are in CudaStreams
alone, which a CPU test replaces with a recorder (tests/multirank/test_overlap_fences.py). On CPU
nothing is fenced."""
from __future__ import annotations

import torch

from pyreducer.overlap import pending


class CudaStreams:
    """The CUDA calls the fences make."""

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    def current(device: torch.device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def record(stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def wait(stream, event) -> None:
        stream.wait_event(event)

    @staticmethod
    def record_use(tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class _Fence:
    """An event recorded on the current stream now, the streams that have waited for it (that
    stream among them), and the gradients written before it (`grads`)."""

    def __init__(self, streams, device: torch.device, grads=()):
        stream = streams.current(device)
        self.event, self.waited, self.device = streams.record(stream), {stream}, device
        self.grads = list(grads)

    def wait(self, streams, stream=None) -> None:
        """`stream` (default: the current one) waits for the event, once. The gradients are
        recorded as used on it: one the write-back allocated on the fence's stream (a locally
        unused parameter's) goes back to that stream's pool when freed, and the caching
        allocator must not hand it out again before this stream's work on it is done."""
        stream = streams.current(self.device) if stream is None else stream
        if stream not in self.waited:
            streams.wait(stream, self.event)
            self.waited.add(stream)
            for grad in self.grads:
                streams.record_use(grad, stream)


class _WriteMark:
    """The writes on one stream since an event was last needed there (Fences.fence_written):
    the event is recorded at the first read on another stream, where it covers every write
    before that read (and whatever else that stream queued meanwhile), and is then shared by
    the streams that read those writes later."""

    def __init__(self, stream, device: torch.device):
        self.stream, self.device, self.event, self.waited = stream, device, None, {stream}

    def wait(self, streams, stream=None) -> None:
        """`stream` (default: the current one) waits for the writes, once."""
        stream = streams.current(self.device) if stream is None else stream
        if stream not in self.waited:
            if self.event is None:
                self.event = streams.record(self.stream)
            streams.wait(stream, self.event)
            self.waited.add(stream)


class Fences:
    """The fenced parameters of one overlapped optimizer (`owner`: they wear its pending class
    while fenced), and the fence after a clip.

    Nothing here reads a fenced parameter through torch (not even its .device): that read would
    come back here through the pending class's __torch_function__."""

    def __init__(self, owner, device: torch.device):
        self.owner, self.device = owner, device
        self.streams = CudaStreams()
        self.fenced: dict[int, tuple[torch.Tensor, _Fence]] = {}
        self.clip: _Fence | None = None
        self.home = None  # the stream current at the backward's end (backward_ended)
        self.marks: dict = {}  # stream -> its _WriteMark still without an event

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self.fenced

    def backward_ended(self) -> None:
        """At the backward's end: every fence passed (a forward that raised leaves some), and
        the current stream kept as the backward's: torch runs its final callbacks on the
        stream that called backward(), and after a backward its gradients are ready there."""
        self.pass_all()
        if self.streams.applies(self.device):
            self.home = self.streams.current(self.device)

    def fence(self, group: list, early: bool = False) -> None:
        """After `group`'s write-back (and update) on the current stream: until passed, their
        reads on another stream wait for it. `early`: a write-back before step(); the
        backward's stream waits for it now, so that a gradient taken from .grad on the reading
        stream (a plain tensor, which no fence sees) is ready on it, as with torch. Call with
        the group wearing its own class (their gradients are read)."""
        if not self.streams.applies(self.device):
            return
        fence = _Fence(self.streams, self.device,
                       [p.grad for p in group if p.grad is not None])
        if early and self.home is not None:
            fence.wait(self.streams, self.home)
        for p in group:
            self.fenced[id(p)] = (p, fence)
            pending.wear(p, self.owner)

    def fence_written(self, param: torch.Tensor) -> None:
        """After `param` was written on the current stream (a sharded step's write from its
        gathered bucket: Note [Streams of a sharded step] in pyreducer/sharded/optimizer.py):
        until passed, a read on another stream waits for the write. No CUDA call here: the
        event is recorded at the first read on another stream (_WriteMark), so a forward on
        one stream records none. Call with `param` wearing its own class."""
        if not self.streams.applies(self.device):
            return
        stream = self.streams.current(self.device)
        mark = self.marks.get(stream)
        if mark is None or mark.event is not None:  # an event recorded: later writes need
            mark = self.marks[stream] = _WriteMark(stream, self.device)  # another
        self.fenced[id(param)] = (param, mark)
        pending.wear(param, self.owner)

    def current_stream(self):
        """The current stream of the fences' device where fences apply (CUDA), else None."""
        if not self.streams.applies(self.device):
            return None
        return self.streams.current(self.device)

    def record_uses(self, tensor: torch.Tensor, streams) -> None:
        """`tensor`, about to be freed, is recorded as used on each of `streams` (other than
        where it was allocated: the caching allocator skips that one): its memory is not handed
        out again before their work on it is done."""
        if self.streams.applies(self.device):
            for stream in streams:
                self.streams.record_use(tensor, stream)

    def settle(self, group: list) -> None:
        """After `group`'s write-back (and update) on the current stream that no read asked
        for (synchronize(), state_dict(), zero_grad() before step(), ...): if that is not the
        backward's stream, the backward's stream waits for it now, as after an early read (work
        queued there next, a step() or a forward, must see the averages and updates, as with
        torch), and the gradients are recorded as used there. Nothing is fenced: every such
        caller passes the fences next."""
        if not self.streams.applies(self.device) or self.home is None:
            return
        if self.streams.current(self.device) != self.home:
            _Fence(self.streams, self.device,
                   [p.grad for p in group if p.grad is not None]).wait(self.streams, self.home)

    def record_freed(self, grad: torch.Tensor) -> None:
        """`grad`, freed after its update on the current stream, is recorded as used there: it
        may have been allocated on another stream (a locally unused parameter's, by a
        write-back there), and the caching allocator must not hand it out again before this
        stream's work on it is done."""
        if self.streams.applies(self.device):
            self.streams.record_use(grad, self.streams.current(self.device))

    def fence_clip(self) -> None:
        """After a clip on the current stream wrote back and scaled every bucket's gradients:
        an update on another stream waits for it (wait_clip) until the fences are passed."""
        if self.streams.applies(self.device):
            self.clip = _Fence(self.streams, self.device)

    def wait(self, param: torch.Tensor) -> None:
        """A read of fenced `param` on the current stream."""
        self.fenced[id(param)][1].wait(self.streams)

    def wait_clip(self) -> None:
        if self.clip is not None:
            self.clip.wait(self.streams)

    def wait_all(self) -> None:
        """The current stream waits for every fence; the parameters stay fenced."""
        for _, fence in list(self.fenced.values()):
            fence.wait(self.streams)
        self.wait_clip()

    def pass_all(self) -> None:
        """Every fence passed: the current stream waits for each, the parameters wear their
        own class again."""
        for p, fence in self.fenced.values():
            pending.take_off(p)
            fence.wait(self.streams)
        self.fenced.clear()
        self.marks.clear()
        self.wait_clip()
        self.clip = None
