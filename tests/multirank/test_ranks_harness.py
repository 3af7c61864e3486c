"""The spawned-ranks harness (pyreducer/testing/ranks.py) reports the rank that failed first,
with its traceback, and the ranks that failed after it with their last line: a rank that raises
makes its peers fail in their next collective, and the cause is the first error, not the lowest
rank's."""
import time

import pytest
import torch
import torch.distributed as dist

from pyreducer.testing import RankError, run_ranks


def first_fails_worker(rank, world_size):
    if rank == 1:
        raise ValueError("the cause, on rank 1")
    time.sleep(1.0)  # rank 0 fails after rank 1, in its next collective
    dist.all_reduce(torch.ones(4))


def test_the_first_failure_is_reported_first():
    with pytest.raises(RankError) as caught:
        run_ranks(first_fails_worker, 2, timeout_s=60, pg_timeout_s=20)
    assert caught.value.rank == 1
    text = str(caught.value)
    assert text.startswith("rank 1 of 2 failed first:") and "ValueError: the cause" in text
    assert "--- rank 0 failed after it:" in text
