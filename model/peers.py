"""The attentions ours is measured against, as entries of the registry: FlexAttention and FlashAttention-4.

FlexAttention (torch.nn.attention.flex_attention) is PyTorch's programmable attention: the mask is a
Python function of (batch, head, query, key) that torch.compile fuses into one Triton kernel, and a
BlockMask (which 128 x 128 tiles the mask leaves empty, partial or full) lets that kernel skip
tiles, as ours skip the tiles outside their Bounds. The causal and windowed BlockMasks depend on
the shape alone and are built once per shape; with documents one is built from each batch's doc_ids,
once for all the layers of a step. The ablations' softcap and ALiBi are its score_mod, a prefix
part of its mask_mod, and a sink joins each row from the LSE it returns. torch has no
FlexAttention backward on the CPU: it runs inference there, and trains on CUDA.

FlashAttention-4 (flash_attn.cute: `pip install flash-attn-4`, CUDA 13) is FlashAttention-3's Hopper
algorithm (sm_90) and its Blackwell one (sm_100) in CuTe DSL. It is optional: imported at its first
call. It takes (B, T, H, D), the memory order the model's q, k, v views have already; a window is its
window_size (W - 1, 0); documents go through its varlen entry, the B rows flattened to B·T tokens and
cut at every document and row boundary (cu_seqlens). A softcap and sinks are its own arguments;
it has no ALiBi or prefix (FA4_REFUSES). Its backward is FA4's default: dQ added atomically, not
bit-identical from run to run (deterministic=True orders it).

Both run outside a compiled model's graph where Python must (a graph break): the BlockMask lookup or
build, and FA4's launch, which Dynamo cannot trace.
"""

import functools

import torch
from torch.nn.attention import flex_attention as torch_flex

from kernels.masking import Mask, once_per_batch
from kernels.score_mods import ScoreMods, alibi_slopes

FA4_NEEDS = ("FlashAttention-4 needs the flash-attn-4 package (pip install flash-attn-4, CUDA 13) and an sm_90 or "
             "sm_100 GPU")


# ---------------------------------------------------------------------------
# FlexAttention


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _block_mask(mask_mod, B: int | None, T: int, S: int, device: torch.device) -> torch_flex.BlockMask:
    # compiled on CUDA, where the eager build would hold the (B, T, S) mask at once; eager on the
    # CPU, where sequences are short (measured on 2 cores at T = 37: 30 ms, against 14 s to compile)
    build = _compiled(torch_flex.create_block_mask) if device.type == "cuda" else torch_flex.create_block_mask
    return build(mask_mod, B, None, T, S, device=device)


@torch.compiler.disable
@functools.cache
def _shape_mask(T: int, S: int, window: int, prefix: int, device: torch.device) -> torch_flex.BlockMask:
    return _block_mask(Mask(T, S, window=window, prefix=prefix).mask_mod(device), None, T, S, device)


@once_per_batch
def _document_mask(doc_ids: torch.Tensor, window: int, prefix: int) -> torch_flex.BlockMask:
    B, T = doc_ids.shape
    return _block_mask(Mask(T, T, True, doc_ids, window, prefix).mask_mod(doc_ids.device), B, T, T, doc_ids.device)


@functools.cache
def _score_mod(mods: ScoreMods, H: int, T: int, S: int, device: torch.device):
    """FlexAttention's score_mod(score, b, h, q_idx, kv_idx) of mods (kernels/score_mods.py), on the
    scaled score; one function per setting and shape, so that dynamo compiles each once."""
    cap, slopes = mods.softcap, alibi_slopes(H).float().to(device) if mods.alibi else None

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:  # the query at key position q_idx + S - T
            score = score - slopes[h] * (kv_idx - q_idx - (S - T)).abs()
        return score
    return score_mod


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                   window: int = 0, prefix: int = 0, mods: ScoreMods | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """FlexAttention, compiled for each shape (dynamic=False: the kernels of a fixed shape). A sink
    joins each row's denominator after the kernel, from its LSE L: O l / (l + e^sink) = O sigmoid(L - sink),
    differentiated through L as FlexAttention's backward allows."""
    (H, T), S = q.shape[1:3], k.size(-2)
    mask = (_shape_mask(T, S, window, prefix, q.device) if doc_ids is None
            else _document_mask(doc_ids, window, prefix))
    score_mod = _score_mod(mods, H, T, S, q.device) if mods else None
    attend = functools.partial(_compiled(torch_flex.flex_attention), q, k, v, score_mod=score_mod, block_mask=mask,
                               enable_gqa=k.size(1) != q.size(1))
    if sinks is None:
        return attend()
    out, aux = attend(return_aux=torch_flex.AuxRequest(lse=True))
    kept = torch.sigmoid(aux.lse - sinks.float()[None, :, None])  # (B, H, T): a row with no key keeps 0
    return (out.float() * kept[..., None]).to(out.dtype)


def flex_unsupported(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type == "cpu":
        return (f"torch {torch.__version__} has no FlexAttention backward on the CPU (inference only): "
                "train attn=flex on a CUDA GPU")
    if head_dim < 16:
        return f"FlexAttention's Triton kernels need head dim 16 or more, not {head_dim}"
    return None


# ---------------------------------------------------------------------------
# FlashAttention-4


# what FlashAttention-4 cannot compute of the ablations (model/attention.py's MODS): it takes a softcap,
# windows and learnable sinks as arguments; the rest would be CuTe DSL score_mod / mask_mod functions
FA4_REFUSES = {"alibi": "FlashAttention-4 has no ALiBi argument", "prefix": "FlashAttention-4 has no prefix-LM mask"}


@torch.compiler.disable
def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None,
                  window: int = 0, prefix: int = 0, mods: ScoreMods | None = None,
                  sinks: torch.Tensor | None = None, deterministic: bool = False) -> torch.Tensor:
    """FlashAttention-4, causal (bottom-right aligned, as kernels/masking.py's Mask: T new queries of S keys),
    with its softcap and learnable sinks; deterministic: its ordered dQ backward."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    if prefix or (mods and mods.alibi):
        raise ValueError(f"fa4_attention: {FA4_REFUSES['prefix' if prefix else 'alibi']}")
    B, H, T, D = q.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, T, H, D): a view, the model's memory order
    args = Mask(T, k.size(1), True, doc_ids, window).fa4() | {"softcap": mods.softcap if mods else 0.0,
                                                              "learnable_sink": sinks}
    if doc_ids is None:
        out, _ = flash_attn_func(q, k, v, deterministic=deterministic, **args)
        return out.transpose(1, 2)
    # (B·T, H, D): views of the model's q, k, v
    out, _ = flash_attn_varlen_func(*(t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)), deterministic=deterministic,
                                    **args)
    return out.view(B, T, H, D).transpose(1, 2)


def fa4_unsupported(head_dim: int, dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"{FA4_NEEDS}; device is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"{FA4_NEEDS}; {torch.cuda.get_device_name(device)} is sm_{major}{minor}"
    try:
        import flash_attn.cute  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:
        first_line = str(e).partition("\n")[0][:100]
        return f"{FA4_NEEDS}; flash_attn.cute does not import ({type(e).__name__}: {first_line})"
    if dtype not in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        return f"FlashAttention-4 runs bf16 or fp16, not {name}: set dtype=auto or bfloat16"
    # flash_attn/cute/interface.py _validate_head_dims: multiples of 8 up to 256 on sm_90, 128 (or 256) on sm_100
    largest = 256 if major == 9 else 128
    if head_dim % 8 or not (8 <= head_dim <= largest or head_dim == 256):
        return (f"FlashAttention-4 on sm_{major}{minor} takes head dims 8-{largest} in multiples of 8, and 256, "
                f"not {head_dim}")
    return None
