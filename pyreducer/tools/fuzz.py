"""`python -m pyreducer fuzz`: differential fuzzing against torch DDP, of random models and DDP
options (pyreducer/testing/fuzz.py) or, with --actions, of user actions around the overlapped and
sharded steps (pyreducer/testing/fuzz_actions.py).

Cases of one world size run in batches on one set of spawned Gloo ranks (spawning costs more
than a case); a batch that fails as a whole (a rank raised where the other waited in a
collective, or a timeout) is run again case by case, so the failing case is named. Every
failing case prints its seed and a one-line reproduction.
"""
from __future__ import annotations

import importlib
import json
import random
import time

# worse to the right; FAILING fail the run ("refused": a pyreducer error naming the problem)
ORDER = ("ok", "both refused", "torch DDP failed", "refused", "refused by one", "mismatch",
         "error")
FAILING = ORDER[4:]
# family -> the module with its make_case, describe and batch_worker
FAMILIES = {"models": "pyreducer.testing.fuzz", "actions": "pyreducer.testing.fuzz_actions"}


def family_module(family: str):
    """The module of fuzzing family `family` (FAMILIES)."""
    return importlib.import_module(FAMILIES[family])


def case_seeds(count: int, seed: int) -> list[int]:
    """The seeds of `count` cases drawn from run seed `seed` (the same on every machine)."""
    rng = random.Random(seed)
    return [rng.randrange(2**31) for _ in range(count)]


def _merge(per_rank: list[dict], seeds: list[int]) -> dict:
    """Per seed, the worst outcome over the ranks, with the rank that saw it."""
    merged = {}
    for seed in seeds:
        worst = max(((rank, r[seed]) for rank, r in enumerate(per_rank)),
                    key=lambda item: ORDER.index(item[1]["status"]))
        merged[seed] = dict(worst[1], rank=worst[0])
    return merged


def _run_batch(seeds: list[int], world_size: int, family: str) -> dict:
    from pyreducer.testing import RankError, RankTimeout, run_ranks

    try:
        per_rank = run_ranks(family_module(family).batch_worker, world_size, (seeds,),
                             timeout_s=60 + 20 * len(seeds), pg_timeout_s=30,
                             env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
        return _merge(per_rank, seeds)
    except (RankError, RankTimeout) as error:
        if len(seeds) > 1:
            result = {}
            for seed in seeds:
                result.update(_run_batch([seed], world_size, family))
            return result
        return {seeds[0]: dict(status="error", detail=[str(error)[-600:]], rank=None)}


def _print(line: str) -> None:
    print(line, flush=True)


def run(seeds: list[int], batch: int = 10, log=_print, family: str = "models") -> dict:
    """Runs the cases of `family`; returns {seed: outcome} and logs progress and every
    failure."""
    describe, make_case = family_module(family).describe, family_module(family).make_case
    replay = "--replay" if family == "models" else f"--{family} --replay"
    by_size: dict[int, list[int]] = {}
    for seed in seeds:
        by_size.setdefault(make_case(seed)["world_size"], []).append(seed)
    results, start, done = {}, time.monotonic(), 0
    for world_size, group in sorted(by_size.items()):
        for k in range(0, len(group), batch):
            chunk = group[k:k + batch]
            outcome = _run_batch(chunk, world_size, family)
            results.update(outcome)
            done += len(chunk)
            for seed in chunk:
                if outcome[seed]["status"] in FAILING:
                    log(f"FAIL {outcome[seed]['status']} (rank {outcome[seed]['rank']}): "
                        f"{describe(make_case(seed))}\n     {outcome[seed]['detail'][:1]}\n"
                        f"     reproduce: python -m pyreducer fuzz {replay} {seed}")
            failing = sum(1 for o in results.values() if o["status"] in FAILING)
            log(f"fuzz: {done}/{len(seeds)} cases, {failing} failing "
                f"({time.monotonic() - start:.0f} s)")
    return results


def summary(results: dict) -> dict:
    counts = {status: 0 for status in ORDER}
    for outcome in results.values():
        counts[outcome["status"]] += 1
    return counts


def main(cases: int, seed: int, replay: int | None, batch: int, json_path: str | None,
         log=_print, family: str = "models") -> int:
    describe, make_case = family_module(family).describe, family_module(family).make_case
    if replay is not None:
        log(describe(make_case(replay)))
        results = run([replay], batch=1, log=log, family=family)
        log(f"{results[replay]['status']}: " + "\n  ".join(results[replay]["detail"] or ["-"]))
    else:
        log(f"pyreducer fuzz: {cases} {family} cases from seed {seed}, against torch DDP")
        results = run(case_seeds(cases, seed), batch=batch, log=log, family=family)
    counts = summary(results)
    log("fuzz: " + ", ".join(f"{n} {status}" for status, n in counts.items() if n))
    if json_path:
        with open(json_path, "w") as f:
            outcomes = {str(s): dict(o, case=make_case(s)) for s, o in results.items()}
            json.dump(dict(family=family, cases=cases, seed=seed, counts=counts,
                           results=outcomes), f, indent=1)
        log(f"wrote {json_path}")
    return 1 if any(counts[status] for status in FAILING) else 0
