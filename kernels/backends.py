"""Which kernels run: the portable Triton kernels (kernels/triton/) or, on sm_90, the Hopper kernels
in Gluon (kernels/hopper/), per direction, from the inputs, the card and the caller's choice of
backend; and why a kernel cannot run (unsupported, the one place that says so).

backend: "auto", by length, the faster kernels as measured on the H100 (the Hopper kernels from
kernels/hopper/config.py's MIN_SEQ queries on, where they can run); "triton", the portable
kernels only; "gluon", the Hopper kernels both ways, or a ValueError saying why not. The backward
is deterministic either way: the same bits every run. The Hopper kernels take sinks but no score
modification (kernels/score_mods.py: softcap, ALiBi) and no prefix: with one, "auto" runs the
portable kernels.
"""

import torch
import triton

from kernels import inputs
from kernels.hopper import config as hopper
from kernels.runtime import chips
from kernels.runtime.chips import NoConfigFits
from kernels.runtime.launch import interprets
from kernels.triton.bwd import DKDV, DQ
from kernels.triton.fwd import FWD

BACKENDS = ("auto", "triton", "gluon")
LAUNCHERS = {"fwd": FWD, "dq": DQ, "dkdv": DKDV}  # the tuned Triton kernels by name (tests, tune_attention.py)
_CHOSEN: dict[tuple, str] = {}  # (direction, input signature) -> the kernels that run it


def check_backend(backend: str) -> None:
    """ValueError for a backend that is not one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"flash_attention: backend={backend!r}: choose one of {', '.join(BACKENDS)}")


def unsupported(head_dim: int, dtype: torch.dtype, device: torch.device, kernels: str = "triton") -> str | None:
    """Why `kernels` cannot run head_dim in dtype on this device (None: they can). "triton": the
    portable kernels, on any device but bf16 below compute capability 8.0 and head dims no tile
    config fits the card; "gluon": the Hopper kernels, where kernels/hopper/config.py says, for
    inputs whose strides suit TMA (with or without documents)."""
    if kernels == "gluon" and (device.type != "cuda" or interprets(device)):
        return "they run on CUDA GPUs only (Gluon has no interpreter)"
    if device.type != "cuda":
        return None
    chip = chips.chip(torch.cuda.current_device() if device.index is None else device.index)
    if kernels == "gluon":
        if chip.capability != hopper.CAPABILITY:
            return (f"they are built for sm_90 (H100, H200); {chip.name} is "
                    f"sm_{chip.capability[0]}{chip.capability[1]}")
        if not triton.__version__.startswith(hopper.TRITON):
            return f"they are written in triton {hopper.TRITON}'s Gluon; this is triton {triton.__version__}"
        if dtype not in hopper.DTYPES:
            return f"they take {_names(hopper.DTYPES)}, not {dtype}"
        if head_dim not in hopper.HEAD_DIMS:
            return f"they take head_dim {_names(hopper.HEAD_DIMS)}, not {head_dim}"
        return None
    if dtype == torch.bfloat16 and not chip.bf16:
        major, minor = chip.capability
        return f"bfloat16 needs compute capability 8.0 or newer; {chip.name} is {major}.{minor}: use torch.float16"
    try:
        for launcher in LAUNCHERS.values():
            launcher.candidates({"HEAD_DIM": head_dim}, dtype.itemsize, chip)
    except NoConfigFits as e:
        return str(e).removeprefix("flash_attention: ")
    return None


def _names(values) -> str:
    names = [str(v).removeprefix("torch.") for v in values]
    return ", ".join(names[:-1]) + " and " + names[-1]


def _gluon_wanted(seq_len: int, backend: str) -> bool:
    """Whether the backend choice sends a call of seq_len queries to Gluon where it can run."""
    return backend == "gluon" or (backend == "auto" and seq_len >= hopper.MIN_SEQ)


# why the Hopper kernels cannot run score modifications, after "the Hopper kernels" or "they"
MODS_REFUSED = 'take no softcap, ALiBi or prefix: backend="auto" or "triton" runs them (the portable kernels)'


def kernels_for(direction: str, signature: tuple, streamed: tuple, backend: str, modified: bool = False) -> str:
    """"gluon" or "triton": the kernels that run this direction of these inputs (decided once per
    signature, which holds the backend and the modifications; streamed: the inputs read through
    TMA, q first; modified: score modifications (softcap, ALiBi) or a prefix, which only the portable
    kernels take).
    ValueError where backend="gluon" asks for the Hopper kernels and they cannot, or where the card
    cannot run the portable ones."""
    chosen = _CHOSEN.get((direction, signature))
    if chosen is None:
        if modified and backend == "gluon":
            raise ValueError(f"flash_attention: backend=gluon: the Hopper kernels {MODS_REFUSED}")
        q = streamed[0]
        T, D = q.shape[2:]
        chosen = "triton"
        if not modified and _gluon_wanted(T, backend):
            why = unsupported(D, q.dtype, q.device, "gluon")
            if why is None and not inputs.uses_tma(*streamed):
                why = "the inputs need a contiguous head dim and 16-byte aligned strides (TMA)"
            if why is not None and backend == "gluon":
                raise ValueError(f"flash_attention: backend=gluon: the Hopper {direction} cannot run these inputs: "
                                 f"{why}")
            chosen = "triton" if why else "gluon"
        if chosen == "triton" and (why := unsupported(D, q.dtype, q.device)):
            raise ValueError(f"flash_attention: {why}")
        _CHOSEN[direction, signature] = chosen
    return chosen


def backends(head_dim: int, dtype: torch.dtype, device: torch.device, seq_len: int,
             backend: str = "auto", modified: bool = False) -> dict[str, str]:
    """Which kernels run the forward and the backward of attention with this head dim, dtype,
    device and query length (with or without documents; modified: with score modifications,
    softcap or ALiBi, or a prefix), for inputs laid out as the model lays them out (the run info
    logs it); ValueError for a backend it does not know, or gluon where it cannot run."""
    check_backend(backend)
    why = f"they {MODS_REFUSED}" if modified else unsupported(head_dim, dtype, device, "gluon")
    if why and backend == "gluon":
        raise ValueError(f"attn.backend=gluon: the Hopper kernels cannot run this model's attention: {why}")
    return {direction: "gluon" if why is None and _gluon_wanted(seq_len, backend) else "triton"
            for direction in ("forward", "backward")}
