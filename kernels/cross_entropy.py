"""Linear layer + cross-entropy without the (tokens x vocab) logits: tokens in chunks, fp32 log-sum-exp.

loss = mean over the targets != ignore_index of lse_i - z_i[y_i] + z_loss * lse_i^2, where z = x W^T
and lse_i = log sum_v exp z_iv. The forward walks the tokens `chunk` at a time; a chunk's logits
(chunk x V) exist only while it is processed. When a gradient is wanted, the forward also computes
it there, dz = (softmax(z) (1 + 2 z_loss lse) - onehot(y)) / n, over the logits in place, turns it
into dX for the chunk and adds dW in fp32; the backward then only scales both by the incoming
gradient, so no logits are recomputed (Liger's fused linear cross-entropy does the same; the count
n stays on the device, so nothing syncs). On CUDA one Triton program per row does the softmax,
loss and gradient in two passes over the row; elsewhere PyTorch does the same (_chunk_eager, the
specification). Matmuls run in the autocast dtype when autocast is on, as the model's own head
would; the softmax and all sums are fp32. Extra memory: one chunk's logits, dX, dW in fp32 (V x d).
fp16 logits are the exception: computed here before any loss scale, p / n (n ~ 10^4 tokens) falls
below fp16's range, so their gradient and its two matmuls stay in fp32 (slower, twice the chunk).
"""

import contextlib

import torch
import triton
import triton.language as tl

from kernels.runtime.launch import Launcher, on_device

IGNORE_INDEX = -100


@triton.jit
def _loss_and_grad_rows(
    LOGITS, stride_row,  # (rows, V) logits of one chunk; replaced by their gradient when GRAD
    TARGETS, LOSS, N_VALID,  # (rows,) int64 targets; (rows,) fp32 loss out; the count of valid targets
    V, ignore_index, z_loss,
    GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row: lse by an online max and sum over V in fp32; the row's loss; with GRAD,
    (softmax (1 + 2 z_loss lse) - onehot(y)) / n written over the logits in their dtype."""
    row = tl.program_id(0)
    ptr = LOGITS + row.to(tl.int64) * stride_row
    y = tl.load(TARGETS + row)
    valid = y != ignore_index
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(total)
    z_y = tl.load(ptr + tl.where(valid & (y >= 0) & (y < V), y, 0)).to(tl.float32)  # never read out of the row
    tl.store(LOSS + row, tl.where(valid, lse - z_y + z_loss * lse * lse, 0.0))
    if GRAD:
        scale = tl.where(valid, 1.0 / tl.load(N_VALID).to(tl.float32), 0.0)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - tl.where(cols == y, 1.0, 0.0)
            tl.store(ptr + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=cols < V)


def _chunk_eager(logits, yc, vc, n, z_loss, grad):
    """The row kernel's work in PyTorch (the CPU path, and its specification): (loss sum, gradient)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    y_safe = yc.where(vc, 0)[:, None]  # ignored rows read column 0, then count for nothing
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    loss = (lse - logits.gather(1, y_safe).squeeze(1) + z_loss * lse.square()).where(vc, 0.0).sum()
    if not grad:
        return loss, None
    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
    if z_loss:
        g.mul_(1 + 2 * z_loss * lse[:, None])
    g.scatter_add_(1, y_safe, torch.full_like(y_safe, -1, dtype=g.dtype))
    return loss, g.mul_((vc.to(g.dtype) / n)[:, None])  # the mean over valid targets; ignored rows get 0


# one config, so never benchmarked (the kernel overwrites its input); small blocks in the CPU interpreter
_ROWS = Launcher(_loss_and_grad_rows, [triton.Config({"BLOCK_V": 4096}, num_warps=8)], triton.Config({"BLOCK_V": 32}))


def _chunk_kernel(logits, yc, n, ignore_index, z_loss, grad):
    """The Triton row kernel over the chunk's logits (c, V), in place: (loss sum, gradient)."""
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    with on_device(logits):
        _ROWS(lambda c: (logits.shape[0],), (logits, logits.stride(0), yc, loss, n, logits.shape[1], ignore_index,
                                             z_loss), ("rows",), GRAD=grad)
    return loss.sum(), (logits if grad else None)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, chunk, ignore_index, z_loss, use_kernel, want_dx, want_dw):
        # x (N, d), weight (V, d), targets (N,)
        valid = targets != ignore_index
        n = valid.sum().clamp(min=1)  # a tensor: no host sync
        acc = torch.promote_types(x.dtype, torch.float32)  # sums: fp32 (float64 for float64, on the CPU path)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_dw else None
        loss = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, x.shape[0], chunk):
            xc, yc = x[start:start + chunk], targets[start:start + chunk]
            logits = xc @ weight.T  # (c, V), in the autocast dtype if autocast is on
            precise = logits.dtype == torch.float16  # see the module docstring
            if precise:
                logits = logits.float()
            if use_kernel:
                loss_c, grad = _chunk_kernel(logits, yc, n, ignore_index, z_loss, want_dx or want_dw)
            else:
                loss_c, grad = _chunk_eager(logits, yc, valid[start:start + chunk], n, z_loss, want_dx or want_dw)
            loss += loss_c
            if grad is not None:
                grad = grad.to(logits.dtype)
                w_c, x_c = (weight.float(), xc.float()) if precise else (weight, xc)
                with torch.autocast(x.device.type, enabled=False) if precise else contextlib.nullcontext():
                    if want_dx:
                        dx[start:start + chunk] = grad @ w_c
                    if want_dw:
                        dw += grad.T @ x_c
        ctx.save_for_backward(dx, dw)
        ctx.weight_dtype = weight.dtype
        return (loss / n).to(acc)

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        return (None if dx is None else dx * grad_loss.to(dx.dtype),
                None if dw is None else (dw * grad_loss).to(ctx.weight_dtype), *[None] * 7)


# eager even in a compiled model: traced by torch.compile on torch 2.11, the gradients this Function
# saves in its forward came back as zeros (dX and dW; H100 test run); one graph break at the loss
@torch.compiler.disable
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096,
                         ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0, kernel: bool | None = None
                         ) -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T (x (N, d), weight (V, d)) against targets (N,),
    plus z_loss * lse^2, computed `chunk` tokens at a time (see the module docstring). kernel: the
    Triton row kernel (default on CUDA; on the CPU it runs in Triton's interpreter) or PyTorch."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    use_kernel = x.is_cuda if kernel is None else kernel
    # the gradients are computed in the forward, so it is told here which will be wanted (none under
    # no_grad, where they would be wasted), not read from ctx.needs_input_grad in the forward
    grad = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(x, weight, targets, int(chunk), int(ignore_index), float(z_loss), use_kernel,
                                     grad and x.requires_grad, grad and weight.requires_grad)


def full_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                       z_loss: float = 0.0) -> torch.Tensor:
    """The same loss from materialised logits (N, V): what linear_cross_entropy avoids."""
    logits = logits.float()
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index)
    if z_loss:
        valid = targets != ignore_index
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss * lse.square().where(valid, 0.0).sum() / valid.sum().clamp(min=1)
    return loss
