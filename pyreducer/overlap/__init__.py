"""The overlapped optimizer: `optimizer = model.overlap_optimizer(optimizer)`.

The step barrier of torch DDP removed: backward leaves its reductions in flight, step() records,
and the next forward updates each bucket's parameters just before their first read (Note
[Overlapped step] in optimizer.py). The package, by concept:
  - optimizer.py       OverlapOptimizer: recording step() and zero_grad(), the per-bucket
                       updates, reads before the forward, state_dict;
  - pending.py         the class a parameter wears while its update is pending;
  - bypass.py          reads that reach a parameter around that class (aliases in modules);
  - module_hooks.py    the forward hooks on the user's modules, holding the optimizer weakly;
  - subset_step.py     one bucket's update with the optimizer's own math (Note [One step, in
                       buckets]);
  - fences.py          CUDA stream fences around write-backs and updates (compiled, not run);
  - schedule.py        the schedule model: chunk sizes and launch order, and the step they give;
  - contention.py      the compute a running all-reduce takes from its rank (the model's input);
  - schedule_tuner.py  schedule="auto": trials of the model's best schedules, measured in place;
  - schedule_recall.py the tuner's decisions remembered across runs (pyreducer/tuning/memory.py);
  - stepclock.py       the trial windows' clocks (host time on CPU, CUDA events on GPU).
The sharded optimizer (pyreducer/sharded/) builds on it.
"""
from pyreducer.overlap.optimizer import OverlapOptimizer

__all__ = ["OverlapOptimizer"]
