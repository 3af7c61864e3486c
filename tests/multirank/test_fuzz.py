"""The CI slice of the differential fuzzer (`python -m pyreducer fuzz`; `make fuzz` runs 500
cases): random models and DDP options trained with torch DDP and pyreducer on spawned Gloo
ranks, equal bit for bit. A failure prints its seed: `python -m pyreducer fuzz --replay SEED`."""
from pyreducer.tools import fuzz

CASES = 40
SEED = 2024


def test_forty_random_cases_match_torch_ddp():
    lines = []
    results = fuzz.run(fuzz.case_seeds(CASES, SEED), batch=10, log=lines.append)
    failing = {seed: o for seed, o in results.items() if o["status"] in fuzz.FAILING}
    assert not failing, "\n".join(line for line in lines if line.startswith("FAIL"))
    counts = fuzz.summary(results)
    assert sum(counts.values()) == CASES and counts["ok"] >= CASES - 4, counts
