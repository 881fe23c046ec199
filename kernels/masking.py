"""The mask, stated once: which keys a query sees, and the Bounds the kernels read it from.

Query i (of T) sees key j (of S) iff
    j < S                                   a real key
    j <= i + S - T                          causal, bottom-right aligned (SDPA's is_causal at T == S)
    or j is among its document's first P keys  a prefix-LM's prefix, seen whole by its document's
                                            queries (bidirectional there)
    key_lo(i) <= j, equivalently i < row_hi(j)   bounded: packed documents and a sliding window
Documents (T == S) bound query i's keys from below by its document's first token; a causal window
of W keys by i + S - T - W + 1. Both bounds grow with i, so their maximum, key_lo, does too, and
so does its inverse row_hi (one past the last query that sees key j). From above, query i sees up
to key_hi(i): its own position, or its document's prefix's last key where that lies later; and
key j is seen from row_lo(j) on: the query at its position, or its document's first where j is in
the prefix. Both grow too. So every query sees one band of keys [key_lo, key_hi] and every key is
seen by one band of queries [row_lo, row_hi): two comparisons per score mask it all, a query
block needs keys only from its first row's key_lo to its last row's key_hi, a key block only the
queries from its first key's row_lo to its last key's row_hi, and tiles outside that band are
skipped, not masked.
Rows that see no key get O = 0, LSE = -inf and zero gradients. Each dialect computes the tile
ranges and the element mask from these in one module: kernels/triton/blocks.py,
kernels/hopper/blocks.py (which reads key_lo and row_hi only: it takes no prefix). Every other
reader takes the rule from a Mask: the dense boolean mask (naive, SDPA, the references and the
tests, which so check the Bounds independently), FlexAttention's mask_mod and FlashAttention-4's
arguments.
"""

import dataclasses
import functools
from typing import NamedTuple

import torch


class Bounds(NamedTuple):
    """The band of keys each query sees and of queries each key is seen by, as the kernels read it:
    keys (2, B, T) int32, every query's first key (key_lo) and last (key_hi, -1: none); rows (2, B, S)
    int32, every key's first query (row_lo) and one past its last (row_hi). The portable kernels take
    both halves from the first's address; the Hopper kernels take key_lo and row_hi."""
    keys: torch.Tensor
    rows: torch.Tensor

    @property
    def key_lo(self) -> torch.Tensor:
        return self.keys[0]

    @property
    def key_hi(self) -> torch.Tensor:
        return self.keys[1]

    @property
    def row_lo(self) -> torch.Tensor:
        return self.rows[0]

    @property
    def row_hi(self) -> torch.Tensor:
        return self.rows[1]


@dataclasses.dataclass(frozen=True, eq=False)
class Mask:
    """Which of S keys each of T queries sees: bottom-right causal (query i sits at key position
    i + S - T: the newest T of S keys), within its document (doc_ids (B, T), T == S; a row's
    documents have distinct ids), fewer than `window` keys back (0: any), and, with a prefix of P
    keys, every one of its document's (or sequence's) first P keys too, later ones included."""
    T: int
    S: int
    causal: bool = True
    doc_ids: torch.Tensor | None = None
    window: int = 0
    prefix: int = 0

    def __post_init__(self):
        for name in ("window", "prefix"):
            if getattr(self, name) and not self.causal:
                raise ValueError(f"Mask: {name}={getattr(self, name)} needs causal=True (it bounds a causal mask)")

    def sees(self, b, rows, cols) -> torch.Tensor:
        """Whether query `rows` of batch row b (read only with documents) sees key `cols`, for
        broadcasting index tensors."""
        if self.doc_ids is not None and b is None:
            raise ValueError("Mask.sees: with documents, say which batch rows (b)")
        return sees(b, rows, cols, self.T, self.S, self.causal, self.window or None, self.doc_ids,
                    self.in_prefix(cols.device))

    def in_prefix(self, device: torch.device | None = None) -> torch.Tensor | None:
        """(B or 1, S) bool: the keys among their document's (without documents, the sequence's) first
        `prefix`; None without a prefix."""
        if not self.prefix:
            return None
        if self.doc_ids is None:
            return (torch.arange(self.S, device=device) < self.prefix)[None]
        keys = torch.arange(self.S, device=self.doc_ids.device).expand_as(self.doc_ids)
        starts = torch.cummax(torch.where(firsts(self.doc_ids), keys, 0), dim=1).values  # each key's document's first
        return keys - starts < self.prefix

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """(B or 1, 1, T, S) bool, True where a query sees a key."""
        device = self.doc_ids.device if self.doc_ids is not None else device
        rows = torch.arange(self.T, device=device)[:, None]
        cols = torch.arange(self.S, device=device)[None, :]
        if self.doc_ids is None:
            return self.sees(None, rows, cols)[None, None]
        b = torch.arange(self.doc_ids.shape[0], device=device)[:, None, None]
        return self.sees(b, rows, cols)[:, None]

    def mask_mod(self, device: torch.device):
        """FlexAttention's mask_mod(b, h, q_idx, kv_idx) of this rule. The window is a tensor the
        kernel reads, not a constant compiled into it: one kernel (and one of dynamo's 8 compiles
        per function) serves every window of a sweep; 0 reaches all S keys."""
        T, S, causal, doc_ids = self.T, self.S, self.causal, self.doc_ids
        reach, in_prefix = torch.tensor(self.window or S, device=device), self.in_prefix(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return sees(b, q_idx, kv_idx, T, S, causal, reach, doc_ids, in_prefix)
        return mask_mod

    def bounds(self, B: int, device: torch.device) -> Bounds | None:
        """The Bounds our kernels read (None: the causal mask alone), made once per batch or shape."""
        return kernel_bounds(self.doc_ids, self.window, B, self.T, self.S, device, self.prefix)

    def fa4(self) -> dict:
        """FlashAttention-4's arguments: its window_size (W - 1 keys before, none after); with
        documents those of its varlen entry, where the B rows are flattened to B·T tokens."""
        if self.prefix:
            raise ValueError(f"Mask.fa4: prefix={self.prefix}: FlashAttention-4 has no prefix-LM mask")
        args = {"causal": self.causal, "window_size": (self.window - 1, 0) if self.window else (None, None)}
        if self.doc_ids is not None:
            offsets = _batch_cu_seqlens(self.doc_ids)
            # T bounds every document (none crosses a row): no host sync for the longest
            args |= {"cu_seqlens_q": offsets, "cu_seqlens_k": offsets, "max_seqlen_q": self.T, "max_seqlen_k": self.S}
        return args


def bounds(doc_ids: torch.Tensor | None, window: int, B: int, T: int, S: int, device: torch.device,
           prefix: int = 0) -> Bounds | None:
    """The Bounds of packed documents doc_ids (B, T) (a document is a run of equal ids, so any ids,
    repeated further on or colliding in int32, mask as they skip), of a causal window of W keys
    (query i, at key position i + S - T, sees keys i + S - T - W + 1 .. i + S - T; 0: no window) and
    of a prefix of P keys (each document's, or the sequence's, first P; 0: none), or None where
    none bounds anything."""
    if window >= S:  # the window holds every key a query may see
        window = 0
    if doc_ids is None and window == 0 and prefix == 0:
        return None
    rows = torch.arange(T, dtype=torch.int32, device=device).expand(B, T)
    keys = torch.arange(S, dtype=torch.int32, device=device).expand(B, S)
    key_lo, key_hi = torch.zeros_like(rows), rows + (S - T)  # causal
    row_lo, row_hi = keys - (S - T), torch.full_like(keys, T)
    if doc_ids is not None:  # T == S: rows and keys share positions
        first = firsts(doc_ids)
        last = torch.ones_like(first)
        last[:, :-1] = first[:, 1:]
        starts = torch.cummax(torch.where(first, rows, 0), dim=1).values  # each position's document's first
        ends = torch.cummin(torch.where(last, rows + 1, T).flip(1), dim=1).values.flip(1)  # and one past its last
        key_lo, row_hi = starts, ends
    if prefix:  # a query sees its document's (the sequence's) prefix whole; a prefix key is seen from its start
        if doc_ids is None:
            key_hi = key_hi.clamp(min=min(prefix, S) - 1)
            row_lo = torch.where(keys < prefix, 0, row_lo)
        else:
            prefix_end = torch.minimum(starts + prefix, ends)
            key_hi = torch.maximum(key_hi, prefix_end - 1)
            row_lo = torch.where(keys < prefix_end, starts, row_lo)
    if window:
        key_lo = torch.maximum(key_lo, rows + (S - T - window + 1))
        row_hi = torch.minimum(row_hi, keys + (window + T - S))
    return Bounds(torch.stack([key_lo.clamp(0, S), key_hi.clamp(-1, S - 1)]).to(torch.int32),
                  torch.stack([row_lo.clamp(0, T), row_hi.clamp(0, T)]).to(torch.int32))


def once_per_batch(build):
    """build(doc_ids, *key), remembered for the last doc_ids tensor, for each key it is asked with:
    every layer of a step passes the same one (its window may differ: model.window_pattern).
    Holding it keeps the identity check sound; its version counter catches an in-place change.
    Writes it does not count (through .data, numpy or DLPack, a CUDA graph replaying into doc_ids)
    are not seen: pass each batch's doc_ids as a new tensor, as the trainer does.
    Built every call for inference tensors (no version counter) and while a CUDA graph is being
    captured (what it builds then holds values only once the graph replays). Never traced by
    torch.compile: a caller that may be traced builds itself while compiling."""
    last = None

    @functools.wraps(build)
    def cached(doc_ids: torch.Tensor, *key):
        nonlocal last
        if doc_ids.is_inference() or _capturing(doc_ids.device):
            return build(doc_ids, *key)
        entry = last  # one read: another thread may replace it
        if entry is None or entry[0] is not doc_ids or entry[1] != doc_ids._version:
            entry = (doc_ids, doc_ids._version, {})
            last = entry
        built = entry[2]
        if key not in built:
            built[key] = build(doc_ids, *key)
        return built[key]
    return torch.compiler.disable(cached)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (work queued now runs only when
    it replays)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _made_now(device: torch.device) -> bool:
    """Whether Bounds made here must not be remembered: traced by torch.compile (no values), or
    captured into a CUDA graph (values only once the graph replays)."""
    return torch.compiler.is_compiling() or _capturing(device)


_document_bounds = once_per_batch(bounds)


def document_bounds(doc_ids: torch.Tensor, window: int, B: int, T: int, S: int, device: torch.device,
                    prefix: int = 0) -> Bounds:
    """bounds(doc_ids, window, ..., prefix), made once per batch in eager calls: its scans (cummax,
    cummin) cost a good part of a long sequence's forward kernel (docs/perf-notes.md)."""
    if torch.compiler.is_compiling():  # traced: the cache (not traced) would break the graph
        return bounds(doc_ids, window, B, T, S, device, prefix)
    return _document_bounds(doc_ids, window, B, T, S, device, prefix)


_SHAPES: dict[tuple, Bounds | None] = {}  # (B, T, S, window, prefix, device) -> its Bounds, without documents


def shape_bounds(window: int, B: int, T: int, S: int, device: torch.device, prefix: int = 0) -> Bounds | None:
    """bounds(None, window, ..., prefix), made once per shape in eager calls (a few launches saved
    per call)."""
    if (not window or window >= S) and not prefix:  # no bounds: full causal calls skip the capture check below
        return None
    if _made_now(device):
        return bounds(None, window, B, T, S, device, prefix)
    key = (B, T, S, window, prefix, device)
    if key not in _SHAPES:
        if len(_SHAPES) >= 64:  # shapes change rarely; bound the memory where they do
            _SHAPES.clear()
        _SHAPES[key] = bounds(None, window, B, T, S, device, prefix)
    return _SHAPES[key]


def kernel_bounds(doc_ids: torch.Tensor | None, window: int, B: int, T: int, S: int, device: torch.device,
                  prefix: int = 0) -> Bounds | None:
    """Mask.bounds without a Mask: what kernels/inputs.py calls on every flash_attention call, where
    making the object would be host time spent for nothing."""
    if doc_ids is None:
        return shape_bounds(window, B, T, S, device, prefix)
    return document_bounds(doc_ids, window, B, T, S, device, prefix)


def sees(b, rows, cols, T: int, S: int, causal: bool, reach, doc_ids: torch.Tensor | None,
         in_prefix: torch.Tensor | None = None) -> torch.Tensor:
    """The rule, for broadcasting index tensors of queries (rows, below T) and keys (cols, below S):
    query i of batch row b sees key j iff j is no later than i's own position i + S - T (causal)
    or in its document's prefix (in_prefix (B or 1, S), Mask.in_prefix's), fewer than reach keys
    behind it (an int or a tensor; None: any) and in i's document. The ops are FlexAttention's per
    score, as few as the rule needs."""
    behind = rows + (S - T) - cols  # how far key j lies behind query i's own position
    seen = behind >= 0 if causal else torch.ones_like(behind, dtype=torch.bool)
    if in_prefix is not None:
        seen = seen | in_prefix[0 if doc_ids is None else b, cols]
    if reach is not None:
        seen = seen & (behind < reach)
    if doc_ids is not None:
        seen = seen & (doc_ids[b, rows] == doc_ids[b, cols])
    return seen


def firsts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool, True where a document starts: a document is a run of equal ids, and every row's
    first token starts one."""
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return first


def cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (N + 1,) int32: where each of the N documents of the B rows, flattened
    to B·T tokens, starts, then B·T. A document is a run of equal ids, and every row's first token
    starts one."""
    offsets = firsts(doc_ids).flatten().nonzero().flatten()  # the number of documents: one host sync per batch
    return torch.cat([offsets, offsets.new_tensor([doc_ids.numel()])]).to(torch.int32)


_batch_cu_seqlens = once_per_batch(cu_seqlens)
