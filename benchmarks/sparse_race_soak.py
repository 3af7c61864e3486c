"""The sparse parity scenarios on 3 Gloo ranks, many times: pyreducer's runs must neither crash
(torch's Gloo race, pyreducer/wrapper/gloo_race.py) nor differ from torch DDP's result by one bit.

torch DDP's sparse all-reduces are exposed to the race themselves, so its result is computed
once, in runs of its own (repeated if one crashes; their crashes are counted apart), and every
pyreducer run (the sparse scenarios of pyreducer/testing/parity.py, torch DDP not in the process)
is compared with it. A run is the scenarios once, each with fresh wrappers; --per-spawn runs
share one spawn of the ranks (importing torch on 3 ranks costs more than the runs). A spawn that
dies by a signal (the race's double free aborts) counts as a crash; each spawn prints a progress
line.

    python benchmarks/sparse_race_soak.py --runs 300 --per-spawn 10 --json soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pyreducer.testing import RankError, run_ranks  # noqa: E402
from pyreducer.testing.parity import SCENARIOS, oracle_missing  # noqa: E402

# (those the installed torch DDP can be an oracle for: torch 2.11's has no batched_grad_copy)
NAMES = tuple(name for name in SCENARIOS
              if SCENARIOS[name]["model"] == "sparse" and not oracle_missing(name))


def soak_worker(rank, world_size, names, which, runs=1):
    """The scenarios `names` trained with torch's DDP (which="torch") or pyreducer's, `runs`
    times over; the last run's states (every run's must equal them: checked here)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyreducer import DistributedDataParallel
    from pyreducer.testing import parity

    from pyreducer.wrapper import gloo_race

    cls = TorchDDP if which == "torch" else DistributedDataParallel
    out, first = {}, None
    for run in range(runs):
        for name in names:
            scenario = SCENARIOS[name]
            torch.manual_seed(17 + rank)  # as parity_worker
            base = parity._model_fns(scenario["model"])[0]()
            out[name], _ = parity.train(cls, base, scenario, rank)
        first = first or dict(out)
        out["runs_equal_to_the_first"] = run == 0 or all(same(out[n], first[n]) for n in names)
        if not out["runs_equal_to_the_first"]:
            break
    # pyreducer's sparse buckets went to one-thread backends, one per wrapper (none is made for
    # torch DDP)
    out["one_thread_backends"] = sum(gloo_race._made.values())
    return out


def crashed(error: RankError) -> bool:
    """Whether a rank died by a signal or reported heap corruption (not an ordinary error)."""
    text = str(error)
    return any(word in text for word in ("signal", "SIG", "double free", "corrupted",
                                         "free(): invalid", "exit code -", "exited with -"))


def run(names, which, ranks, runs=1) -> tuple[dict | None, str | None]:
    try:
        return run_ranks(soak_worker, ranks, (names, which, runs), timeout_s=120 + 30 * runs), None
    except RankError as error:
        return None, str(error)[-600:]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and
                                           torch.equal(a[k], b[k])) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--per-spawn", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.time()
    torch_crashes, reference = [], None
    while reference is None:
        reference, error = run(NAMES, "torch", args.ranks)
        if error is not None:
            torch_crashes.append(error)
            print(f"torch DDP's reference run failed ({len(torch_crashes)}): {error[-200:]}",
                  flush=True)
            if len(torch_crashes) >= 5:
                raise SystemExit("torch DDP's reference failed 5 times")
    crashes, errors, mismatches, done = [], [], [], 0
    spawns = -(-args.runs // args.per_spawn)
    for k in range(1, spawns + 1):
        runs = min(args.per_spawn, args.runs - done)
        results, error = run(NAMES, "ours", args.ranks, runs)
        if error is not None:
            (crashes if crashed(RankError(error)) else errors).append(dict(spawn=k, error=error))
        else:
            for rank, (mine, theirs) in enumerate(zip(results, reference)):
                if mine["one_thread_backends"] != runs * len(NAMES):
                    raise SystemExit(f"spawn {k}: pyreducer's guard was not in force on rank "
                                     f"{rank} ({mine['one_thread_backends']} backends)")
                if not mine["runs_equal_to_the_first"]:
                    mismatches.append(dict(spawn=k, rank=rank, scenario="a later run"))
                for name in NAMES:
                    if not same(mine[name], theirs[name]):
                        mismatches.append(dict(spawn=k, rank=rank, scenario=name))
        done += runs
        print(f"spawn {k}/{spawns} ({done} runs): crashed spawns {len(crashes)}, other failures "
              f"{len(errors)}, mismatches {len(mismatches)} ({time.time() - start:.0f} s)",
              flush=True)
    summary = dict(runs=args.runs, per_spawn=args.per_spawn, ranks=args.ranks,
                   scenarios=list(NAMES),
                   torch=torch.__version__, crashes=crashes, other_failures=errors,
                   mismatches=mismatches, torch_reference_failures=torch_crashes,
                   seconds=time.time() - start,
                   date=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"{args.runs} runs of {list(NAMES)} on {args.ranks} ranks: {len(crashes)} crashed "
          f"spawns (of {spawns}), "
          f"{len(errors)} other failures, {len(mismatches)} results differing from torch DDP's")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if crashes or errors or mismatches else 0)


if __name__ == "__main__":
    main()
