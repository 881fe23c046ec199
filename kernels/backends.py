"""Which kernels run: the portable Triton kernels (kernels/triton/) or, on sm_90, the Hopper kernels
in Gluon (kernels/hopper/), per direction, from the inputs, the card and two environment variables;
and why a kernel cannot run (unsupported, the one place that says so).

FLASH_ATTENTION_BACKEND: unset, by length, the faster kernels measured on the H100 (the Hopper
kernels from kernels/hopper/config.py's MIN_SEQ queries on); triton, the portable kernels only;
gluon, the Hopper kernels both ways, or a ValueError saying why not.
FLASH_ATTENTION_DETERMINISTIC: "1" (unset) or "0": whether the Gluon backward adds dQ's shares in
a fixed order (the same bits every run) or as they come (not reproducible, and no faster:
docs/perf-notes.md v13); the Triton backward has no atomics to order.
These two, FLASH_ATTENTION_TMA and the Hopper kernels' schedule variables are VARIABLES: a call
reads them all at once (variables()), and its choices and launches are kept per value of each.
"""

import os

import torch
import triton

from kernels import inputs
from kernels.hopper import config as hopper
from kernels.runtime import chips
from kernels.runtime.chips import NoConfigFits
from kernels.runtime.launch import interprets
from kernels.triton import config
from kernels.triton.bwd import DKDV, DQ
from kernels.triton.fwd import FWD

BACKEND_VARIABLE = "FLASH_ATTENTION_BACKEND"
DETERMINISTIC_VARIABLE = "FLASH_ATTENTION_DETERMINISTIC"
# every variable that chooses the kernels or their schedule: a call's choices and launches are kept
# per value of each (variables())
VARIABLES = (BACKEND_VARIABLE, DETERMINISTIC_VARIABLE, inputs.TMA_VARIABLE, *hopper.VARIABLES)
_ENCODED = tuple(map(os.environ.encodekey, VARIABLES))
LAUNCHERS = {"fwd": FWD, "dq": DQ, "dkdv": DKDV}  # the tuned Triton kernels by name (tests, tune_attention.py)
_CHOSEN: dict[tuple, str] = {}  # (direction, input signature) -> the kernels that run it


def variables() -> tuple:
    """VARIABLES' values now, as the environment holds them (None where unset), read once per call:
    os.environ.get encodes the name and decodes the value (about a microsecond a variable, eleven
    of them a call); the mapping under it answers for all of them in less than one. Where
    os.environ was replaced by a plain mapping (a test's patch), it is read name by name."""
    raw = getattr(os.environ, "_data", None)
    if raw is None:
        return tuple(map(os.environ.get, VARIABLES))
    return tuple(map(raw.get, _ENCODED))


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
            launcher.candidates({"BLOCK_D": config.block_d(head_dim)}, dtype.itemsize, chip)
    except NoConfigFits as e:
        return str(e).removeprefix("flash_attention: ")
    return None


def _names(values) -> str:
    names = [str(v).removeprefix("torch.") for v in values]
    return ", ".join(names[:-1]) + " and " + names[-1]


def backend() -> str:
    """FLASH_ATTENTION_BACKEND: "" (unset), "triton" or "gluon"; ValueError for a value it cannot take."""
    choice = os.environ.get(BACKEND_VARIABLE, "")
    if choice not in ("", "triton", "gluon"):
        raise ValueError(f"{BACKEND_VARIABLE}={choice}: use triton or gluon (or leave it unset)")
    return choice


def deterministic() -> bool:
    """FLASH_ATTENTION_DETERMINISTIC as a bool; ValueError for a value it cannot take."""
    choice = os.environ.get(DETERMINISTIC_VARIABLE, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{DETERMINISTIC_VARIABLE}={choice}: use 1 (the default: the same gradients every run) or 0")
    return choice == "1"


def _gluon_wanted(seq_len: int) -> bool:
    """Whether the backend choice sends a call of seq_len queries to Gluon where it can run."""
    choice = backend()
    return choice == "gluon" or (choice == "" and seq_len >= hopper.MIN_SEQ)


def kernels_for(direction: str, signature: tuple, streamed: tuple) -> str:
    """"gluon" or "triton": the kernels that run this direction of these inputs (decided once per
    signature; streamed: the inputs read through TMA, q first). ValueError where
    FLASH_ATTENTION_BACKEND=gluon asks for the Hopper kernels and they cannot, or where the card
    cannot run the portable ones."""
    chosen = _CHOSEN.get((direction, signature))
    if chosen is None:
        q = streamed[0]
        T, D = q.shape[2:]
        chosen = "triton"
        if _gluon_wanted(T):
            why = unsupported(D, q.dtype, q.device, "gluon")
            if why is None and not inputs.uses_tma(*streamed):
                why = "the inputs need a contiguous head dim and 16-byte aligned strides (TMA)"
            if why is not None and backend() == "gluon":
                raise ValueError(f"{BACKEND_VARIABLE}=gluon: the Hopper {direction} cannot run these inputs: {why}")
            chosen = "triton" if why else "gluon"
        if chosen == "triton" and (why := unsupported(D, q.dtype, q.device)):
            raise ValueError(f"flash_attention: {why}")
        _CHOSEN[direction, signature] = chosen
    return chosen


def backends(head_dim: int, dtype: torch.dtype, device: torch.device, seq_len: int) -> dict[str, str]:
    """Which kernels run the forward and the backward of attention with this head dim, dtype,
    device and query length (with or without documents), for inputs laid out as the model lays
    them out (the run info logs it); ValueError for a FLASH_ATTENTION_BACKEND or
    FLASH_ATTENTION_DETERMINISTIC value it cannot take, or gluon where it cannot run."""
    deterministic()  # a bad value fails here, before training starts
    why = unsupported(head_dim, dtype, device, "gluon")
    if why is None:
        hopper.bwd_tiles(head_dim)  # and a backward tile choice this head dim does not have
    if why and backend() == "gluon":
        raise ValueError(f"{BACKEND_VARIABLE}=gluon: the Hopper kernels cannot run this model's attention: {why}")
    return {direction: "gluon" if why is None and _gluon_wanted(seq_len) else "triton"
            for direction in ("forward", "backward")}
