"""The Hopper kernels' pipeline: the memory and barriers the warp-specialized partitions share
(small named aggregates, as Triton's Gluon examples keep them: the rings and what they hold), and
the handshakes between the producer warp, the matmul warpgroups and the backward's dQ writer that
the Gluon language does not name. Which tile each program works on: schedule.py."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.language.nvidia.hopper.tma import tensor_descriptor

from kernels.runtime.internals import aggregate

Scalar = gl.tensor | gl.constexpr  # an integer argument is a constexpr where it is 1 (Triton specializes it)
MaybeTensor = gl.tensor | gl.constexpr  # an optional operand: a pointer, or None (a constexpr) where it is absent


@gluon.constexpr_function
def scalar(value):
    """A Scalar or MaybeTensor field's value: a specialized integer, or an absent operand, reaches an
    aggregate's constructor as a Python value (an int, None)."""
    return gl.constexpr(value) if value is None or isinstance(value, int) else value


# --------------------------------------------------------------------------------------------
# what the forward's partitions share


@aggregate
class FwdIO:
    """The program's global memory: TMA descriptors of q, k, v and o (B, H, T, D); LSE (B, H, T);
    SINKS (H,) fp32, each head's sink logit, or None."""
    q_desc: tensor_descriptor
    k_desc: tensor_descriptor
    v_desc: tensor_descriptor
    o_desc: tensor_descriptor
    LSE: gl.tensor
    SINKS: MaybeTensor

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, o_desc, LSE, SINKS):
        self.q_desc, self.k_desc, self.v_desc, self.o_desc, self.LSE = q_desc, k_desc, v_desc, o_desc, LSE
        self.SINKS = scalar(SINKS)


@aggregate
class FwdBuffers:
    """Shared memory and its barriers: a Q tile per consumer (q_bar: loaded; q_empty: its O has left
    through it), the STAGES-deep K/V ring (k_ready, v_ready: loaded; kv_empty: freed by every
    consumer), and a 2-slot ring of the next tiles' numbers (tile_ready: written by the producer;
    tile_empty: read by every consumer)."""
    q_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    tile_smem: gl.shared_memory_descriptor
    tile_ready: gl.shared_memory_descriptor
    tile_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, tile_smem, tile_ready,
                 tile_empty):
        self.q_smem, self.k_smem, self.v_smem = q_smem, k_smem, v_smem
        self.q_bar, self.q_empty, self.k_ready, self.v_ready, self.kv_empty = q_bar, q_empty, k_ready, v_ready, kv_empty
        self.tile_smem, self.tile_ready, self.tile_empty = tile_smem, tile_ready, tile_empty


# --------------------------------------------------------------------------------------------
# what the backward's partitions share


@aggregate
class BwdIO:
    """The program's global memory, by TMA: q, k, v, do (B, H, T, D); aux (B, H, 2, T_pad) fp32,
    LSE * log2(e) and delta; dq_acc (lines, 256) fp32, the dQ shares added so far, each Q block's
    in 8-column slabs (bwd_passes.py)."""
    q_desc: tensor_descriptor
    k_desc: tensor_descriptor
    v_desc: tensor_descriptor
    do_desc: tensor_descriptor
    aux_desc: tensor_descriptor
    dqacc_desc: tensor_descriptor

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, do_desc, aux_desc, dqacc_desc):
        self.q_desc, self.k_desc, self.v_desc, self.do_desc = q_desc, k_desc, v_desc, do_desc
        self.aux_desc, self.dqacc_desc = aux_desc, dqacc_desc


@aggregate
class BwdBuffers:
    """Shared memory and its barriers: the tile's K and V (kv_bar: loaded; kv_empty: read to the
    end); the STAGES-deep ring of Q, dO, LSE and delta (ready, empty); ds_smem, two tiles: by keys
    dS^T, twice; the dQ shares on their way to the writer (dq_full, dq_empty), twice; and the 2-slot
    ring of the next tiles' numbers, as the forward's."""
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_smem: gl.shared_memory_descriptor
    do_smem: gl.shared_memory_descriptor
    lse_smem: gl.shared_memory_descriptor
    delta_smem: gl.shared_memory_descriptor
    ds_smem: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    dq_full: gl.shared_memory_descriptor
    dq_empty: gl.shared_memory_descriptor
    tile_smem: gl.shared_memory_descriptor
    tile_ready: gl.shared_memory_descriptor
    tile_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_bar, kv_empty, ready,
                 empty, dq_full, dq_empty, tile_smem, tile_ready, tile_empty):
        self.k_smem, self.v_smem, self.q_smem, self.do_smem = k_smem, v_smem, q_smem, do_smem
        self.lse_smem, self.delta_smem, self.ds_smem, self.dq_smem = lse_smem, delta_smem, ds_smem, dq_smem
        self.kv_bar, self.kv_empty, self.ready, self.empty = kv_bar, kv_empty, ready, empty
        self.dq_full, self.dq_empty = dq_full, dq_empty
        self.tile_smem, self.tile_ready, self.tile_empty = tile_smem, tile_ready, tile_empty


# --------------------------------------------------------------------------------------------
# handshakes


@gluon.jit
def skip_slot(i, buffers):
    """Ring slot i of the forward's buffers holds a key block this warpgroup's rows do not see (below
    their first keys, where another warpgroup's rows see it): free it once loaded, unread. Waiting
    for the load keeps this warpgroup from freeing a slot twice before the other has freed it once."""
    STAGES: gl.constexpr = buffers.k_smem.type.shape[0]
    stage = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(buffers.k_ready.index(stage), phase)
    mbarrier.wait(buffers.v_ready.index(stage), phase)
    mbarrier.arrive(buffers.kv_empty.index(stage), count=1)


@gluon.jit
def load_acquire(ptrs):
    """ld.acquire.gpu of int32 pointers: what later loads and adds see follows what it read."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def bulk_done(like):
    """Waits for this thread's TMA stores and reductions to complete (their writes done, not only
    their shared-memory reads, as tma.store_wait waits for), and orders them before what follows."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;",
                                     "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)
