"""The two things pyreducer asks of dynamo's frame evaluation, through torch._C._dynamo (loaded with
torch; torch._dynamo itself costs seconds to import and is imported only when a model is compiled).

Note [The wrapper's forward under torch.compile]
In `torch.compile(DDP(model))` dynamo starts at the wrapper's forward. That forward talks to the
Reducer (C++), the process group and Python state: traced, it would break the graph at each of those
calls and hand dynamo nothing worth compiling. So it runs as Python, never traced (as torch's own
DDP forward does, which dynamo skips): its code is marked as dynamo's `torch.compiler.disable(fn,
recursive=False)` marks a function (not inlined into a caller's trace; its own frame skipped; frames
it calls still compiled). The wrapper then turns compilation off for its own bookkeeping and on,
with pyreducer's splitting backend around the user's, for the call of the wrapped module only
(pyreducer/compiled/dynamo.py).
"""
from __future__ import annotations

import torch


def _eval_frame():
    """torch's frame-evaluation module, or None where torch has no dynamo (then nothing is ever
    compiled and these functions do nothing)."""
    return getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)


def run_eagerly(fn):
    """Marks fn so dynamo neither inlines it nor compiles its frame, but compiles the frames it
    calls (Note [The wrapper's forward under torch.compile]). Returns fn."""
    fn._torchdynamo_disable = True  # read by dynamo's tracer before inlining a call
    fn._torchdynamo_disable_recursive = False
    fn._torchdynamo_disable_msg = (
        "pyreducer's forward is never traced (its Reducer and process group run in C++): "
        "torch.compile(DDP(model)) compiles the wrapped module's call only")
    ef = _eval_frame()
    if ef is not None:
        ef.set_code_exec_strategy(fn.__code__, ef._FrameExecStrategy(ef._FrameAction.SKIP,
                                                                     ef._FrameAction.DEFAULT))
    return fn


def captured_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a frame of pyreducer's own, which dynamo captures (inlining fn)
    when called with torch.compile's callback on: dynamo starts no capture at torch.nn's own
    frames (a module's __call__), as OptimizedModule's own wrapper frame shows."""
    return fn(*args, **kwargs)


def swap_callback(callback):
    """Installs dynamo's frame callback (None: no compilation) and returns the one it replaces.
    Its own frame, entered with the user's callback on, is compiled by it (an empty graph): that
    is what satisfies dynamo's check that torch.compile(DDP(model), fullgraph=True) compiled a
    frame (skipping this frame made that check fail). Fragile: it rests on dynamo's private
    frame-callback API (pyreducer/compiled/dynamo.py keeps what it needs of dynamo in one place)."""
    ef = _eval_frame()
    return ef.set_eval_frame(callback) if ef is not None else None


def is_compiling_callback(callback) -> bool:
    """Whether a frame callback compiles (torch.compile's), rather than None/False (off, or run
    cached code only)."""
    return callable(callback) and hasattr(callback, "_torchdynamo_orig_backend")
