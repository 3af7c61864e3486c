"""pytest plugin of tests/gpu/run_kit.py (loaded with `-p kit_plugin`).

- PYREDUCER_KIT_DEADLINE (seconds since the epoch): a test that would start after it is skipped
  with the reason instead, so the session ends in time with every test accounted for.
  With a deadline, the tests run in the order of their worth per second (priority()): what
  only a GPU can check first, the longest runs last.
- PYREDUCER_KIT_PLAN (a path; the rehearsal, with --collect-only): after collection, writes
  which tests would run and which would be skipped, and why, as JSON.
"""
import json
import os
import time

import pytest

NOT_REACHED = "not reached: the kit's time budget for tests ran out"


def pytest_runtest_setup(item):
    """After the skip marks (a test keeps its own reason), before the fixtures' setup."""
    deadline = os.environ.get("PYREDUCER_KIT_DEADLINE")
    if deadline is not None and time.time() > float(deadline):
        pytest.skip(NOT_REACHED)


# Within a file, by setting: ranks sharing the GPU over Gloo (2, then 3), then NCCL with one GPU
# per rank; the parity scenarios (two long runs, the same logic as on CPU) after the rest.
_SETTING_ORDER = {"gloo2": 0, "gloo3": 1, "nccl2": 2, "nccl3": 3}
_LONG_RUNS = ("test_matches_torch_ddp", "test_rebuilt_plans_are_the_same_on_every_rank")


def priority(item, index: int) -> tuple:
    """The sort key of a collected test: its file's place on the command line (kernels, then
    one rank, then several), its setting, the long parity runs last, then collection order."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    setting = params.get("setting")
    setting_rank = _SETTING_ORDER.get(f"{setting[0]}{setting[1]}", 9) if setting else -1
    return (setting_rank, item.originalname in _LONG_RUNS, index)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYREDUCER_KIT_DEADLINE") is None and not os.environ.get("PYREDUCER_KIT_PLAN"):
        return
    files = list(dict.fromkeys(item.path for item in items))  # command-line order
    keyed = sorted(enumerate(items),
                   key=lambda pair: (files.index(pair[1].path),) + priority(pair[1], pair[0]))
    items[:] = [item for _, item in keyed]


def pytest_collection_finish(session):
    path = os.environ.get("PYREDUCER_KIT_PLAN")
    if not path:
        return
    plan = {"run": [], "skip": {}}
    for item in session.items:
        reason = skip_reason(item)
        if reason is None:
            plan["run"].append(item.nodeid)
        else:
            plan["skip"].setdefault(reason, []).append(item.nodeid)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)


def skip_reason(item) -> str | None:
    """The reason of the first skip or true skipif mark on `item`, or None (the test would run;
    a skip decided inside a test's body is not seen here)."""
    for mark in item.iter_markers(name="skip"):
        return mark.kwargs.get("reason", mark.args[0] if mark.args else "skipped")
    for mark in item.iter_markers(name="skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
        if isinstance(condition, bool) and condition:
            return mark.kwargs.get("reason", "skipped")
    return None
