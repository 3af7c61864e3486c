"""pytest plugin of tests/gpu/run_kit.py (loaded with `-p kit_plugin`).

- PYREDUCER_KIT_DEADLINE (seconds since the epoch): a test that would start after it is skipped
  with the reason instead, so the session ends in time with every test accounted for.
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
