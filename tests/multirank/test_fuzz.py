"""The CI slices of the differential fuzzers (`python -m pyreducer fuzz`; `make fuzz` runs 500
cases of each): random models and DDP options trained with torch DDP and pyreducer on spawned
Gloo ranks, equal bit for bit; and random user actions around the overlapped and sharded steps
(evaluation forwards, state_dict()s, checkpoints, clips, reads, ...) done the same way with torch
DDP + the plain optimizer, every value read and the end state equal bit for bit. A failure
prints its seed: `python -m pyreducer fuzz [--actions] --replay SEED`."""
from pyreducer.tools import fuzz

CASES = 40
SEED = 2024
ACTION_CASES = 200  # about 100 s on 2 cores (0.5 s a case)


def test_forty_random_cases_match_torch_ddp():
    lines = []
    results = fuzz.run(fuzz.case_seeds(CASES, SEED), batch=10, log=lines.append)
    failing = {seed: o for seed, o in results.items() if o["status"] in fuzz.FAILING}
    assert not failing, "\n".join(line for line in lines if line.startswith("FAIL"))
    counts = fuzz.summary(results)
    assert sum(counts.values()) == CASES and counts["ok"] >= CASES - 4, counts


def test_user_actions_around_the_overlapped_and_sharded_steps_match_torch_ddp():
    lines = []
    results = fuzz.run(fuzz.case_seeds(ACTION_CASES, SEED), batch=25, log=lines.append,
                       family="actions")
    failing = {seed: o for seed, o in results.items() if o["status"] in fuzz.FAILING}
    assert not failing, "\n".join(line for line in lines if line.startswith("FAIL"))
    counts = fuzz.summary(results)
    # every case compared: a refusal (a pyreducer error naming the problem) is allowed, but the
    # actions are drawn where they are valid, so none is expected
    assert sum(counts.values()) == ACTION_CASES and counts["ok"] == ACTION_CASES, counts
