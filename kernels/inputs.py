"""What the kernels accept, checked once per layout: q (B, H, T, D), k and v (B, H_kv, S, D) with
H % H_kv == 0 (GQA), any strides, T and S, D <= MAX_HEAD_DIM, fp16, bf16 or fp32; doc_ids (B, T),
window and prefix (causal); score modifications (kernels/score_mods.py's ScoreMods) and sinks (H,).
The outputs' layout, the softmax scale, autocast, and whether TMA reads them."""

import torch

from kernels.masking import Bounds, kernel_bounds
from kernels.runtime import chips
from kernels.runtime.launch import interprets
from kernels.score_mods import ScoreMods

# what both backends take; each may take less (kernels/backends.py says so)
MAX_HEAD_DIM = 256  # tiles pad D to a power of two >= 16 and mask the rest
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp32 as true IEEE matmuls


def check_inputs(q, k, v):
    """Raise ValueError, saying what is supported, for inputs the kernels do not handle."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"a {t.dim()}-D tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"flash_attention: {name} must be a 4-D tensor (batch, heads, seq_len, head_dim), "
                             f"got {got}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} is not supported: use torch.float16, torch.bfloat16 "
                         "or torch.float32")
    if not q.device == k.device == v.device:
        raise ValueError(f"flash_attention: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: device {q.device} is not supported: use a CUDA device "
                         "(or the CPU, through Triton's interpreter)")
    (B, H, T, D), (B_kv, H_kv, S, D_kv) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if B_kv != B or D_kv != D:
        raise ValueError(f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch size "
                         "and head_dim (shapes are (batch, heads, seq_len, head_dim))")
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"flash_attention: q's {H} heads must be a multiple of k and v's {H_kv} heads "
                         "(grouped-query attention)")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim {D} is not supported: head_dim must be at most {MAX_HEAD_DIM}")
    if 0 in (B, H, T, S, D):
        raise ValueError(f"flash_attention: empty input q {tuple(q.shape)}, k {tuple(k.shape)}: "
                         "every dimension must be at least 1")


def _check_docs(q, k, doc_ids, causal):
    (B, _, T, _), S = q.shape, k.shape[2]
    if not causal:
        raise ValueError("flash_attention: doc_ids needs causal=True (documents are masked within causal attention)")
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.shape != (B, T) or doc_ids.device != q.device:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(f"flash_attention: doc_ids must be a (batch, seq_len) = ({B}, {T}) tensor on {q.device}, "
                         f"got {got}")
    if S != T or doc_ids.is_floating_point():
        raise ValueError("flash_attention: doc_ids needs self-attention (seq_len of q equal to k's) and integer ids")


def layout(*tensors: torch.Tensor) -> tuple:
    """What checks and compiled launches depend on in these tensors: shape, strides, dtype, device
    and 16-byte alignment. Calls with equal layouts (and flags) reuse both."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)


_CHECKED: set[tuple] = set()  # the layouts (and causal flags) whose checks passed


def checked_bounds(q, k, v, causal, doc_ids, window, prefix=0) -> Bounds | None:
    """The Bounds of doc_ids, window and prefix, once q, k, v and they are known good (ValueError
    otherwise)."""
    tensors = (q, k, v) if doc_ids is None else (q, k, v, doc_ids)
    # traced by torch.compile, tensors have no addresses: checked every time (at trace time only)
    cacheable = not torch.compiler.is_compiling() and all(isinstance(t, torch.Tensor) for t in tensors)
    key = (causal, window, prefix, *layout(*tensors)) if cacheable else None
    if key is None or key not in _CHECKED:
        check_inputs(q, k, v)
        if doc_ids is not None:
            _check_docs(q, k, doc_ids, causal)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"flash_attention: window={window!r}: must be an int >= 0 (0: no window)")
        if window and not causal:
            raise ValueError("flash_attention: window needs causal=True (each query keeps the `window` keys up to "
                             "its own)")
        if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
            raise ValueError(f"flash_attention: prefix={prefix!r}: must be an int >= 0 (0: no prefix)")
        if prefix and not causal:
            raise ValueError("flash_attention: prefix needs causal=True (a prefix-LM is causal after its prefix)")
        if key is not None:
            _CHECKED.add(key)
    (B, _, T, _), S = q.shape, k.shape[2]
    return kernel_bounds(doc_ids, window, B, T, S, q.device, prefix)  # Mask.bounds, without making a Mask per call


OFF = ScoreMods()  # no modification


def checked_mods(q, mods, sinks) -> ScoreMods:
    """mods as the kernels take it, OFF for None or a ScoreMods that modifies nothing, once mods and
    sinks are known good (ValueError otherwise): sinks, None or one logit per query head."""
    if mods is not None and not isinstance(mods, ScoreMods):
        raise ValueError(f"flash_attention: mods={mods!r}: must be a kernels.score_mods.ScoreMods (softcap, alibi) "
                         "or None")
    if sinks is not None:
        H = q.shape[1]
        if (not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or not sinks.is_floating_point()
                or sinks.device != q.device):
            got = (f"a {tuple(sinks.shape)} {sinks.dtype} tensor on {sinks.device}" if isinstance(sinks, torch.Tensor)
                   else repr(sinks))
            raise ValueError(f"flash_attention: sinks={got}: must be a ({H},) floating-point tensor on {q.device}, "
                             "one logit per query head, or None")
    return mods or OFF


def softmax_scale_of(q, softmax_scale=None) -> float:
    """The scale of the scores: softmax_scale, or 1 / sqrt(head_dim) when it is None."""
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def autocast_inputs(q, k, v):
    """q, k, v cast to the autocast dtype if autocast is on, as autocast does for SDPA."""
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    return q, k, v


def empty_bhtd(B, H, T, D, like):
    """A (B, H, T, D) tensor laid out in (B, T, H, D) memory order: the caller's transpose back to
    (B, T, H * D) is free."""
    return torch.empty_strided((B, H, T, D), (T * H * D, D, H * D, 1), dtype=like.dtype, device=like.device)


def uses_tma(*streamed: torch.Tensor) -> bool:
    """Whether the kernels read these streamed (B, H, T, D) inputs through TMA descriptors: compiled
    for an NVIDIA Hopper or newer GPU, with the head dim contiguous, rows that do not overlap (an
    expanded gradient's stride 0 does), and the base and every other stride 16-byte aligned (TMA's
    requirements)."""
    t = streamed[0]
    if interprets(t.device) or not chips.chip(t.device.index).tma:
        return False
    return all(x.stride(3) == 1 and x.stride(2) >= x.shape[3] and x.data_ptr() % 16 == 0
               and all(s * x.element_size() % 16 == 0 for s in x.stride()[:3]) for x in streamed)
