"""Bucket assignment (the C++ planner through pyreducer._C), table-driven, and checked against
torch's own planner (torch.distributed._compute_bucket_assignment_by_size, used here only as a
reference)."""
import random

import pytest
import torch
import torch.distributed as dist

from pyreducer._ext import _C
from pyreducer.wrapper import bucketing

MIB = 1024 * 1024

# (name, sizes in bytes, group keys, walk order or None for reverse, caps, expected buckets)
CASES = [
    ("all fit in one", [100, 200, 300], None, None, [MIB], [[2, 1, 0]]),
    ("reverse walk, close at cap", [40] * 4, None, None, [80], [[3, 2], [1, 0]]),
    ("close at >= cap", [50] * 3, None, None, [100], [[2, 1], [0]]),
    ("first cap, then the rest", [10] * 6, None, None, [10, 30], [[5], [4, 3, 2], [1, 0]]),
    ("oversized parameter alone", [10, 500, 10], None, None, [100], [[2, 1], [0]]),
    ("ready order", [10] * 4, None, [1, 3, 0, 2], [20], [[1, 3], [0, 2]]),
    ("dtype groups", [100] * 4, ["f32", "f64", "f32", "f64"], None, [MIB], [[3, 1], [2, 0]]),
    ("groups by completion", [10] * 4, ["a", "a", "b", "a"], None, [20], [[2], [3, 1], [0]]),
    ("no parameters", [], [], None, [10], []),
]


@pytest.mark.parametrize("name,sizes,keys,order,caps,expected", CASES, ids=[c[0] for c in CASES])
def test_assign_buckets_table(name, sizes, keys, order, caps, expected):
    keys = keys if keys is not None else ["f32"] * len(sizes)
    order = order if order is not None else _C.reverse_order(len(sizes))
    plan = _C.assign_buckets(sizes, keys, order, caps)
    assert [b["param_indices"] for b in plan] == expected
    assert [b["size_bytes"] for b in plan] == [sum(sizes[i] for i in b) for b in expected]


@pytest.mark.parametrize("sizes,keys,order,caps,words", [
    ([10, 10], ["a", "a"], [0], [10], "walk order of 2"),
    ([10, 10], ["a", "a"], [0, 0], [10], "twice"),
    ([10, 10], ["a", "a"], [1, 0], [], "at least one bucket cap"),
    ([10, 10], ["a", "a"], [1, 0], [-5], "positive"),
    ([10, 10], ["a"], [1, 0], [10], "one group key per size"),
])
def test_assign_buckets_rejects_bad_input(sizes, keys, order, caps, words):
    with pytest.raises(ValueError, match=words):
        _C.assign_buckets(sizes, keys, order, caps)


@pytest.mark.parametrize("cap_mb,cap_list,expected", [
    (None, None, [MIB, 25 * MIB]),
    (4, None, [4 * MIB]),
    (0.5, None, [MIB // 2]),
    (None, [1, 2, 8], [MIB, 2 * MIB, 8 * MIB]),
])
def test_caps_follow_ddp_arguments(cap_mb, cap_list, expected):
    assert bucketing.caps_bytes(cap_mb, cap_list) == expected


@pytest.mark.parametrize("seed", range(20))
def test_same_plan_as_torch_planner(seed):
    """Random sizes, dtypes and caps: identical buckets to torch's planner given the same order."""
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float64] if seed % 2 else [torch.float32]
    params = [torch.empty(rng.randint(1, 5000), dtype=rng.choice(dtypes)) for _ in range(40)]
    caps = [rng.choice([1000, 4000, 20000]), rng.choice([8000, 50000])]
    order = list(range(len(params)))
    rng.shuffle(order)
    ours = bucketing.assign_buckets([p.nbytes for p in params],
                                    [_C.group_key(p) for p in params], caps, walk_order=order)
    theirs, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], caps, [False] * len(params), order)
    if len(dtypes) == 1:  # one group: identical order too
        assert ours == [list(b) for b in theirs]
    else:  # several groups: torch appends leftovers per group; pyreducer orders by completion
        assert sorted(ours) == sorted(list(b) for b in theirs)


def test_initial_plan_is_ddps():
    params = [torch.empty(n) for n in (300, 10, 300, 10, 300)]
    sizes, keys = [p.nbytes for p in params], [_C.group_key(p) for p in params]
    assert bucketing.initial_plan(sizes, keys, [1200, 2400], one_bucket=True) == [[0, 1, 2, 3, 4]]
    theirs, _ = dist._compute_bucket_assignment_by_size(params, [1200, 2400], [False] * 5)
    assert bucketing.initial_plan(sizes, keys, [1200, 2400], one_bucket=False) == \
        [list(b) for b in reversed(theirs)]


def test_group_key_is_one_definition():
    """The C++ group key (csrc/bucket.h) is the one Python uses: dtype and device, nothing else."""
    a, b = torch.zeros(3), torch.zeros(5, 2)
    assert _C.group_key(a) == _C.group_key(b) == "Float/cpu"
    assert _C.group_key(a.double()) != _C.group_key(a)
    keys = pyreducer_params_keys([a, b, a.double()])
    assert keys == [_C.group_key(a), _C.group_key(b), _C.group_key(a.double())]


def pyreducer_params_keys(tensors):
    from pyreducer.wrapper.params import ReducedParams

    return list(ReducedParams.of([(f"p{i}", t) for i, t in enumerate(tensors)]).group_keys)
