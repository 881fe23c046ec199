"""The chunked linear + cross-entropy (kernels/cross_entropy.py) is the full loss without the logits.

On the CPU in fp32, loss and both gradients equal the full loss (materialised logits, then
F.cross_entropy) to 1e-6 relative, for token counts that are not a multiple of the chunk, with
ignored targets and z-loss, and under torch.compile. On the GPU in bf16 autocast, its error against
float64 is within twice the full loss's own error in the same precision.

    .venv/bin/python -m pytest tests/test_cross_entropy.py -q
"""

import pytest
import torch

from kernels.cross_entropy import _ROWS, IGNORE_INDEX, full_cross_entropy, linear_cross_entropy


def _inputs(N, d, V, device="cpu", seed=0, ignored=0.1):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(N, d, generator=gen, device=device, requires_grad=True)
    w = (0.5 * torch.randn(V, d, generator=gen, device=device)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=gen, device=device)
    y[torch.rand(N, generator=gen, device=device) < ignored] = IGNORE_INDEX
    return x, w, y


def _loss_and_grads(fn, x, w):
    loss = fn(x, w)
    return (loss, *torch.autograd.grad(loss, (x, w)))


def _rel(a, b):
    """||a - b|| / ||b||: the relative error of the whole tensor (one element of a sum over a few
    hundred fp32 terms can differ by more than 1e-6 of the largest when the order of the sum does)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("N, chunk", [(100, 32), (64, 64), (7, 1000), (130, 1)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_chunked_equals_full_in_fp32(N, chunk, z_loss):
    x, w, y = _inputs(N, 48, 523, seed=N + chunk)
    full = _loss_and_grads(lambda x, w: full_cross_entropy(x @ w.T, y, z_loss=z_loss), x, w)
    chunked = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, chunk, z_loss=z_loss), x, w)
    for name, a, b in zip(("loss", "dx", "dw"), chunked, full, strict=True):
        assert torch.isfinite(a).all() and _rel(a, b) <= 1e-6, (name, _rel(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_row_kernel_matches_pytorch(dtype):
    # the CUDA path's kernel, run here through Triton's interpreter on a small vocabulary that
    # spans several of its blocks (and one it does not fill), with ignored targets and z-loss
    x, w, y = _inputs(37, 16, 101, seed=7)
    x16, w16 = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    kernel = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-3, kernel=True), x16, w16)
    torch_ = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-3, kernel=False), x16, w16)
    for name, a, b in zip(("loss", "dx", "dw"), kernel, torch_, strict=True):
        tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp16: the kernel rounds the gradient to fp16 in place
        assert torch.isfinite(a).all() and _rel(a, b) <= tol, (name, _rel(a, b))


def test_the_row_kernel_has_a_config_to_launch_with():
    # what the CUDA path asks its launcher before the first launch (the CPU path never does)
    assert _ROWS.candidates({"GRAD": True}, 2)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    x, w, y = _inputs(20, 16, 50, ignored=1.0)
    loss, dx, dw = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 8), x, w)
    assert loss.item() == 0 and not dx.any() and not dw.any()


def test_no_gradient_work_without_grad_and_under_compile():
    x, w, y = _inputs(50, 16, 97)
    with torch.no_grad():
        assert _rel(linear_cross_entropy(x, w, y, 16), full_cross_entropy(x @ w.T, y)) <= 1e-6
    eager = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-4), x, w)
    torch._dynamo.reset()
    compiled_fn = torch.compile(lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-4), backend="aot_eager")
    compiled = _loss_and_grads(compiled_fn, x, w)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


def test_a_bad_chunk_is_refused():
    x, w, y = _inputs(4, 8, 10)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        linear_cross_entropy(x, w, y, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [8192, 5000])
def test_gpu_bf16_error_is_within_the_full_losss_own(N):
    x, w, y = _inputs(N, 768, 50304, device="cuda", seed=N)
    ref = _loss_and_grads(lambda x, w: full_cross_entropy(x.double() @ w.double().T, y), x, w)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        full = _loss_and_grads(lambda x, w: full_cross_entropy(x @ w.T, y), x, w)
        chunked = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 4096), x, w)
    for name, got, own, want in zip(("loss", "dx", "dw"), chunked, full, ref, strict=True):
        own_err = (own.double() - want).abs().max().item()
        err = (got.double() - want).abs().max().item()
        assert torch.isfinite(got).all() and err <= 2 * own_err + 1e-6 * want.abs().max().item(), (name, err, own_err)
