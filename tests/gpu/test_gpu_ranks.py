"""World sizes 2 and 3 on NCCL, one GPU per rank (skipped where fewer GPUs are visible): bitwise
parity with torch DDP on the parity scenarios (3 ranks: the CUDA copy's rounding, Note [Rounding
of the scaled copy]), join() with the fp16 hook, a script that never calls set_device, strides
checked across ranks, device-timed communication, and the link probe against the measured bus
bandwidth."""
import pytest
import torch

from gpu_kit import nccl_ranks, needs_gpus
from gpu_workers import (allreduce_busbw_gbps, averaging_worker, big_bucket_worker,
                         check_finite_worker, join_fp16_worker, mixed_precision_worker,
                         no_set_device_worker, sparse_on_nccl_worker, strides_worker,
                         two_streams_worker)
from overlap_workers import (early_read_worker, overlap_worker, two_stream_forward_worker,
                             unread_completion_worker)
from pyreducer.testing.parity import SCENARIOS, parity_worker

# The parity scenarios on NCCL: all but the sparse ones (NCCL has no sparse all-reduce; see
# test_sparse_gradients_are_refused_on_nccl), skipped unused buckets and the delayed all-reduce
# included. Bit for bit where the arithmetic is torch DDP's exactly; static graphs (whose first
# iteration reduces in parameter order) within 1e-6, as on CPU.
ON_NCCL = [name for name, s in SCENARIOS.items() if s["model"] != "sparse"]
BITWISE = [name for name in ON_NCCL if not SCENARIOS[name].get("ddp", {}).get("static_graph")]
WORLD_SIZES = [pytest.param(n, marks=needs_gpus(n), id=f"{n}gpus") for n in (2, 3)]


def _parity(world_size):
    return nccl_ranks(_cuda_parity_worker, world_size)


def _cuda_parity_worker(rank, world_size):
    return parity_worker(rank, world_size, tuple(ON_NCCL), "cuda")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ON_NCCL)
def test_matches_torch_ddp(world_size, name):
    for rank, result in enumerate(_parity(world_size)):
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


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rebuilt_plans_are_the_same_on_every_rank(world_size):
    """The rebuild's broadcast ran on the GPU (NCCL has no CPU tensors): every rank got rank
    0's order, so every rank has the same buckets."""
    results = _parity(world_size)
    for name in ON_NCCL:
        plans = [result[name]["buckets"] for result in results]
        assert all(plan == plans[0] for plan in plans), name


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_join_with_fp16_hook_matches_torch_ddp(world_size):
    for rank, result in enumerate(nccl_ranks(join_fp16_worker, world_size)):
        for a, b in zip(result["ours"], result["torch"]):
            assert torch.equal(a, b), f"rank {rank}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_without_set_device_every_rank_uses_its_parameters_gpu(world_size):
    results = nccl_ranks(no_set_device_worker, world_size, set_device=False)
    for rank, result in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(result["grads"], results[0]["grads"]))
        assert result["gathered"] == (rank == 0)
        assert result["log"][-1]["event"] == "chosen"


@needs_gpus(2)
def test_sparse_gradients_are_refused_on_nccl():
    """torch DDP fails in the middle of backward (ProcessGroupNCCL has no sparse all-reduce);
    pyreducer refuses at construction, with torch's words."""
    for error in nccl_ranks(sparse_on_nccl_worker, 2):
        assert error is not None and "NCCL does not support all_reduce with sparse" in error
        assert "embed.weight" in error


@needs_gpus(2)
def test_strides_are_checked_across_ranks():
    for error in nccl_ranks(strides_worker, 2):
        assert error is not None and "channels_last" in error and "rank 1" in error


@needs_gpus(2)
def test_communication_is_timed_on_the_device():
    """A 64 MiB all-reduce cannot take less than 64 MiB / 1 TB/s: host times on NCCL (the future
    completes at enqueue) would give about 0."""
    for result in nccl_ranks(big_bucket_worker, 2):
        for record, stats in zip(result["timeline"], result["stats"]["iterations"]):
            assert record["clock"] == "device"
            assert stats["comm_ms"][-1] >= 64 * 2**20 / 1e12 * 1e3, stats["comm_ms"]


@needs_gpus(2)
def test_link_probe_finds_the_measured_bandwidth():
    """The autotune's link probe (device-synchronized) against a plain NCCL bus-bandwidth
    measurement on the same GPUs: between 0.3x and 1.2x of it."""
    busbw = nccl_ranks(allreduce_busbw_gbps, 2)[0]
    results = nccl_ranks(no_set_device_worker, 2, set_device=False)
    link = results[0]["log"][0]
    probed_gbps = link["bandwidth_gbit"] / 8
    assert 0.3 * busbw <= probed_gbps <= 1.2 * busbw, (probed_gbps, busbw)


@needs_gpus(2)
def test_buckets_wait_for_the_streams_their_gradients_were_copied_on():
    """Note [Streams of a bucket]: half the gradients of one bucket are copied on a side stream;
    the reduced gradients equal those of the same model on one stream."""
    for rank, result in enumerate(nccl_ranks(two_streams_worker, 2)):
        for step, (two, one) in enumerate(zip(result["two_streams"], result["one_stream"])):
            for a, b in zip(two, one):
                assert torch.equal(a, b), f"rank {rank}, step {step}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_mixed_precision_matches_torch_ddp(world_size):
    """On CUDA torch's own mixed precision runs: pyreducer's must give its gradients and
    parameters bit for bit (float16, and bfloat16 reduced in float32)."""
    for rank, result in enumerate(nccl_ranks(mixed_precision_worker, world_size)):
        for name in ("fp16", "bf16_reduce_fp32"):
            ours, theirs = result[(name, "ours")], result[(name, "torch")]
            for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name} rank {rank} {step}"
            assert all(torch.equal(x, y) for x, y in zip(ours["params"], theirs["params"]))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_predivide_and_reduce_dtype_on_cuda(world_size):
    for rank, result in enumerate(nccl_ranks(averaging_worker, world_size)):
        for a, b in zip(result["ours"], result["expected"]):
            assert torch.equal(a, b), f"rank {rank}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("schedule", ["fifo", 0.0625])
@pytest.mark.parametrize("variant", ["plain", "bn", "bucket_view", "stream"])
def test_overlapped_optimizer_matches_torch_ddp(world_size, schedule, variant):
    """Deferred completion and chunked launches on NCCL, with one rank lagging (its reductions
    still run when the others queue their updates): parameters (and BatchNorm buffers) after 10
    Adam steps equal torch DDP's, bit for bit (chunks at 3 ranks: NCCL may sum a chunk in
    another order, 1e-6). Compiled, not run here: no GPU."""
    for rank, result in enumerate(nccl_ranks(overlap_worker, world_size, (schedule, variant))):
        if schedule != "fifo":
            assert max(result["chunks"]) > 1, f"rank {rank}: the schedule was not chunked"
        for ours, theirs in zip(result["ours"], result["torch"]):
            if schedule == "fifo" or world_size == 2:
                assert torch.equal(ours, theirs), f"rank {rank}"
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@needs_gpus(2)
def test_a_bucket_updated_on_a_side_stream_is_waited_for_on_the_main_one():
    """Note [Streams] in pyreducer/overlap.py. Compiled, not run here: no GPU."""
    for rank, result in enumerate(nccl_ranks(two_stream_forward_worker, 2)):
        assert result["buckets"] == 1, result["buckets"]
        for ours, theirs in zip(result["ours"], result["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}"


@needs_gpus(2)
def test_a_bucket_completed_by_a_read_before_step_is_waited_for_by_step():
    """Note [Streams] in pyreducer/overlap.py: a gradient read on a side stream before step()
    (the bucket's averages written there), the tensor read then on the main stream too;
    step() on the main stream. Compiled, not run here: no GPU."""
    for rank, result in enumerate(nccl_ranks(early_read_worker, 2)):
        assert result["buckets"] == 1, result["buckets"]
        for ours, theirs in zip(result["ours_reads"], result["torch_reads"]):
            assert torch.equal(ours, theirs), f"rank {rank}: the side stream read {ours}, " \
                f"torch DDP's side stream {theirs}"
        for ours, theirs in zip(result["ours"], result["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}"


@needs_gpus(2)
def test_a_completion_no_read_asked_for_on_a_side_stream_is_waited_for_by_step():
    """Note [Streams] in pyreducer/overlap.py (Fences.settle): the module's state_dict() on a
    side stream before step() completes every bucket there; the gradient is read and step()
    runs on the main stream. Compiled, not run here: no GPU."""
    for rank, result in enumerate(nccl_ranks(unread_completion_worker, 2)):
        for ours, theirs in zip(result["ours_reads"], result["torch_reads"]):
            assert torch.equal(ours, theirs), f"rank {rank}: the main stream read {ours}, " \
                f"torch DDP's {theirs}"
        for ours, theirs in zip(result["ours"], result["torch"]):
            assert torch.equal(ours, theirs), f"rank {rank}"


@needs_gpus(2)
def test_check_finite_names_parameter_and_rank_on_nccl():
    for rank, errors in enumerate(nccl_ranks(check_finite_worker, 2)):
        assert errors[0] is None and errors[2] is None, errors
        assert "parameter(s) 2.weight (NaN)" in errors[1] and "from rank(s) 1 " in errors[1]
        assert f"seen on rank {rank} of 2" in errors[1]
