"""Which device pyreducer's own collectives use: the parameters' device, never the current CUDA
device. A script that moves each rank's model to its GPU and passes device_ids but never calls
torch.cuda.set_device is valid with torch DDP; collectives that pick torch.cuda.current_device()
(torch's object collectives and barrier do, for NCCL) would put every rank on cuda:0 ("Duplicate
GPU" or a hang). On CPU this is checked in the source: no library or tool module calls them."""
import glob
import os
import re

import pyreducer

PACKAGE = os.path.dirname(os.path.abspath(pyreducer.__file__))
CURRENT_DEVICE_CALLS = re.compile(
    r"torch\.cuda\.current_device\(|dist\.(barrier|all_gather_object|broadcast_object_list|"
    r"gather_object|scatter_object_list)\(")


def test_no_collective_picks_the_current_cuda_device():
    found = []
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        for number, line in enumerate(open(path), start=1):
            code = line.split("#")[0]
            if CURRENT_DEVICE_CALLS.search(code) and not code.strip().startswith(('"', "`")):
                found.append(f"{os.path.relpath(path, PACKAGE)}:{number}: {line.strip()}")
    assert not found, found


def test_every_sync_collective_takes_a_device():
    import inspect

    from pyreducer.wrapper import sync

    for name in ("all_gather_object", "broadcast_object", "from_rank0", "slowest", "barrier",
                 "verify_same_model", "verify_same_plan"):
        assert "device" in inspect.signature(getattr(sync, name)).parameters, name
