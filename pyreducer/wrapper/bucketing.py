"""Bucket plans: which parameters share a bucket, in which order buckets are launched.

A bucket is one flat buffer that is all-reduced as a whole; a slot is one parameter's slice of
it. The planner itself is C++ (csrc/bucketing.cpp); this module turns torch parameters and DDP's
cap arguments into its inputs.
"""
from __future__ import annotations

import json
import os

from pyreducer._ext import _C
from pyreducer.wrapper import gloo_race

MIB = 1024 * 1024
DEFAULT_FIRST_BUCKET_CAP_BYTES = _C.DEFAULT_FIRST_BUCKET_CAP_BYTES  # 1 MiB
DEFAULT_BUCKET_CAP_BYTES = _C.DEFAULT_BUCKET_CAP_BYTES  # 25 MiB
ONE_BUCKET_CAP_BYTES = 2**62  # a cap nothing reaches


def caps_bytes(bucket_cap_mb: float | None, bucket_cap_mb_list: list[float] | None) -> list[int]:
    """The per-bucket caps in bytes, as torch DDP derives them from its arguments.

    Default (both None): first bucket 1 MiB, the rest 25 MiB. An explicit bucket_cap_mb applies
    to every bucket, the first included. bucket_cap_mb_list gives the i-th bucket's cap, and its
    last entry to all later buckets.
    """
    if bucket_cap_mb_list:
        caps = [int(cap_mb * MIB) for cap_mb in bucket_cap_mb_list]
    elif bucket_cap_mb is None:
        caps = [DEFAULT_FIRST_BUCKET_CAP_BYTES, DEFAULT_BUCKET_CAP_BYTES]
    else:
        caps = [int(bucket_cap_mb * MIB)]
    for cap in caps:
        if cap <= 0:
            raise ValueError(f"bucket caps must be positive, got {cap} bytes "
                             f"(bucket_cap_mb={bucket_cap_mb}, bucket_cap_mb_list={bucket_cap_mb_list})")
    return caps


def assign_buckets(sizes_bytes: list[int], group_keys: list[str], caps: list[int],
                   walk_order: list[int] | None = None,
                   sparse: list[bool] | None = None) -> list[list[int]]:
    """Bucket parameter indices, in launch order (the C++ planner, csrc/bucketing.h).

    Args:
        sizes_bytes, group_keys: per parameter, in definition order (see ReducedParams).
        caps: per-bucket caps in bytes (see caps_bytes).
        walk_order: the order gradients are expected to become ready; default reverse
            definition order.
        sparse: per parameter, whether it produces sparse gradients (a bucket of its own).
    """
    if walk_order is None:
        walk_order = _C.reverse_order(len(sizes_bytes))
    plan = _C.assign_buckets(list(sizes_bytes), list(group_keys), list(walk_order), list(caps),
                             list(sparse) if sparse else [])
    return [bucket["param_indices"] for bucket in plan]


def initial_plan(sizes_bytes: list[int], group_keys: list[str], caps: list[int],
                 one_bucket: bool, sparse: list[bool] | None = None) -> list[list[int]]:
    """torch DDP's plan for the first iteration, reproduced exactly (so results match bit for bit).

    DDP walks parameters in definition order, closes buckets at the caps (a sparse parameter in
    a bucket of its own), orders the buckets by the smallest parameter index they hold, and
    launches them in reverse (the last layers' gradients are ready first). Without
    find_unused_parameters it uses one bucket for everything in the first iteration and rebuilds
    from the observed ready order afterwards (see Note [Bucket rebuild] in csrc/reducer.h).
    """
    walk = list(range(len(sizes_bytes)))
    caps = [ONE_BUCKET_CAP_BYTES] if one_bucket else caps
    buckets = sorted(assign_buckets(sizes_bytes, group_keys, caps, walk, sparse), key=min)
    return list(reversed(buckets))


def read_plan(plan, names: list[str]) -> tuple[list[list[int]] | None, str | None]:
    """(plan_from_names(plan, names), None), or (None, why it cannot be used): a file that
    cannot be read or is not a saved plan, or a plan that does not fit this model."""
    try:
        return plan_from_names(plan, names), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"{type(error).__name__}: {error}"


def plan_from_names(plan, names: list[str]) -> list[list[int]]:
    """Parameter indices per bucket from a saved plan.

    Args:
        plan: a path to a JSON file written by DistributedDataParallel.save_bucket_plan, the
            list returned by bucket_plan(), or a list of lists of parameter names.
        names: the reduced parameters' names, in parameter order.
    Raises ValueError naming the parameter when the plan does not cover every reduced parameter
    exactly once.
    """
    if isinstance(plan, (str, os.PathLike)):
        plan = _load_plan_file(plan)
    if not isinstance(plan, (list, tuple)):
        raise TypeError(f"bucket plan: expected a list of buckets, got {type(plan).__name__}")
    buckets = [b["params"] if isinstance(b, dict) else list(b) for b in plan]
    for b, bucket in enumerate(buckets):
        if isinstance(bucket, str) or not all(isinstance(n, str) for n in bucket):
            raise TypeError(f"bucket plan: bucket {b} must list parameter names, got "
                            f"{bucket!r:.80}")
    index = {name: i for i, name in enumerate(names)}
    seen: dict[str, int] = {}
    result = []
    for b, bucket in enumerate(buckets):
        if not bucket:
            raise ValueError(f"bucket plan: bucket {b} is empty")
        for name in bucket:
            if name not in index:
                raise ValueError(f"bucket plan: bucket {b} names {name!r}, which is not a reduced "
                                 f"parameter of this model (expected names like {names[0]!r})")
            if name in seen:
                raise ValueError(f"bucket plan: {name!r} is in bucket {seen[name]} and bucket {b}")
            seen[name] = b
        result.append([index[name] for name in bucket])
    missing = [name for name in names if name not in seen]
    if missing:
        raise ValueError(f"bucket plan: {len(missing)} reduced parameter(s) are in no bucket: "
                         f"{missing[:10]}")
    return result


def _load_plan_file(path) -> list:
    """The buckets of a file written by save_plan; ValueError saying what is wrong with it."""
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"bucket plan file {os.fspath(path)!r} is not valid JSON ({error}; "
                         f"{len(text)} bytes: truncated?)") from None
    if not isinstance(doc, dict) or doc.get("format") != "pyreducer.bucket_plan":
        raise ValueError(f"bucket plan file {os.fspath(path)!r} is not a pyreducer bucket plan "
                         f"(expected {{\"format\": \"pyreducer.bucket_plan\", ...}} as "
                         f"save_bucket_plan writes)")
    if doc.get("version") != 1 or not isinstance(doc.get("buckets"), list):
        raise ValueError(f"bucket plan file {os.fspath(path)!r}: version {doc.get('version')!r} "
                         f"with {type(doc.get('buckets')).__name__} buckets; this pyreducer "
                         f"reads version 1 with a list of buckets")
    return doc["buckets"]


def describe_plan(names, tensors, layout: list[dict]) -> list[dict]:
    """Per bucket of a Reducer's bucket_layout(): index, parameter names (slot order), dtype,
    device, bytes."""
    plan = []
    for index, bucket in enumerate(layout):
        first = tensors[bucket["param_indices"][0]]
        plan.append(dict(index=index, params=[names[k] for k in bucket["param_indices"]],
                         dtype=str(first.dtype), device=str(first.device),
                         size_bytes=bucket["size_bytes"]))
    return plan


def save_plan(plan: list[dict], path) -> None:
    """Writes a plan (as returned by bucket_plan()) as JSON."""
    with open(path, "w") as f:
        json.dump({"format": "pyreducer.bucket_plan", "version": 1, "buckets": plan}, f, indent=1)


def build_reducer(params, process_group, caps_bytes: list[int], plan, caps_per_bucket: bool,
                  **flags):
    """The C++ Reducer with torch DDP's schedule: with a static graph or without
    unused-parameter search, one bucket for the first iteration, then a rebuild along the
    observed ready order; a given plan (parameter indices per bucket) is replayed as is.
    params: a ReducedParams; flags: ReducerOptions fields (csrc/reducer.h), set as given."""
    options = _C.ReducerOptions()
    for name, value in flags.items():
        setattr(options, name, value)
    options.sparse_params = [i for i, sparse in enumerate(params.sparse) if sparse]
    options.rebuild_buckets = ((options.static_graph or not options.find_unused_parameters)
                               and plan is None)
    options.rebuild_caps_bytes = caps_bytes
    if plan is None:
        plan = initial_plan(params.sizes_bytes, params.group_keys, caps_bytes,
                            one_bucket=options.rebuild_buckets and not caps_per_bucket,
                            sparse=params.sparse)
    reducer = _C.Reducer(list(params.tensors), list(params.names), plan, process_group, options)
    gloo_race.guard_sparse(reducer, params, process_group)  # (collective the first time per group)
    return reducer
