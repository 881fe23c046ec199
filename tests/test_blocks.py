"""Both dialects visit the same tiles and mask the same scores, and flash_ref's dense mask agrees.

The portable kernels compute their tile ranges and element masks in kernels/triton/blocks.py, the
Hopper kernels in kernels/hopper/blocks.py (Gluon cannot call @triton.jit helpers, and counts in
key blocks where the Triton kernels count in keys). Gluon has no interpreter, but its helpers use
only what Gluon and Triton name alike: here they run in Triton's interpreter with `gl` read as
`tl`, beside the Triton helpers, on every query block and key block of causal, full, document,
window and T != S masks, for one and three consumer warpgroups. Proves that (1) the two agree on
each range, (2) every tile holding a score some query sees is visited, (3) every tile visited
without the mask has all its scores seen, (4) the element masks equal the dense mask of
kernels/reference/flash_ref.py: attention_probs, and (5) the Gluon backward's dQ writers take
their turns on each Q block in launch order, once each. Seconds on a CPU:

    .venv/bin/python -m pytest tests/test_blocks.py -q
"""

import types
from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl

from kernels import masking
from kernels.hopper import blocks as gluon_blocks
from kernels.inputs import checked_bounds
from kernels.masking import bounds, document_bounds
from kernels.reference.flash_ref import attention_probs
from kernels.runtime.internals import InterpretedFunction, interpreted, interpreting
from kernels.triton.blocks import kv_ranges, q_ranges, visible, visible_t


def _in_triton(helper, **helpers) -> InterpretedFunction:
    """A Gluon helper run by Triton's interpreter, its `gl` read as `tl` (and the Gluon helpers it
    calls as the `helpers` given)."""
    fn = helper.fn
    return InterpretedFunction(types.FunctionType(fn.__code__, {**fn.__globals__, "gl": tl, **helpers}, fn.__name__,
                                                  fn.__defaults__, fn.__closure__))


gluon_kv_blocks = _in_triton(gluon_blocks.kv_blocks)
gluon_kv_runs = _in_triton(gluon_blocks.kv_runs)
gluon_q_blocks = _in_triton(gluon_blocks.q_blocks)
gluon_tile_masked = _in_triton(gluon_blocks.tile_masked)
gluon_visible = _in_triton(gluon_blocks.visible)
gluon_visible_t = _in_triton(gluon_blocks.visible_t)
gluon_dq_turn = _in_triton(gluon_blocks.dq_turn, last_kv_block=_in_triton(gluon_blocks.last_kv_block))


@triton.jit
def _store(out, values):
    """values[i] at out + i."""
    for i in tl.static_range(len(values)):
        tl.store(out + i, values[i])


@triton.jit
def _kv_side(KEY_LO, KEY_BAND, OUT, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, CONSUMERS: tl.constexpr,
             ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per (program, consumer): the Gluon forward's key blocks, and the Triton kernels' key ranges
    of the same ROWS query rows."""
    start_m = tl.program_id(0) * CONSUMERS * ROWS
    lo, n_blocks, key_lo_row = gluon_kv_blocks(KEY_LO, tl.program_id(2), start_m, T, S, CAUSAL, BOUNDED,
                                               CONSUMERS * ROWS, BLOCK_N)
    first = start_m + tl.program_id(1) * ROWS
    rows = first + tl.arange(0, ROWS)
    _, own_lo, full_lo, n_full = gluon_kv_runs(key_lo_row, rows, first, lo, n_blocks, T, S, CAUSAL, BOUNDED, ROWS,
                                               BLOCK_N)
    _, lo_t, full_lo_t, full_end_t, end_t = kv_ranges(KEY_BAND, tl.program_id(2), rows, first, T, S, CAUSAL,
                                                      BOUNDED, ROWS, BLOCK_N)
    _store(OUT + (tl.program_id(0) * CONSUMERS + tl.program_id(1)) * 9,
           (lo, n_blocks, own_lo, full_lo, n_full, lo_t, full_lo_t, full_end_t, end_t))


@triton.jit
def _q_side(ROW_HI, ROW_BAND, OUT, MASKED, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCKS: tl.constexpr):
    """Per key block: the Gluon backward's Q blocks and which it masks, and the Triton dK/dV
    kernel's query ranges."""
    n = tl.program_id(0)
    start_n = n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    _, start, full_start, full_hi_t, q_hi = q_ranges(ROW_BAND, tl.program_id(1), cols, start_n, T, S, CAUSAL,
                                                     BOUNDED, BLOCK_M, BLOCK_N)
    m_lo, m_hi, _, full_hi = gluon_q_blocks(ROW_HI, tl.program_id(1), n, T, S, CAUSAL, BOUNDED, BLOCK_M, BLOCK_N)
    _store(OUT + n * 6, (m_lo, m_hi, start, full_start, full_hi_t, q_hi))
    for m in range(M_BLOCKS):
        masked = gluon_tile_masked(m * BLOCK_M, start_n, start_n + BLOCK_N > S, full_hi, T, S, CAUSAL, BOUNDED,
                                   BLOCK_M, BLOCK_N)
        tl.store(MASKED + n * M_BLOCKS + m, masked.to(tl.int32))


@triton.jit
def _dq_turns(KEY_LO, OUT, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, LONGEST_FIRST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per (key block, Q block): the dQ writer's turn, in key blocks."""
    n, m = tl.program_id(0), tl.program_id(1)
    turn = gluon_dq_turn(KEY_LO, m * BLOCK_M, n, tl.num_programs(0), T, S, CAUSAL, BOUNDED, LONGEST_FIRST, BLOCK_M,
                         BLOCK_N)
    tl.store(OUT + n * tl.num_programs(1) + m, turn)


@triton.jit
def _masks(KEY_BAND, ROW_BAND, OUT, S_PAD, T, S, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """Both dialects' element masks of one (BLOCK_M, BLOCK_N) tile, query-major and key-major."""
    start_m = tl.program_id(0) * BLOCK_M
    start_n = tl.program_id(1) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    cols = start_n + tl.arange(0, BLOCK_N)
    key_lo = tl.load(KEY_BAND + rows, mask=rows < T, other=0)
    key_hi = tl.load(KEY_BAND + T + rows, mask=rows < T, other=-1)
    row_lo = tl.load(ROW_BAND + cols, mask=cols < S, other=T)
    row_hi = tl.load(ROW_BAND + S + cols, mask=cols < S, other=0)
    at = rows[:, None] * S_PAD + cols[None, :]
    plane = (tl.num_programs(0) * BLOCK_M) * S_PAD
    tl.store(OUT + at, visible(rows, cols, T, S, (key_lo, key_hi), CAUSAL, BOUNDED).to(tl.int32))
    tl.store(OUT + plane + at, gluon_visible(rows, cols, T, S, key_lo, CAUSAL, BOUNDED).to(tl.int32))
    if CAUSAL:  # the Triton dK/dV kernel masks only causal tiles
        at_t = cols[:, None] + rows[None, :] * S_PAD
        tl.store(OUT + 2 * plane + at_t, visible_t(cols, rows, T, S, (row_lo, row_hi), BOUNDED).to(tl.int32))
        tl.store(OUT + 3 * plane + at_t,
                 gluon_visible_t(cols, start_m, offs_m, T, S, row_hi, CAUSAL, BOUNDED).to(tl.int32))


def _run(kernel, grid, *args, **constexprs):
    with interpreting():
        interpreted(kernel)[grid](*args, **constexprs)


# (T, S, mask, document lengths or window): T != S both ways, with S - T + 1 one short of a tile
# (the diagonal's first key block); one-token documents, one on a tile edge, one ending a row
# before a tile edge (the last row of a tile past a key's row_hi); windows of 1, 31 and 40 keys
CASES = [
    (100, 100, "full", None), (77, 130, "full", None), (100, 100, "causal", None), (77, 130, "causal", None),
    (130, 77, "causal", None), (100, 114, "causal", None), (1, 64, "causal", None),
    (100, 100, "documents", [1, 31, 32, 3, 33]), (96, 96, "documents", [48, 48]), (100, 100, "documents", [47, 53]),
    (100, 100, "window", 31), (77, 130, "window", 40), (130, 77, "window", 1),
    (100, 100, "documents+window", ([40, 1, 59], 23)),
]
# a prefix-LM's prefix raises each query's last key (the portable kernels only: the Hopper kernels take none)
PREFIX_CASES = [
    (100, 100, "prefix", 40), (77, 130, "prefix", 20), (130, 77, "prefix", 33),
    (100, 100, "documents+prefix", ([1, 31, 32, 3, 33], 17)), (100, 100, "window+prefix", (23, 50)),
    (100, 100, "documents+window+prefix", ([40, 1, 59], 23, 30)),
]
BLOCKS = [(16, 32), (32, 16), (32, 32)]


class Setting(NamedTuple):
    T: int
    S: int
    block_m: int  # query rows per tile (ROWS, per consumer, in the forward test)
    block_n: int
    causal: bool
    bounded: bool
    key_lo: torch.Tensor  # (T,) int32: each query's first key (zeros unbounded)
    row_hi: torch.Tensor  # (S,) int32: one past each key's last query (zeros unbounded)
    seen: torch.Tensor  # (T, S) bool: flash_ref's dense mask
    keys: torch.Tensor  # (2 T,) int32: Bounds.keys of the one batch row, key_lo then key_hi (zeros unbounded)
    rows: torch.Tensor  # (2 S,) int32: Bounds.rows, row_lo then row_hi (zeros unbounded)
    prefix: int


def _parts(kind: str, extra) -> tuple:
    """(document lengths or None, window, prefix) of a case's mask kind and extra."""
    parts = kind.split("+")
    values = dict(zip(parts, extra if len(parts) > 1 else (extra,), strict=True))
    return values.get("documents"), values.get("window", 0), values.get("prefix", 0)


@pytest.fixture(params=[(c, b) for c in CASES + PREFIX_CASES for b in BLOCKS],
                ids=lambda p: f"T{p[0][0]}-S{p[0][1]}-{p[0][2]}-BM{p[1][0]}-BN{p[1][1]}")
def setting(request) -> Setting:
    (T, S, mask, extra), (block_m, block_n) = request.param
    causal = mask != "full"
    lengths, window, prefix = _parts(mask, extra) if causal else (None, 0, 0)
    doc_ids = None if lengths is None else torch.repeat_interleave(torch.arange(len(lengths)),
                                                                   torch.tensor(lengths))[None]
    bnd = bounds(doc_ids, window, 1, T, S, torch.device("cpu"), prefix)
    zeros_q, zeros_k = torch.zeros(1, 1, T, 8, dtype=torch.float64), torch.zeros(1, 1, S, 8, dtype=torch.float64)
    probs, _ = attention_probs(zeros_q, zeros_k, causal, doc_ids=doc_ids, window=window, prefix=prefix)
    key_lo = bnd.key_lo[0] if bnd else torch.zeros(T, dtype=torch.int32)
    row_hi = bnd.row_hi[0] if bnd else torch.zeros(S, dtype=torch.int32)
    keys = bnd.keys.flatten() if bnd else torch.zeros(2 * T, dtype=torch.int32)
    rows = bnd.rows.flatten() if bnd else torch.zeros(2 * S, dtype=torch.int32)
    return Setting(T, S, block_m, block_n, causal, bnd is not None, key_lo, row_hi, probs[0, 0] > 0, keys, rows,
                   prefix)


@pytest.mark.parametrize("case", CASES + PREFIX_CASES, ids=lambda c: f"T{c[0]}-S{c[1]}-{c[2]}")
def test_every_reader_of_a_mask_sees_the_same_keys(case):
    # the dense mask, FlexAttention's mask_mod, the kernels' Bounds and FlashAttention-4's
    # arguments, each from one Mask, against a walk over the keys written from the rule's words
    T, S, kind, extra = case
    lengths, window, prefix = _parts(kind, extra) if kind != "full" else (None, 0, 0)
    doc_ids = None if lengths is None else \
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    mask = masking.Mask(T, S, kind != "full", doc_ids, window, prefix)
    same_doc = (lambda i, j: True) if doc_ids is None else (lambda i, j: bool(doc_ids[0, i] == doc_ids[0, j]))
    in_prefix = (lambda j: j < prefix) if doc_ids is None else \
        (lambda j: j - next(x for x in range(j + 1) if same_doc(x, j)) < prefix)  # from its document's first
    want = torch.tensor([[j < S and (kind == "full" or j <= i + S - T or in_prefix(j))
                          and (not window or i + S - T - j < window) and same_doc(i, j) for j in range(S)]
                         for i in range(T)])
    assert torch.equal(mask.dense()[0, 0], want)
    rows, cols = torch.arange(T)[:, None], torch.arange(S)[None, :]
    assert torch.equal(mask.mask_mod(torch.device("cpu"))(torch.zeros((), dtype=torch.long), None, rows, cols), want)
    bnd = mask.bounds(1, torch.device("cpu"))
    if bnd is not None:  # the bands the kernels read are the same set of keys
        assert torch.equal((cols >= bnd.key_lo[0][:, None]) & (cols <= bnd.key_hi[0][:, None]), want)
        assert torch.equal((rows >= bnd.row_lo[0][None, :]) & (rows < bnd.row_hi[0][None, :]), want)
    if not prefix:  # the Hopper kernels read key_lo and row_hi, with the causal mask
        assert bnd is None or torch.equal((cols >= bnd.key_lo[0][:, None]) & (cols <= rows + S - T), want)


def test_flash_attention_4_gets_the_masks_window_and_document_offsets():
    # its window_size counts the keys before the query's own; its varlen entry takes the B rows
    # flattened, cut at every document and every row
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    args = masking.Mask(6, 6, True, doc_ids, 3).fa4()
    assert args["causal"] is True and args["window_size"] == (2, 0)
    assert args["cu_seqlens_q"].tolist() == args["cu_seqlens_k"].tolist() == [0, 2, 5, 6, 7, 12]
    assert args["cu_seqlens_q"].dtype == torch.int32 and args["max_seqlen_q"] == args["max_seqlen_k"] == 6
    assert masking.Mask(5, 9).fa4() == {"causal": True, "window_size": (None, None)}


def test_document_bounds_are_made_once_per_batch():
    # every layer of a step passes the batch's doc_ids: its Bounds are made once, through the
    # kernels' input check too, and again for another window, another batch or an in-place change
    cpu = torch.device("cpu")
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 2, 9]))[None]
    q = torch.zeros(1, 1, 16, 8)
    first = checked_bounds(q, q, q, True, doc_ids, 0)
    assert document_bounds(doc_ids, 0, 1, 16, 16, cpu) is first
    for made in (document_bounds(doc_ids, 4, 1, 16, 16, cpu), document_bounds(doc_ids.clone(), 0, 1, 16, 16, cpu)):
        assert made is not first
    first = document_bounds(doc_ids, 0, 1, 16, 16, cpu)
    doc_ids[0, 3:] = 7  # documents of 3 and 13 tokens
    made = document_bounds(doc_ids, 0, 1, 16, 16, cpu)
    assert not torch.equal(made.key_lo, first.key_lo)
    for x, y in zip(made, bounds(doc_ids, 0, 1, 16, 16, cpu), strict=True):
        assert torch.equal(x, y)
    with torch.inference_mode():  # no version counter to check: made each call
        fresh = torch.repeat_interleave(torch.arange(2), torch.tensor([4, 12]))[None]
        assert torch.equal(document_bounds(fresh, 0, 1, 16, 16, cpu).key_lo, bounds(fresh, 0, 1, 16, 16, cpu).key_lo)


def test_nothing_is_remembered_while_a_cuda_graph_is_captured(monkeypatch):
    # queued during capture, the Bounds (and the peers' masks and offsets, through the same cache)
    # hold values only once the graph replays: made each call then, remembered again after
    cpu = torch.device("cpu")
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 2, 9]))[None]
    built = []
    mask = masking.once_per_batch(lambda ids, window: built.append(window) or len(built))
    monkeypatch.setattr(masking, "_capturing", lambda device: True)
    assert [mask(doc_ids, 3) for _ in range(3)] == [1, 2, 3]
    first = document_bounds(doc_ids, 0, 1, 16, 16, cpu)
    assert document_bounds(doc_ids, 0, 1, 16, 16, cpu) is not first
    assert torch.equal(first.key_lo, bounds(doc_ids, 0, 1, 16, 16, cpu).key_lo)
    assert masking.shape_bounds(4, 1, 16, 16, cpu) is not masking.shape_bounds(4, 1, 16, 16, cpu)
    monkeypatch.setattr(masking, "_capturing", lambda device: False)
    assert [mask(doc_ids, 3) for _ in range(2)] == [4, 4]
    assert document_bounds(doc_ids, 0, 1, 16, 16, cpu) is document_bounds(doc_ids, 0, 1, 16, 16, cpu)


def test_document_bounds_are_traced_not_remembered_under_compile():
    # traced, there are no values to remember: a remembered call would break the graph
    traced = torch.compile(lambda d: document_bounds(d, 0, 1, 16, 16, d.device).key_lo + 0, backend="eager",
                           fullgraph=True)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 2, 9]))[None]
    assert torch.equal(traced(doc_ids), bounds(doc_ids, 0, 1, 16, 16, doc_ids.device).key_lo)


def _tiles_seen(seen, rows, keys):
    return bool(seen[rows.start:rows.stop, keys.start:keys.stop].any())


def _tiles_whole(seen, rows, keys):
    return bool(seen[rows.start:rows.stop, keys.start:keys.stop].all())


@pytest.mark.parametrize("consumers", [1, 3])
def test_forward_key_blocks_agree(setting, consumers):
    T, S, rows, block_n, causal, bounded, key_lo, _, seen, keys, _, prefix = setting
    programs = triton.cdiv(T, consumers * rows)
    # past T the helpers (never called there) would read past key_lo and key_hi: pad them
    pad = torch.full((programs * consumers * rows,), S, dtype=torch.int32)
    out = torch.zeros(programs * consumers, 9, dtype=torch.int32)
    _run(_kv_side, (programs, consumers, 1), torch.cat([key_lo, pad]), torch.cat([keys, pad]), out, T, S,
         CAUSAL=causal, BOUNDED=bounded, CONSUMERS=consumers, ROWS=rows, BLOCK_N=block_n)
    n_blocks_all = triton.cdiv(S, block_n)
    for index, (lo, n_blocks, own_lo, full_lo, n_full, lo_t, full_lo_t, full_end_t, end_t) in enumerate(out.tolist()):
        first = index * rows
        if first >= T:  # a consumer of rows past T only (T < CONSUMERS * ROWS): its stores are masked
            continue
        row_range = range(first, min(first + rows, T))
        for j in range(n_blocks_all):  # (2) and (3), Triton
            keys_j = range(j * block_n, min((j + 1) * block_n, S))
            assert (lo_t <= j * block_n < end_t) or not _tiles_seen(seen, row_range, keys_j), (index, j)
            assert not full_lo_t <= j * block_n < full_end_t or _tiles_whole(seen, row_range, keys_j), (index, j)
        if prefix:  # the Hopper kernels take none
            continue
        # (1) the dialects agree: Gluon counts blocks, Triton keys
        assert (own_lo * block_n, full_lo * block_n, n_full * block_n) == (lo_t, full_lo_t, full_end_t), index
        assert triton.cdiv(end_t, block_n) <= n_blocks and (consumers > 1 or triton.cdiv(end_t, block_n) == n_blocks)
        # (4) every consumer takes the tile's n_blocks - lo ring slots (passing [lo, own_lo) unread): the
        # persistent forward's ring runs on into the next tile, where one slot too many would desync it
        assert lo <= own_lo <= max(n_blocks, lo), index
        for j in range(n_blocks_all):
            keys = range(j * block_n, min((j + 1) * block_n, S))
            visited = own_lo <= j < n_blocks  # [lo, own_lo): other consumers' blocks, passed unread
            mask_free = full_lo <= j < n_full
            # (2) every tile with a score the rows see is visited; (3) a mask-free tile is seen whole
            assert visited or not _tiles_seen(seen, row_range, keys), (index, j)
            assert not mask_free or (visited and _tiles_whole(seen, row_range, keys)), (index, j)


def test_backward_query_blocks_agree(setting):
    T, S, block_m, block_n, causal, bounded, _, row_hi, seen, _, band, prefix = setting
    key_blocks, m_blocks = triton.cdiv(S, block_n), triton.cdiv(T, block_m)
    out = torch.zeros(key_blocks, 6, dtype=torch.int32)
    masked = torch.zeros(key_blocks, m_blocks, dtype=torch.int32)
    _run(_q_side, (key_blocks, 1, 1), row_hi, band, out, masked, T, S, CAUSAL=causal, BOUNDED=bounded,
         BLOCK_M=block_m, BLOCK_N=block_n, M_BLOCKS=m_blocks)
    for n, (m_lo, m_hi, start, full_start, full_hi_t, q_hi) in enumerate(out.tolist()):
        keys = range(n * block_n, min((n + 1) * block_n, S))
        # the Triton kernel's runs: masked [start, min(full_start, q_hi)), free [full_start, full_hi), masked
        # [full_hi, q_hi) (bounded)
        triton_free = set(range(full_start, full_hi_t, block_m))
        triton_visited = set(range(start, min(full_start, q_hi), block_m)) | triton_free
        if bounded:
            triton_visited |= set(range(full_hi_t, q_hi, block_m))
        for m in range(m_blocks):  # (2) and (3), Triton
            row_range = range(m * block_m, min((m + 1) * block_m, T))
            assert m * block_m in triton_visited or not _tiles_seen(seen, row_range, keys), (n, m)
            assert m * block_m not in triton_free or _tiles_whole(seen, row_range, keys), (n, m)
        if prefix:  # the Hopper kernels take none
            continue
        gluon_visited = {m * block_m for m in range(m_lo, m_hi)}
        assert gluon_visited == triton_visited, n  # (1)
        for m in range(m_blocks):
            row_range = range(m * block_m, min((m + 1) * block_m, T))
            if m * block_m not in gluon_visited:
                assert not _tiles_seen(seen, row_range, keys), (n, m)  # (2)
                continue
            assert masked[n, m] or _tiles_whole(seen, row_range, keys), (n, m)  # (3), Gluon


@pytest.mark.parametrize("longest_first", [False, True], ids=["shortest-first", "longest-first"])
def test_dq_turns_order_the_programs_of_each_q_block(setting, longest_first):
    # the key blocks whose programs visit a Q block take the turns 0, 1, ... once each, in launch
    # order: no writer waits for a share that never comes (a hang), none shares a turn (an order
    # that changes run to run). Launch order within a (batch, kv head), kernels/hopper/schedule.py's
    # bwd_tile: key block 0 first (longest first), or the last first (shortest first)
    T, S, block_m, block_n, causal, bounded, key_lo, row_hi, _, _, band, prefix = setting
    if prefix:
        pytest.skip("the Hopper kernels take no prefix")
    key_blocks, m_blocks = triton.cdiv(S, block_n), triton.cdiv(T, block_m)
    ranges = torch.zeros(key_blocks, 6, dtype=torch.int32)
    _run(_q_side, (key_blocks, 1, 1), row_hi, band, ranges, torch.zeros(key_blocks, m_blocks, dtype=torch.int32), T, S,
         CAUSAL=causal, BOUNDED=bounded, BLOCK_M=block_m, BLOCK_N=block_n, M_BLOCKS=m_blocks)
    turns = torch.zeros(key_blocks, m_blocks, dtype=torch.int32)
    _run(_dq_turns, (key_blocks, m_blocks, 1), key_lo, turns, T, S, CAUSAL=causal, BOUNDED=bounded,
         LONGEST_FIRST=longest_first, BLOCK_M=block_m, BLOCK_N=block_n)
    for m in range(m_blocks):
        visitors = [n for n, (m_lo, m_hi, *_) in enumerate(ranges.tolist()) if m_lo <= m < m_hi]
        in_order = visitors if longest_first else visitors[::-1]
        assert [turns[n, m].item() for n in in_order] == list(range(len(in_order))), m


def test_element_masks_agree_with_flash_ref(setting):
    T, S, block_m, block_n, causal, bounded, key_lo, row_hi, seen, keys, rows, prefix = setting
    m_tiles, n_tiles = triton.cdiv(T, block_m), triton.cdiv(S, block_n)
    out = torch.zeros(4, m_tiles * block_m, n_tiles * block_n, dtype=torch.int32)
    _run(_masks, (m_tiles, n_tiles, 1), keys, rows, out, n_tiles * block_n, T, S, CAUSAL=causal,
         BOUNDED=bounded, BLOCK_M=block_m, BLOCK_N=block_n)
    planes = out if causal else out[:2]
    planes = planes[::2] if prefix else planes  # the Hopper kernels take no prefix
    for plane in planes:  # (4)
        assert torch.equal(plane[:T, :S].bool(), seen)
        assert not plane[:T, S:].any()  # the last tile's keys past S: never visible
