"""Two and three ranks against torch DDP in the same setting (gpu_kit.py: Gloo ranks sharing the
GPU, which a one-GPU machine runs; NCCL with one GPU per rank, where that many are visible):
bitwise parity on the parity scenarios (3 ranks: the CUDA copy's rounding, Note [Rounding of
the scaled copy]), the rebuilt plans, join() with the fp16 hook, strides checked across ranks,
device-timed communication and the link probe, the streams of a bucket, mixed precision, the
averaging hook, the overlapped optimizer's deferred waits and side-stream fences, check_finite;
and a script that never calls set_device (NCCL, 2 GPUs). Compiled, not run here: no GPU."""
import pytest
import torch

from gpu_kit import MULTI, NCCL_TWO, TWO_RANKS, needs_gpus, ranks
from gpu_workers import (averaging_worker, big_bucket_worker, check_finite_worker,
                         ddp_logging_worker, join_fp16_worker, link_probe_worker,
                         mixed_precision_worker, no_set_device_worker, strides_worker,
                         two_streams_worker)
from overlap_workers import (OVERLAP_CASES, overlap_cases_worker, sharded_clip_costs_worker,
                             sharded_worker, side_streams_worker)
from pyreducer.testing.parity import SCENARIOS, oracle_missing, parity_worker

# NCCL has no sparse all-reduce (test_gpu_one_rank.py: refused at construction); Gloo has one
# for CUDA tensors. Bit for bit where the arithmetic is torch DDP's exactly; static graphs (whose
# first iteration reduces in parameter order) within 1e-6, as on CPU.
SCENARIO_NAMES = list(SCENARIOS)
ON_NCCL = [name for name, s in SCENARIOS.items() if s["model"] != "sparse"]
BITWISE = [name for name in SCENARIOS if not SCENARIOS[name].get("ddp", {}).get("static_graph")]


def _parity(setting):
    names = tuple(SCENARIO_NAMES if setting[0] == "gloo" else ON_NCCL)
    return ranks(parity_worker, setting, (names, "cuda"))


def _equal_lists(ours, theirs, what):
    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"{what}: tensor {i} differs"


@pytest.mark.parametrize("setting", MULTI)
@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_matches_torch_ddp(setting, name):
    if setting[0] == "nccl" and name not in ON_NCCL:
        pytest.skip("NCCL has no sparse all-reduce")
    if oracle_missing(name):
        pytest.skip(oracle_missing(name))
    for rank, result in enumerate(_parity(setting)):
        theirs, ours = result[name]["torch"], result[name]["ours"]
        assert ours.keys() == theirs.keys()
        for key in theirs:
            if theirs[key] is None or ours[key] is None:
                assert ours[key] is None and theirs[key] is None, f"rank {rank}: {key}"
            elif name in BITWISE:
                assert torch.equal(ours[key], theirs[key]), f"rank {rank}: {key} not bitwise"
            else:
                diff = (ours[key].double() - theirs[key].double()).abs().max().item()
                assert diff <= 1e-6, f"rank {rank}: {key} differs by {diff:.3g}"


@pytest.mark.parametrize("setting", MULTI)
def test_rebuilt_plans_are_the_same_on_every_rank(setting):
    """The rebuild's broadcast ran on the GPU (NCCL has no CPU tensors): every rank got rank
    0's order, so every rank has the same buckets."""
    results = _parity(setting)
    for name in results[0]:
        plans = [result[name]["buckets"] for result in results]
        assert all(plan == plans[0] for plan in plans), name


@pytest.mark.parametrize("setting", MULTI)
def test_join_with_fp16_hook_matches_torch_ddp(setting):
    for rank, result in enumerate(ranks(join_fp16_worker, setting)):
        _equal_lists(result["ours"], result["torch"], f"rank {rank}")


@needs_gpus(2)
def test_without_set_device_every_rank_uses_its_parameters_gpu():
    results = ranks(no_set_device_worker, ("nccl", 2), set_device=False)
    for rank, result in enumerate(results):
        _equal_lists(result["grads"], results[0]["grads"], f"rank {rank}")
        assert result["gathered"] == (rank == 0)
        assert result["log"][-1]["event"] == "chosen"


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_strides_are_checked_across_ranks(setting):
    for error in ranks(strides_worker, setting):
        assert error is not None and "channels_last" in error and "rank 1" in error


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_communication_is_timed_on_the_device(setting):
    """A 64 MiB all-reduce cannot take less than 64 MiB / 1 TB/s: host times on NCCL (the future
    completes at enqueue) would give about 0."""
    for result in ranks(big_bucket_worker, setting):
        for record, stats in zip(result["timeline"], result["stats"]["iterations"]):
            assert record["clock"] == "device"
            assert stats["comm_ms"][-1] >= 64 * 2**20 / 1e12 * 1e3, stats["comm_ms"]


@pytest.mark.parametrize("setting", NCCL_TWO)
def test_ddp_logging_times_communication_on_the_device(setting):
    """pyreducer/wrapper/ddp_logging.py: on NCCL, _get_ddp_logging_data()'s backward durations
    are the device timeline's (as torch's logger takes them from CUDA events): communication
    from the bucket's launch to the gradient written back, at least 64 MiB / 1 TB/s. Before,
    they were host enqueue times (NCCL completes the work at enqueue), not the record's. The
    profiler's range marks the launch and says so; the NCCL kernel is on the CUDA timeline."""
    for rank, result in enumerate(ranks(ddp_logging_worker, setting)):
        data = result["data"]
        record = next(r for r in result["timeline"] if r["iteration"] == data["iteration"])
        assert record["clock"] == "device", record["clock"]
        launch = min(b["launch_ns"] for b in record["buckets"] if b["launch_ns"])
        assert data["backward_comm_time"] == record["finalize_end_ns"] - launch, (data, record)
        assert data["backward_compute_time"] == \
            record["backward_end_ns"] - record["backward_start_ns"], (data, record)
        assert data["backward_comm_time"] >= 64 * 2**20 / 1e12 * 1e9, data["backward_comm_time"]
        assert result["ranges"] == ["pyreducer.allreduce.bucket_0.launch"], result["ranges"]
        assert result["nccl_kernels"], f"rank {rank}: no NCCL kernel on the CUDA timeline"


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_link_probe_finds_the_measured_bandwidth(setting):
    """The autotune's link probe (device-synchronized) against a plain all-reduce bus-bandwidth
    measurement on the same ranks: between 0.3x and 1.2x of it."""
    result = ranks(link_probe_worker, setting)[0]
    link = result["log"][0]
    probed_gbps = link["bandwidth_gbit"] / 8
    assert 0.3 * result["busbw_gbps"] <= probed_gbps <= 1.2 * result["busbw_gbps"], \
        (probed_gbps, result["busbw_gbps"])


@pytest.mark.parametrize("setting", MULTI)
def test_buckets_wait_for_the_streams_their_gradients_were_copied_on(setting):
    """Note [Streams of a bucket]: half the gradients of one bucket are copied on a side stream;
    the reduced gradients equal those of the same model on one stream."""
    for rank, result in enumerate(ranks(two_streams_worker, setting)):
        for step, (two, one) in enumerate(zip(result["two_streams"], result["one_stream"])):
            _equal_lists(two, one, f"rank {rank}, step {step}")


@pytest.mark.parametrize("setting", MULTI)
def test_mixed_precision_matches_torch_ddp(setting):
    """On CUDA torch's own mixed precision runs: pyreducer's must give its gradients and
    parameters bit for bit (float16, and bfloat16 reduced in float32)."""
    for rank, result in enumerate(ranks(mixed_precision_worker, setting)):
        for name in ("fp16", "bf16_reduce_fp32"):
            ours, theirs = result[(name, "ours")], result[(name, "torch")]
            for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
                _equal_lists(a, b, f"{name} rank {rank} step {step}")
            _equal_lists(ours["params"], theirs["params"], f"{name} rank {rank} parameters")


@pytest.mark.parametrize("setting", MULTI)
def test_predivide_and_reduce_dtype_on_cuda(setting):
    for rank, result in enumerate(ranks(averaging_worker, setting)):
        _equal_lists(result["ours"], result["expected"], f"rank {rank}")


@pytest.mark.parametrize("setting", MULTI)
@pytest.mark.parametrize("schedule, variant", OVERLAP_CASES,
                         ids=[f"{s}-{v}" for s, v in OVERLAP_CASES])
def test_overlapped_optimizer_matches_torch_ddp(setting, schedule, variant):
    """Deferred completion and chunked launches, with one rank lagging (its reductions still run
    when the others queue their updates): parameters (and BatchNorm buffers) after 10 Adam steps
    equal torch DDP's, bit for bit (chunks at 3 ranks: a chunk may be summed in another order,
    1e-6)."""
    world_size = setting[1]
    for rank, results in enumerate(ranks(overlap_cases_worker, setting)):
        result = results[(schedule, variant)]
        if schedule != "fifo":
            assert max(result["chunks"]) > 1, f"rank {rank}: the schedule was not chunked"
        for ours, theirs in zip(result["ours"], result["torch"]):
            if schedule == "fifo" or world_size == 2:
                assert torch.equal(ours, theirs), f"rank {rank}"
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def _side_streams(setting, case):
    return [result[case] for result in ranks(side_streams_worker, setting)]


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_a_bucket_updated_on_a_side_stream_is_waited_for_on_the_main_one(setting):
    """Note [Streams] in pyreducer/overlap/optimizer.py."""
    for rank, result in enumerate(_side_streams(setting, "two_stream_forward")):
        assert result["buckets"] == 1, result["buckets"]
        _equal_lists(result["ours"], result["torch"], f"rank {rank}")


@pytest.mark.parametrize("setting", NCCL_TWO)
def test_a_sharded_steps_write_on_the_main_stream_waits_for_the_gather(setting):
    """Note [Streams of a sharded step] in pyreducer/sharded/optimizer.py: the two-stream forward
    with shard=True; the update and the all-gather are launched on the side stream (after its
    ~20 ms sleep), `a` is written from the gathered buffer on the main stream, which must wait
    for the gather itself (a wait on NCCL orders only the current stream). Bit for bit at 2
    ranks (a reduce-scatter of two sums each element as the all-reduce does)."""
    for rank, result in enumerate(_side_streams(setting, "two_stream_forward_sharded")):
        assert result["buckets"] == 1, result["buckets"]
        _equal_lists(result["ours"], result["torch"], f"rank {rank}")


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_a_bucket_completed_by_a_read_before_step_is_waited_for_by_step(setting):
    """Note [Streams] in pyreducer/overlap/optimizer.py: a gradient read on a side stream before
    step() (the bucket's averages written there), the tensor read then on the main stream too;
    step() on the main stream."""
    for rank, result in enumerate(_side_streams(setting, "early_read")):
        assert result["buckets"] == 1, result["buckets"]
        _equal_lists(result["ours_reads"], result["torch_reads"],
                     f"rank {rank}: gradient norms read on the two streams")
        _equal_lists(result["ours"], result["torch"], f"rank {rank}")


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_a_completion_no_read_asked_for_on_a_side_stream_is_waited_for_by_step(setting):
    """Note [Streams] in pyreducer/overlap/optimizer.py (Fences.settle): the module's state_dict()
    on a side stream before step() completes every bucket there; the gradient is read and step()
    runs on the main stream."""
    for rank, result in enumerate(_side_streams(setting, "unread_completion")):
        _equal_lists(result["ours_reads"], result["torch_reads"],
                     f"rank {rank}: gradient norms read on the main stream")
        _equal_lists(result["ours"], result["torch"], f"rank {rank}")


@pytest.mark.parametrize("setting", TWO_RANKS)
def test_check_finite_names_parameter_and_rank(setting):
    for rank, errors in enumerate(ranks(check_finite_worker, setting)):
        assert errors[0] is None and errors[2] is None, errors
        assert "parameter(s) 2.weight (NaN)" in errors[1] and "from rank(s) 1 " in errors[1]
        assert f"seen on rank {rank} of 2" in errors[1]


@pytest.mark.parametrize("setting", MULTI)
def test_sharded_optimizer_matches_torch_ddp_or_is_refused_on_gloo(setting):
    """overlap_optimizer(shard=True): on NCCL, parameters and gathered AdamW state after 6 clipped
    steps equal torch DDP's (bit for bit at 2 ranks, 1e-6 at 3); on Gloo sharing the GPU,
    refused by name (Gloo's reduce-scatter takes CPU tensors only)."""
    for rank, result in enumerate(ranks(sharded_worker, setting)):
        if setting[0] == "gloo":
            assert "Gloo" in (result["refused"] or ""), f"rank {rank}: {result}"
            continue
        for ours, theirs in zip(result["ours"], result["torch"]):
            if setting[1] == 2:
                assert torch.equal(ours, theirs), f"rank {rank}"
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("setting", NCCL_TWO)
def test_a_sharded_clip_launches_kernels_per_dtype_not_per_parameter_and_never_syncs(setting):
    """Note [Clipping shards] in pyreducer/sharded/clip.py: one clip_grad_norm_ of 66 parameters
    launches the kernels one of 18 launches (foreach kernels per dtype; one copy more where this
    rank lays out a cut parameter in one model and not in the other), with no host sync; nor
    does a step with max_grad_norm (clip, update, gathers) sync the host. Before: a few kernels
    per parameter and a device-to-host copy of the gradient flags in every clip."""
    for rank, result in enumerate(ranks(sharded_clip_costs_worker, setting)):
        small, large = result[8], result[32]
        assert (small["params"], large["params"]) == (18, 66), (small["params"], large["params"])
        for layers, costs in result.items():
            assert costs["sync_error"] is None, f"rank {rank}, {layers}: {costs['sync_error']}"
            assert costs["step_sync_error"] is None, \
                f"rank {rank}, {layers}: {costs['step_sync_error']}"
        extra = int(large["lays_out"]) - int(small["lays_out"])
        assert large["kernels"] == small["kernels"] + extra, \
            f"rank {rank}: {small['names']} vs {large['names']}"
