"""The differential fuzzer's parts that need no ranks (pyreducer/testing/fuzz.py,
pyreducer/tools/fuzz.py): cases are pure functions of their seed and valid DDP configurations,
and the comparison names what differs."""
import copy

import torch

from pyreducer.testing import fuzz
from pyreducer.tools import fuzz as runner
from pyreducer.wrapper import torch_versions


def test_a_case_is_a_function_of_its_seed():
    assert fuzz.make_case(12345) == fuzz.make_case(12345)
    assert fuzz.make_case(12345) != fuzz.make_case(12346)
    assert runner.case_seeds(5, 7) == runner.case_seeds(5, 7) != runner.case_seeds(5, 8)


def test_cases_are_valid_ddp_configurations_and_cover_the_options():
    cases = [fuzz.make_case(seed) for seed in range(600)]
    for case in cases:
        ddp = case["ddp"]
        if case["unused"] != "none":  # a parameter that may go unused
            assert ddp["find_unused_parameters"], case
        if ddp.get("static_graph"):  # usage fixed, and no no_sync (torch DDP asserts there)
            assert case["unused"] in ("none", "never") and case["micro"] == 1, case
        assert ("bucket_cap_mb" in ddp) != ("bucket_cap_mb_list" in ddp)
        assert case["world_size"] in (2, 3)
        if case["overlap"] and case["overlap"]["schedule"] != "fifo":
            assert case["world_size"] == 2, case  # chunk sums are bitwise at 2 ranks only
    seen = lambda f: sum(1 for c in cases if f(c))  # noqa: E731
    if not torch_versions.DDP_HAS_BATCHED_GRAD_COPY:  # torch 2.11: no oracle, never drawn in
        assert seen(lambda c: "batched_grad_copy" in c["ddp"]) == 0
    optional = [("batched", seen(lambda c: c["ddp"]["batched_grad_copy"]))] \
        if torch_versions.DDP_HAS_BATCHED_GRAD_COPY else []
    for what, count in optional + [("static", seen(lambda c: c["ddp"].get("static_graph"))),
                        ("views", seen(lambda c: c["ddp"]["gradient_as_bucket_view"])),
                        ("cap lists", seen(lambda c: "bucket_cap_mb_list" in c["ddp"])),
                        ("fp16 hook", seen(lambda c: c["hook"] == "fp16")),
                        ("tied", seen(lambda c: c["tied"])),
                        ("no_sync", seen(lambda c: c["micro"] > 1)),
                        ("rank-dependent use", seen(lambda c: c["unused"] == "rank")),
                        ("float64", seen(lambda c: any(l["dtype"] == "float64"
                                                       for l in c["layers"]))),
                        ("frozen", seen(lambda c: any(l["frozen"] for l in c["layers"]))),
                        ("buffers", seen(lambda c: any(l["norm"] for l in c["layers"]))),
                        ("3 ranks", seen(lambda c: c["world_size"] == 3)),
                        ("overlapped", seen(lambda c: c["overlap"])),
                        ("overlapped, chunks", seen(lambda c: c["overlap"] and
                                                    c["overlap"]["schedule"] != "fifo"))]:
        assert count >= 20, f"{what}: only {count} of 600 cases"
    assert "seed 5:" in fuzz.describe(cases[5])


def test_the_model_builds_and_runs_for_any_case():
    for seed in range(40):
        case = fuzz.make_case(seed)
        model = fuzz.FuzzNet(case)
        out = model(torch.randn(fuzz.BATCH, case["inputs"]), step=1, rank=1)
        assert out.shape == (fuzz.BATCH, case["outputs"])


def test_compare_names_every_difference():
    a = {"w": torch.ones(3), "w.grad": torch.zeros(3), "b.grad": None}
    assert fuzz.compare(a, {k: (v.clone() if v is not None else None) for k, v in a.items()}) == []
    b = {"w": torch.ones(3) + 1e-7, "w.grad": None, "b.grad": None, "extra": torch.ones(1)}
    problems = fuzz.compare(a, b)
    assert len(problems) == 3, problems
    assert problems[0] == "extra: torch DDP missing, pyreducer a tensor"
    assert problems[1].startswith("w: differs (max |diff| 1.19")
    assert problems[2] == "w.grad: torch DDP a tensor, pyreducer None"
    assert fuzz.compare({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)})


def test_the_worst_rank_decides_a_case():
    per_rank = [{1: dict(status="ok", detail=[]), 2: dict(status="ok", detail=[])},
                {1: dict(status="mismatch", detail=["w"]), 2: dict(status="both refused",
                                                                   detail=["x"])}]
    merged = runner._merge(per_rank, [1, 2])
    assert merged[1] == dict(status="mismatch", detail=["w"], rank=1)
    assert merged[2]["status"] == "both refused"
    counts = runner.summary(merged)
    assert counts["mismatch"] == 1 and counts["both refused"] == 1 and counts["ok"] == 0


# The actions family (pyreducer/testing/fuzz_actions.py): user actions around the overlapped and
# sharded steps.


def test_an_actions_case_is_a_function_of_its_seed_and_covers_every_action():
    from pyreducer.testing import fuzz_actions

    assert fuzz_actions.make_case(99) == fuzz_actions.make_case(99) != fuzz_actions.make_case(98)
    cases = [fuzz_actions.make_case(seed) for seed in range(400)]
    drawn = {}
    for case in cases:
        assert case["world_size"] in (2, 3)
        if case["overlap"]["schedule"] != "fifo":  # chunk sums are bitwise at 2 ranks only
            assert case["world_size"] == 2 and not case["shard"], case
        for action in case["actions"]:
            assert action["position"] in fuzz_actions.ACTIONS[action["action"]], action
            assert not (case["shard"] and action["action"] == "grad_read"), case
            key = (case["shard"], action["position"], action["action"])
            drawn[key] = drawn.get(key, 0) + 1
    for action, positions in fuzz_actions.ACTIONS.items():
        for shard in (False, True):
            if shard and action == "grad_read":
                continue
            for position in positions:
                assert drawn.get((shard, position, action), 0) >= 5, (shard, position, action)
    seen = lambda f: sum(1 for c in cases if f(c))  # noqa: E731
    for what, count in (("sharded", seen(lambda c: c["shard"])),
                        ("3 ranks", seen(lambda c: c["world_size"] == 3)),
                        ("chunks", seen(lambda c: c["overlap"]["schedule"] != "fifo")),
                        ("max_grad_norm", seen(lambda c: c["overlap"]["max_grad_norm"])),
                        ("scheduler", seen(lambda c: c["scheduler"])),
                        ("no_sync", seen(lambda c: c["micro"] > 1)),
                        ("zeros", seen(lambda c: not c["set_to_none"])),
                        ("unused branch", seen(lambda c: c["unused"])),
                        ("bucket views", seen(lambda c: c["ddp"]["gradient_as_bucket_view"])),
                        ("buffers", seen(lambda c: any(l["norm"] for l in c["layers"]))),
                        ("float64", seen(lambda c: any(l["dtype"] == "float64"
                                                       for l in c["layers"])))):
        assert count >= 20, f"{what}: only {count} of 400 cases"
    assert "seed 5:" in fuzz_actions.describe(cases[5])


def test_actions_compare_names_what_differs():
    from pyreducer.testing import fuzz_actions

    same = dict(reads=[(0, "after_step", "data_read", [torch.ones(2)])], state={"w": None},
                ema=[torch.zeros(1)], final=torch.ones(1))
    assert fuzz_actions.compare(same, copy.deepcopy(same)) == []
    other = copy.deepcopy(same)
    other["reads"][0][3][0] += 1
    other["state"]["w"] = torch.ones(1)
    problems = fuzz_actions.compare(same, other)
    assert problems == ["step 0 after_step data_read[0]: differs (max |diff| 1.0, dtypes "
                        "torch.float32/torch.float32)",
                        "state.w: torch DDP NoneType, pyreducer Tensor"], problems
    assert fuzz_actions._refusal("RuntimeError: overlap_optimizer(shard=True): a forward ...")
    assert fuzz_actions._refusal("ValueError: pyreducer: ...")
    assert not fuzz_actions._refusal("AttributeError: 'NoneType' object has no attribute 'x'")
