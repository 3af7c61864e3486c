"""The CUDA kernels against ATen on the same GPU, bit for bit: the fused copy-in rounds as ATen's
`g / divisor` on CUDA (a reciprocal multiply, Note [Rounding of the scaled copy]) for divisors 2,
3 and 7 in every dtype and layout; copy-out; the scaled cast of the built-in hooks; a grid sized
by total work (one large gradient among many small ones, empty ones)."""
import pytest
import torch

from gpu_kit import needs_gpus

pytestmark = needs_gpus(1)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "transposed", "channels_last", "sliced"]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (16, 3, 3, 3), (1001,), (4, 1, 2), (0,), (3_000_001,)]


def _grads(dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for shape in SHAPES:
        g = torch.randn(shape, generator=gen) * 100
        if layout == "channels_last" and len(shape) == 4:
            g = g.to(memory_format=torch.channels_last)
        elif layout == "transposed" and len(shape) >= 2:
            g = torch.randn(shape[::-1], generator=gen).transpose(0, -1) * 100
        elif layout == "sliced" and shape[0] > 0:
            g = (torch.randn((shape[0] * 2,) + shape[1:], generator=gen) * 100)[::2]
        grads.append(g.to(dtype).cuda())
    offsets, at = [], 5
    for g in grads:
        offsets.append(at)
        at += g.numel() + 5  # gaps must stay untouched
    return grads, offsets, at


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("divisor", [2.0, 3.0, 7.0])
def test_copy_in_is_atens_division_bit_for_bit(dtype, layout, divisor):
    grads, offsets, total = _grads(dtype, layout)
    flat = torch.full((total,), 7.0, dtype=dtype, device="cuda")
    expected = flat.clone()
    for g, o in zip(grads, offsets):
        expected[o:o + g.numel()] = (g / divisor).reshape(-1)  # ATen on CUDA: as torch DDP's div_
    torch.ops.pyreducer.bucket_copy_in(flat, grads, offsets, divisor)
    torch.cuda.synchronize()
    assert torch.equal(flat, expected)
    if divisor == 3.0 and dtype == torch.float32:  # the check can fail: true division differs
        true_division = torch.cat([(g.double() / divisor).float().reshape(-1) for g in grads])
        ours = torch.cat([flat[o:o + g.numel()] for g, o in zip(grads, offsets)])
        assert not torch.equal(ours, true_division)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_out_bit_for_bit(dtype, layout):
    grads, offsets, total = _grads(dtype, layout, seed=1)
    flat = (torch.randn(total, generator=torch.Generator().manual_seed(2)) * 100).to(dtype).cuda()
    torch.ops.pyreducer.bucket_copy_out(flat, grads, offsets)
    torch.cuda.synchronize()
    for g, o in zip(grads, offsets):
        assert torch.equal(g, flat[o:o + g.numel()].view(g.shape))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("divisor", [2.0, 3.0, 7.0])
def test_cast_scaled_is_atens_division_then_cast(src_dtype, dtype, divisor):
    src = (torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 50).to(src_dtype)
    src = src.cuda()
    out = torch.ops.pyreducer.cast_scaled(src, dtype, divisor)
    assert torch.equal(out, (src / divisor).to(dtype))


def test_copy_in_on_a_side_stream_is_ordered_by_that_stream():
    """The kernels run on the current stream: launched under a side stream, a read on that
    stream sees the result without a device-wide synchronize."""
    grads, offsets, total = _grads(torch.float32, "contiguous")
    flat = torch.zeros(total, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the zero fill above is on the default stream
    with torch.cuda.stream(side):
        torch.ops.pyreducer.bucket_copy_in(flat, grads, offsets, 3.0)
        copied = flat[offsets[-1]:offsets[-1] + grads[-1].numel()].clone()
    side.synchronize()
    assert torch.equal(copied, grads[-1] / 3.0)
