"""torch's own DDP tests with pyreducer swapped in (torch's second oracle).

    python -m pyreducer.testing.torch_suite --world-size 2 [--json results.json] [--torch-ddp]

torch ships its main distributed test module in the wheel
(torch/testing/_internal/distributed/distributed_test.py). This runs, on local Gloo ranks (forked,
as torch's MultiProcessTestCase does with its file store), every test of its
DistributedTest._DistTestBase whose code reaches DistributedDataParallel, with the name
`DistributedDataParallel` patched to pyreducer's where those tests look it up (the test module's
global and torch.nn.parallel's attribute; torch's class itself is left alone, and pyreducer keeps
a reference to it). Tests that need CUDA skip themselves, with torch's reason. --torch-ddp runs
the same selection with torch's own DDP, for comparison.

Prints one line per test (outcome, and the reason for a skip) and a summary; with --json, also
writes {test: {"outcome": ..., "detail": ...}}. Exit status 1 if any test failed or erred.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import tempfile
import time
import unittest


def _setup_environment(world_size: int) -> None:
    """What distributed_test reads at import (BACKEND, WORLD_SIZE, TEMP_DIR)."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="pyreducer_torch_suite_"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def ddp_tests(base) -> list[str]:
    """Names of the test methods of `base` whose code, or that of a helper method they call
    (transitively), names DistributedDataParallel."""
    methods = {name: getattr(base, name) for name in dir(base) if callable(getattr(base, name))}

    def source(name):
        try:
            return inspect.getsource(methods[name])
        except (OSError, TypeError):
            return ""

    def reaches(name, seen):
        if name in seen:
            return False
        seen.add(name)
        text = source(name)
        if "DistributedDataParallel" in text:
            return True
        return any(reaches(callee, seen) for callee in set(re.findall(r"self\.(_\w+)\(", text))
                   if callee in methods)

    return sorted(name for name in methods if name.startswith("test_") and reaches(name, set()))


class _Result(unittest.TestResult):
    """Outcome per test name: passed, failed, error or skipped, with the detail."""

    def __init__(self):
        super().__init__()
        self.outcomes: dict[str, dict] = {}

    def _note(self, test, outcome, detail=""):
        self.outcomes[test._testMethodName] = dict(outcome=outcome, detail=detail)
        reason = f"  ({detail})" if outcome == "skipped" else ""
        print(f"{outcome:8} {test._testMethodName}{reason}", flush=True)

    def addSuccess(self, test):
        self._note(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._note(test, "failed", self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._note(test, "error", self.errors[-1][1])

    def addSkip(self, test, reason):
        self._note(test, "skipped", reason)


def run(world_size: int, patch: bool, only=None) -> dict:
    """Runs the selection (or the tests named in `only`); returns the outcomes by test name."""
    _setup_environment(world_size)
    import torch
    import torch.distributed  # noqa: F401  (distributed_test needs it imported first)
    from torch.testing._internal.distributed import distributed_test as dt

    if patch:
        import pyreducer

        dt.DistributedDataParallel = pyreducer.DistributedDataParallel
        torch.nn.parallel.DistributedDataParallel = pyreducer.DistributedDataParallel

    class TestDDPWithFork(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    names = only or ddp_tests(dt.DistributedTest._DistTestBase)
    suite = unittest.TestSuite(TestDDPWithFork(name) for name in names)
    result = _Result()
    suite.run(result)
    return result.outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyreducer.testing.torch_suite",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, metavar="N",
                        help="Gloo ranks per test (forked processes); default 2")
    parser.add_argument("--json", metavar="FILE", help="also write the outcomes as JSON")
    parser.add_argument("--torch-ddp", action="store_true",
                        help="run torch's own DDP instead of pyreducer's (for comparison)")
    parser.add_argument("--only", nargs="*", metavar="TEST", help="run these tests only")
    args = parser.parse_args(argv)
    start = time.monotonic()
    print(f"torch's DDP tests with {'torch' if args.torch_ddp else 'pyreducer'}'s "
          f"DistributedDataParallel, {args.world_size} Gloo ranks", flush=True)
    outcomes = run(args.world_size, patch=not args.torch_ddp, only=args.only)
    counts = {kind: sum(o["outcome"] == kind for o in outcomes.values())
              for kind in ("passed", "failed", "error", "skipped")}
    print(", ".join(f"{n} {kind}" for kind, n in counts.items()) +
          f" of {len(outcomes)} in {time.monotonic() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(outcomes, f, indent=1)
    return 1 if counts["failed"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
