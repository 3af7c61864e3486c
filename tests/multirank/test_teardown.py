"""Letting go of a Reducer that holds the last reference to its process group (see Note [Letting
the Reducer go without the GIL] in csrc/bindings.cpp): a script that destroyed the group before
its model went out of scope must end, not wait forever for a Gloo worker that waits for the GIL.

The worker sets up the race that hung torch DDP's own runs at exit: a collective on a tensor only
the work still holds (freeing it takes the GIL), finished while the main thread keeps the GIL,
then the Reducer, last owner of the group, let go."""
import sys
import time

import torch
import torch.distributed as dist

from pyreducer.testing import run_ranks

HOLD_GIL_S = 0.5  # rank 0 keeps the GIL this long: its all-reduce finishes meanwhile
LATE_S = 0.2  # rank 1 joins the all-reduce this late, when rank 0 already keeps the GIL


def last_owner_worker(rank, world_size):
    from pyreducer import _C

    group = dist.new_group()
    param = torch.nn.Parameter(torch.zeros(4))
    reducer = _C.Reducer([param], ["w"], [[0]], group, _C.ReducerOptions())
    dist.barrier()  # both ranks reach the all-reduce together
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # the main thread keeps the GIL while it does not block
    try:
        if rank == 1:
            time.sleep(LATE_S)
        group.allreduce([torch.ones(1)])  # the work alone holds the tensor: its worker frees it
        dist.destroy_process_group(group)
        del group  # the Reducer now holds the only reference to the group
        end = time.monotonic() + HOLD_GIL_S
        while time.monotonic() < end:  # the all-reduce finishes; its worker waits for the GIL
            pass
        started = time.monotonic()
        del reducer  # joins the group's worker threads: must not keep the GIL meanwhile
        let_go_s = time.monotonic() - started
    finally:
        sys.setswitchinterval(interval)
    return dict(let_go_s=let_go_s, param_grad=param.grad)


def test_a_reducer_holding_the_last_reference_to_its_group_lets_it_go():
    # a hang here is killed by the timeout and reported as a failure of this test
    results = run_ranks(last_owner_worker, 2, timeout_s=60)
    for rank, result in enumerate(results):
        assert result["let_go_s"] < 10.0, \
            f"rank {rank}: letting the Reducer go took {result['let_go_s']:.1f} s"
        assert result["param_grad"] is None  # nothing was reduced into the parameter
