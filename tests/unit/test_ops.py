"""The stateless kernels registered as torch ops (torch.ops.pyreducer.*) against plain-torch
references on random inputs: many shapes and dtypes, odd sizes, non-contiguous and
channels-last gradients; plus torch.library.opcheck. CUDA variants run only where a GPU is."""
import pytest
import torch

import pyreducer  # noqa: F401  (registers torch.ops.pyreducer)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (16, 3, 3, 3), (1001,), (4, 1, 2)]


def _grads(shapes, dtype, device, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for shape in shapes:
        if layout == "channels_last" and len(shape) == 4:
            g = torch.randn(shape, generator=gen).to(dtype).to(memory_format=torch.channels_last)
        elif layout == "transposed" and len(shape) >= 2:
            g = torch.randn(shape[::-1], generator=gen).to(dtype).transpose(0, -1)
        elif layout == "sliced":
            g = torch.randn((shape[0] * 2,) + shape[1:], generator=gen).to(dtype)[::2]
        else:
            g = torch.randn(shape, generator=gen).to(dtype)
        grads.append(g.to(device))
    return grads


def _offsets(grads, gap=3):
    offsets, at = [], gap
    for g in grads:
        offsets.append(at)
        at += g.numel() + gap  # gaps: elements outside slots must stay untouched
    return offsets, at


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "sliced"])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
def test_bucket_copy_in_matches_reference(device, dtype, layout, divisor):
    grads = _grads(SHAPES, dtype, device, layout)
    offsets, total = _offsets(grads)
    flat = torch.full((total,), 7.0, dtype=dtype, device=device)
    expected = flat.clone()
    for g, o in zip(grads, offsets):
        expected[o:o + g.numel()] = (g / divisor).reshape(-1)  # the same rounding as DDP's div_
    torch.ops.pyreducer.bucket_copy_in(flat, grads, offsets, divisor)
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "sliced"])
def test_bucket_copy_out_matches_reference(device, dtype, layout):
    grads = _grads(SHAPES, dtype, device, layout, seed=1)
    offsets, total = _offsets(grads)
    flat = torch.randn(total, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    torch.ops.pyreducer.bucket_copy_out(flat, grads, offsets)
    for g, o in zip(grads, offsets):
        assert torch.equal(g, flat[o:o + g.numel()].view(g.shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 17, 4096, 100_003])
def test_cast_scaled_matches_reference(device, src_dtype, dtype, numel):
    src = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 50).to(src_dtype)
    src = src.to(device)
    out = torch.ops.pyreducer.cast_scaled(src, dtype, 4.0)
    assert out.dtype == dtype and out.shape == (numel,)
    assert torch.equal(out, (src / 4.0).to(dtype))


def test_cast_scaled_divides_before_the_cast():
    """Large float32 values that would overflow float16 if cast first stay finite."""
    src = torch.full((8,), 1.0e5)
    out = torch.ops.pyreducer.cast_scaled(src, torch.float16, 4.0)
    assert torch.isfinite(out).all() and torch.equal(out, torch.full((8,), 25000.0).half())
    assert not torch.isfinite(src.half()).all()


@pytest.mark.parametrize("bad,words", [
    (dict(offsets=[0]), "one offset per gradient"),
    (dict(offsets=[0, 95]), "does not fit"),
    (dict(dtype=torch.float64), "gradient 0 is Float on cpu, expected Double"),
])
def test_bucket_copy_in_rejects_bad_input(bad, words):
    grads = [torch.randn(3, 4), torch.randn(10)]
    flat = torch.zeros(100, dtype=bad.get("dtype", torch.float32))
    with pytest.raises(RuntimeError, match=words):
        torch.ops.pyreducer.bucket_copy_in(flat, grads, bad.get("offsets", [0, 20]), 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    grads = _grads([(3, 4), (5,), (2, 3, 2, 2)], torch.float32, device, "channels_last")
    offsets, total = _offsets(grads)
    flat = torch.zeros(total, device=device)
    torch.library.opcheck(torch.ops.pyreducer.bucket_copy_in.default,
                          (flat, grads, offsets, 2.0))
    torch.library.opcheck(torch.ops.pyreducer.bucket_copy_out.default, (flat, grads, offsets))
    torch.library.opcheck(torch.ops.pyreducer.cast_scaled.default,
                          (torch.randn(33, device=device), torch.float16, 2.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without a GPU")
def test_cuda_variants_skipped_without_gpu():
    """Records, in the test report, that the CUDA kernels were compiled at most, not run."""
    pytest.skip("no GPU on this machine: CUDA kernels are compiled (make cuda-check), not run")
