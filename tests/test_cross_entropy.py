"""The chunked linear + cross-entropy (kernels/cross_entropy.py) is the full loss without the logits.

On the CPU in fp32 (and fp16 for the Triton row kernel), loss and both gradients are within the
full loss's own error (materialised logits, then F.cross_entropy, in the same precision) of the
float64 loss (tests/helpers.py, assert_within_own_error), for token counts that are not a
multiple of the chunk, with ignored targets and z-loss, and under torch.compile. On the GPU in
bf16 autocast likewise.

    .venv/bin/python -m pytest tests/test_cross_entropy.py -q
"""

import pytest
import torch

from kernels.runtime import chips
from kernels.cross_entropy import _ROWS, IGNORE_INDEX, full_cross_entropy, linear_cross_entropy
from tests.helpers import assert_within_own_error


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


def _float64(fn, x, w):
    return _loss_and_grads(fn, x.detach().double().requires_grad_(), w.detach().double().requires_grad_())


def _assert_within_own_error(got, own, ref64, n_terms, dtype=torch.float32):
    for name, a, b, r in zip(("loss", "dx", "dw"), got, own, ref64, strict=True):
        assert_within_own_error(name, a, r, b, n_terms, dtype)


@pytest.mark.parametrize("N, chunk", [(100, 32), (64, 64), (7, 1000), (130, 1)])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_chunked_equals_full_in_fp32(N, chunk, z_loss):
    x, w, y = _inputs(N, 48, 523, seed=N + chunk)
    full = lambda x, w: full_cross_entropy(x @ w.T, y, z_loss=z_loss)  # noqa: E731
    chunked = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, chunk, z_loss=z_loss), x, w)
    # the longest sums: over the vocabulary (lse, dX) and over the tokens (dW)
    _assert_within_own_error(chunked, _loss_and_grads(full, x, w), _float64(full, x, w), max(523, N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_row_kernel_matches_pytorch(dtype):
    # the CUDA path's kernel, run here through Triton's interpreter on a small vocabulary that
    # spans several of its blocks (and one it does not fill), with ignored targets and z-loss;
    # fp16: the kernel rounds the gradient to fp16 in place, as PyTorch's path does
    x, w, y = _inputs(37, 16, 101, seed=7)
    x16, w16 = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    fn = lambda kernel: lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-3, kernel=kernel)  # noqa: E731
    kernel, torch_ = (_loss_and_grads(fn(k), x16, w16) for k in (True, False))
    _assert_within_own_error(kernel, torch_, _float64(fn(False), x16, w16), 101, dtype)


def test_the_row_kernel_has_a_config_to_launch_with():
    # what the CUDA path asks its launcher before the first launch (the CPU path never does)
    assert _ROWS.candidates({"GRAD": True}, 2, chips.H100)


def test_all_targets_ignored_gives_zero_loss_and_gradients():
    x, w, y = _inputs(20, 16, 50, ignored=1.0)
    loss, dx, dw = _loss_and_grads(lambda x, w: linear_cross_entropy(x, w, y, 8), x, w)
    assert loss.item() == 0 and not dx.any() and not dw.any()


def test_no_gradient_work_without_grad_and_under_compile():
    x, w, y = _inputs(50, 16, 97)
    loss = lambda x, w: linear_cross_entropy(x, w, y, 16, z_loss=1e-4)  # noqa: E731
    ref = _float64(loss, x, w)
    with torch.no_grad():
        assert_within_own_error("loss", linear_cross_entropy(x, w, y, 16, z_loss=1e-4), ref[0],
                                full_cross_entropy(x @ w.T, y, z_loss=1e-4), 97)
    eager = _loss_and_grads(loss, x, w)
    torch._dynamo.reset()
    compiled = _loss_and_grads(torch.compile(loss, backend="aot_eager"), x, w)
    _assert_within_own_error(compiled, eager, ref, 97)


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


def test_fp16_gradients_are_as_good_as_the_scaled_full_losss():
    # fp16 autocast (what dtype=auto picks on a GPU without bf16): the full loss's gradient is
    # scaled up by GradScaler before it meets fp16; the chunked loss makes its gradient in the
    # forward, before any scale, where (p - onehot) / n in fp16 loses every p below ~n * 6e-8
    # (a 2% bias in dW at n = 8k measured on an H100): it keeps that work in fp32 instead
    x, w, y = _inputs(8192, 16, 4096, seed=3, ignored=0.0)
    w = (0.1 * w).detach().requires_grad_()  # near-uniform p ~ 1 / V: p / n ~ 3e-8, below fp16's range
    scale = 2.0**16

    def full(x, w):
        with torch.autocast("cpu", dtype=torch.float16):
            return full_cross_entropy(x @ w.T, y) * scale

    def chunked(x, w):
        with torch.autocast("cpu", dtype=torch.float16):
            return linear_cross_entropy(x, w, y, 512, kernel=False) * scale

    ref64 = _float64(lambda x, w: full_cross_entropy(x @ w.T, y) * scale, x, w)
    own, got = _loss_and_grads(full, x, w), _loss_and_grads(chunked, x, w)
    for name, a, b, r in zip(("loss", "dx", "dw"), got, own, ref64, strict=True):
        assert_within_own_error(name, a, r, b, 8192, torch.float16)
