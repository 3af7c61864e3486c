"""pyreducer: a gradient-bucketing Reducer for PyTorch data-parallel training.

    from pyreducer import DistributedDataParallel as DDP

is a drop-in replacement for torch.nn.parallel.DistributedDataParallel.
"""
import torch  # noqa: F401  (must load before the extension)

from pyreducer._ext import _C  # noqa: F401
from pyreducer._version import __version__
from pyreducer.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel", "__version__"]
