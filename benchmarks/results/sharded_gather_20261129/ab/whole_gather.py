"""The A/B's temporary variant, as run (not part of the library or of bench_sharded.py): the
whole-bucket gather of commit 68df4e1 (step the bucket's shard, then one ring all-gather of the
bucket; the first read waits for all of it) patched onto a sharded optimizer instance.
benchmarks/sharded_worker.py was given two variants, pyreducer_sharded_whole and
pyreducer_sharded_whole_4mb, built as pyreducer_sharded(_4mb) and then whole_gather.patch(opt)."""
import types
import torch
from pyreducer._ext import _C
from pyreducer.overlap import subset_step


def _update_bucket(self, b):
    event = dict(bucket=b, read_ns=_C.Reducer.now_ns(), reduced_ns=0, updated_ns=0,
                 module=self.running[-1] if self.running else None)
    if self.current is not None:
        self.current["updates"].append(event)
    self.reducer.complete_bucket(b)
    event["reduced_ns"] = _C.Reducer.now_ns()
    if self.max_grad_norm is None:
        self.pieces.take_grads([b], self.reducer.shard_buffers(),
                               set(self.reducer.globally_unused()))
    self.reducer.acquire_bucket_buffer(b)
    members = self.pieces.load_values(b)
    subset_step.step_subset(self.inner, members, self.settings)
    event["updated_ns"] = event["gather_launch_ns"] = _C.Reducer.now_ns()
    work = self.comm.all_gather(self.pieces.flats[b], self.pieces.own_region(b))
    self.gathers[b] = (work, event)


def _finish(self, b, reading=None):
    if b not in self.pending:
        return
    work, event = self.gathers.pop(b, (None, None))
    if work is not None:
        self.comm.wait(work, f"all-gather of bucket {b}'s parameters")
        event["gathered_ns"] = _C.Reducer.now_ns()
    group = self._release(b)
    self.busy = True
    try:
        with torch.no_grad():
            self.pieces.write_back(b, self.pieces.flats[b])
    finally:
        self.busy = False
    if work is not None:
        self.reducer.release_bucket_buffer(b)
    unused = set(self.reducer.globally_unused())
    for p in group:
        set_to_none = self.to_zero.pop(id(p), True)
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
        elif self.index[id(p)] not in unused:
            p.grad = torch.zeros_like(p)
    if not self.pending:
        self.stepped = False
        if self.current is not None:
            self.current["memory_after_update"] = self.memory_bytes()


def _finish_param(self, b, param):
    _finish(self, b)


def patch(opt):
    opt._update_bucket = types.MethodType(_update_bucket, opt)
    opt._finish = types.MethodType(_finish, opt)
    opt._finish_param = types.MethodType(_finish_param, opt)
    return opt
