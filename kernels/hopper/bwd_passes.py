"""The Hopper backward's two Triton passes around its Gluon kernel (bwd.py): before it, LSE and
delta = rowsum(dO * O) laid out for TMA; after it, dQ scaled out of the fp32 accumulator the
kernel's dQ writer added into, back in row order.

The accumulator holds each (batch, head, Q block) as the matmul warps store a dQ share: in
8-column slabs, (D / 8, BLOCK_M, 8), so that the share goes to shared memory without bank
conflicts and out by one TMA reduce-add of BLOCK_M * D / 256 lines of 256 floats. Plain Triton:
they run in Triton's interpreter, where the Gluon kernel cannot.
"""

import torch
import triton
import triton.language as tl

from kernels.triton.blocks import LOG2E

ORDER_AT = 4  # int32s before the order counters in the counts: the tile counter, padded to 16 bytes
LINE = 256  # floats in a line of the accumulator's TMA box; BLOCK_M * D (8192 at both head dims) is a multiple
DQ_ROWS = 32  # rows of dQ a program of dq_kernel scales


@triton.jit
def lse_delta_kernel(
    O, DO, LSE, AUX,  # o, do (B, H, T, D), head dim contiguous; LSE (B, H, T); AUX (B, H, 2, T_PAD) fp32
    ZEROED, N_ZEROED,  # the dQ accumulator and the counters after it (floats), zeroed here
    o_strides, do_strides,  # each (batch, head, sequence)
    H, T, T_PAD, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):
    """AUX[b, h] = (LSE * log2(e), rowsum(dO * O)) over T_PAD rows, zero past T; and ZEROED[:N_ZEROED]
    = 0, BLOCK * HEAD_DIM floats a program and 8 of what is left past them (the grid covers every
    Q block's rows, T_PAD or more)."""
    stride_ob, stride_oh, stride_ot = o_strides
    stride_dob, stride_doh, stride_dot = do_strides
    off_h = tl.program_id(1).to(tl.int64)  # 64-bit offsets: a head's stride times H may pass 2^31
    off_b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    ok = rows < T
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + rows[:, None].to(tl.int64) * stride_ot + d[None, :],
                mask=ok[:, None], other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + rows[:, None].to(tl.int64) * stride_dot + d[None, :],
                 mask=ok[:, None], other=0.0)
    row0 = off_b * H + off_h
    lse = tl.load(LSE + row0 * T + rows, mask=ok, other=0.0) * LOG2E
    aux = AUX + row0 * 2 * T_PAD + rows
    tl.store(aux, tl.where(ok, lse, 0.0), mask=rows < T_PAD)
    tl.store(aux + T_PAD, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < T_PAD)
    # the zeroing rides on this launch (one launch fewer than a fill of its own; FlashAttention-3's
    # preprocessing clears its dQ accumulator the same way)
    program = row0 * tl.num_programs(0) + tl.program_id(0)
    chunk: tl.constexpr = BLOCK * HEAD_DIM
    tl.store(ZEROED + program * chunk + tl.arange(0, chunk), tl.zeros([chunk], tl.float32))
    rest = tl.num_programs(0).to(tl.int64) * H * tl.num_programs(2) * chunk + program * 8 + tl.arange(0, 8)
    tl.store(ZEROED + rest, tl.zeros([8], tl.float32), mask=rest < N_ZEROED)


@triton.jit
def dq_kernel(
    ACC,  # (B, H, cdiv(T, BLOCK_M), D / 8, BLOCK_M, 8) fp32: each Q block's dQ shares, added up, in slabs
    DQ, dq_strides,  # (B, H, T, D), head dim contiguous; its (batch, head, sequence) strides
    H, T, scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
):
    """dQ = scale * the accumulator, ROWS rows of a Q block a program, back in row order; rows
    past T (the last block's padding) are not written."""
    stride_b, stride_h, stride_t = dq_strides
    m_block = tl.program_id(0) * ROWS // BLOCK_M
    off_h = tl.program_id(1).to(tl.int64)  # as in lse_delta_kernel
    off_b = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * ROWS % BLOCK_M + tl.arange(0, ROWS)  # within the Q block
    d = tl.arange(0, HEAD_DIM)
    block = ACC + ((off_b * H + off_h) * tl.cdiv(T, BLOCK_M) + m_block) * (BLOCK_M * HEAD_DIM)
    acc = tl.load(block + (d[None, :] // 8) * (BLOCK_M * 8) + rows[:, None] * 8 + d[None, :] % 8)  # slabs of 8
    t = m_block * BLOCK_M + rows
    dq = DQ + off_b * stride_b + off_h * stride_h + t[:, None].to(tl.int64) * stride_t + d[None, :]
    tl.store(dq, (acc * scale).to(DQ.dtype.element_ty), mask=t[:, None] < T)


def buffers(q: torch.Tensor, block_m: int, device) -> tuple[torch.Tensor, tuple]:
    """(scratch, views): the backward's buffers as views of one fp32 allocation. The views: aux
    (B, H, 2, T_pad); dQ's fp32 accumulator, (lines, 256), in slabs, every Q block whole (the last
    one's rows past T get zero shares); the counts, int32, 16 bytes aligned: the tile counter, then
    from ORDER_AT on the order counters (B, H, cdiv(T, BLOCK_M)); and the region lse_delta_kernel zeroes,
    everything after aux, flat."""
    B, H, T, D = q.shape
    t_pad = triton.cdiv(T, 4) * 4  # 16-byte rows (TMA)
    n_order = B * H * triton.cdiv(T, block_m)
    n_aux, n_acc = B * H * 2 * t_pad, n_order * block_m * D
    scratch = torch.empty(n_aux + n_acc + ORDER_AT + n_order, dtype=torch.float32, device=device)
    return scratch, (scratch[:n_aux].view(B, H, 2, t_pad), scratch[n_aux:n_aux + n_acc].view(-1, LINE),
                     scratch[n_aux + n_acc:].view(torch.int32), scratch[n_aux:])


def lse_delta_launch(o, do, lse, aux, zeroed, block_m: int) -> tuple[tuple, tuple]:
    """(grid, args) of lse_delta_kernel for the forward's o and lse, dO, and buffers()' aux and
    zeroed region; the grid covers aux's rows and every Q block's (cdiv(T, block_m) * block_m)."""
    B, H, T, D = o.shape
    t_pad = aux.shape[3]
    grid = (triton.cdiv(T, block_m) * block_m // 64, H, B)
    return grid, (o, do, lse, aux, zeroed, zeroed.numel(), o.stride()[:3], do.stride()[:3], H, T, t_pad, D, 64)


def dq_launch(dq_acc, dq, scale: float, block_m: int) -> tuple[tuple, tuple]:
    """(grid, args) of dq_kernel writing dq (B, H, T, D) from the accumulator of buffers()."""
    B, H, T, D = dq.shape
    grid = (triton.cdiv(T, block_m) * block_m // DQ_ROWS, H, B)
    return grid, (dq_acc, dq, dq.stride()[:3], H, T, scale, block_m, D, DQ_ROWS)
