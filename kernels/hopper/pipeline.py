"""The Hopper kernels' pipeline primitives: the handshakes between the producer warp, the matmul
warpgroups and the backward's dQ writer that the Gluon language does not name, in PTX."""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def skip_slot(i, k_ready, v_ready, kv_empty, STAGES: gl.constexpr):
    """Ring slot i holds a key block this warpgroup's rows do not see (below their first keys, where
    another warpgroup's rows see it): free it once loaded, unread. Waiting for the load keeps this
    warpgroup from freeing a slot twice before the other has freed it once."""
    stage = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(stage), phase)
    mbarrier.wait(v_ready.index(stage), phase)
    mbarrier.arrive(kv_empty.index(stage), count=1)


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


@builtin
def tma_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared memory `src` into the descriptor's box at `coord` (triton 3.6's
    Gluon builds the op but exposes no wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
