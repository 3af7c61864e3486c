"""Test and benchmark support (not imported by `import pyreducer`): spawned Gloo ranks with a
hard wall-clock bound (ranks.py) and small reference models (models.py)."""
from pyreducer.testing.ranks import (RankError, RankTimeout, run_ranks, subprocess_env,
                                     torchrun_module, wait_for_exit)

__all__ = ["RankError", "RankTimeout", "run_ranks", "subprocess_env", "torchrun_module",
           "wait_for_exit"]
