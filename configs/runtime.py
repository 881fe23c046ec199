"""What a config's device, dtype, SDPA backend and W&B mode mean on this machine: one answer for
train.py and every script."""

import base64
import contextlib
import json
import netrc
import os
import re
import resource
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.runtime.chips import BF16_MIN_CAPABILITY  # bf16 autocast only where our kernels' bf16 runs


def resolve_device(device: str) -> torch.device:
    """auto | cpu | cuda | cuda:N -> torch.device; ValueError naming what this machine has."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError("choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError("this machine has no CUDA GPU (torch.cuda.is_available() is False): use device=cpu")
    if device != "cuda" and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(device)


def out_of_memory(e: BaseException) -> bool:
    """Whether e is memory running out: torch's OutOfMemoryError (a GPU's allocator), MemoryError
    (numpy's, Python's), or torch's CPU allocator failing, which torch raises as a bare RuntimeError
    whose only mark is its text, ending in the errno ENOMEM ("Error code 12")."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return type(e) is RuntimeError and "DefaultCPUAllocator" in str(e)


def _meminfo_kib(path: str, key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", open(path).read(), re.MULTILINE)[1])


@contextlib.contextmanager
def memory_cap(device: str) -> Iterator[None]:
    """On the CPU (Linux), caps this process's heap and private memory (RLIMIT_DATA) at what it uses
    plus what the machine has available as the run starts: a batch too big then fails to allocate,
    which out_of_memory() recognizes and the run reports in one line, where Linux would let the
    allocations through and its OOM killer end the process without a word (exit 137). The limit
    is put back as it was afterwards; a GPU device is left alone (its driver maps far more than it
    uses; a device that does not resolve is validate()'s to report)."""
    try:
        on_cpu = resolve_device(device).type == "cpu"
    except ValueError:
        on_cpu = False
    if not on_cpu or sys.platform != "linux":
        yield
        return
    before = resource.getrlimit(resource.RLIMIT_DATA)
    cap = (_meminfo_kib("/proc/self/status", "VmData") + _meminfo_kib("/proc/meminfo", "MemAvailable")) * 1024
    if before[0] != resource.RLIM_INFINITY:
        cap = min(cap, before[0])
    if before[1] != resource.RLIM_INFINITY:
        cap = min(cap, before[1])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast policy: the dtype forward passes run in, None for fp32. dtype=auto: bf16 on a
    CUDA GPU of compute capability >= 8.0, fp16 (with loss scaling: grad_scaler) on an older one,
    fp32 on the CPU. ValueError for dtype=bfloat16 on a GPU below 8.0."""
    if dtype == "float32" or (dtype == "auto" and device.type != "cuda"):
        return None
    if dtype == "float16":
        return torch.float16
    if device.type != "cuda":  # dtype=bfloat16 on the CPU
        return torch.bfloat16
    capability = torch.cuda.get_device_capability(device)
    if capability >= BF16_MIN_CAPABILITY:
        return torch.bfloat16
    if dtype == "bfloat16":
        raise ValueError(f"needs a GPU of compute capability {_version(BF16_MIN_CAPABILITY)} or newer (bf16 tensor "
                         f"cores); {device} is {_version(capability)}: use dtype=float16 or auto")
    return torch.float16


def fsdp_param_dtype(param_dtype: str, dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP gathers the blocks' weights in, None for fp32 (as stored). param_dtype=auto:
    the autocast dtype on CUDA, whose autocast runs LayerNorm in fp32 whatever its gains' dtype;
    fp32 on the CPU, whose LayerNorm takes no fp32 input with bf16 gains."""
    return autocast_dtype(dtype, device) if param_dtype == "auto" and device.type == "cuda" else None


def _version(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


def precision(dtype: str, device: torch.device) -> str:
    """The name of what forward passes run in: float32, bfloat16 or float16."""
    return str(autocast_dtype(dtype, device) or torch.float32).removeprefix("torch.")


def precision_line(dtype: str, device: torch.device) -> str:
    """What dtype means here, and why, for a run's first lines: 'dtype=auto: bfloat16 (CUDA capability 9.0)'."""
    why = f"CUDA capability {_version(torch.cuda.get_device_capability(device))}" if device.type == "cuda" else "CPU"
    name = precision(dtype, device)
    return f"dtype={dtype}: {name} ({why}{', dynamic loss scaling' if name == 'float16' else ''})"


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """The context that forward passes run under (a fresh one each call: it is single-use)."""
    amp = autocast_dtype(dtype, device)
    return torch.autocast(device.type, dtype=amp) if amp else nullcontext()


def grad_scaler(dtype: str, device: torch.device) -> torch.amp.GradScaler:
    """The loss scaler of a run: on under fp16 autocast, whose 5 exponent bits flush gradients below
    6e-8 to zero (bf16 has fp32's 8 and needs none); disabled, every call is a no-op."""
    return torch.amp.GradScaler(device.type, enabled=autocast_dtype(dtype, device) == torch.float16)


SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_backend(name: str | None) -> AbstractContextManager:
    """A fresh context pinning SDPA to backend `name` (nullcontext for None): the contexts are single-use."""
    return nullcontext() if name is None else sdpa_kernel(SDPA_BACKENDS[name])


def sdpa_backend_in_use(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None = None,
                        masked: bool = False) -> str:
    """The SDPA backend (a key of SDPA_BACKENDS) torch dispatches these inputs to, pinned to
    `backend` if given, as model/attention.py's sdpa_attention calls it (masked: with the dense
    document mask); RuntimeError if that backend cannot run them."""
    B, _, T, _ = q.shape
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device).expand(B, 1, T, T) if masked else None
    with sdpa_backend(backend):
        # torch's own dispatcher choice (private API: there is no public one); same rules as the real call
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, not masked,
                                                    enable_gqa=k.size(1) != q.size(1)))
    return next(name for name, b in SDPA_BACKENDS.items() if b == choice)


def probe_sdpa_backend(seq_len: int, n_head: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                       backend: str | None = None, masked: bool = False, n_kv_head: int = 0) -> str:
    """sdpa_backend_in_use for the model's own inputs: strided views of one (B, T, H + 2 H_kv, D)
    projection (n_kv_head 0: H_kv = H), for one sequence (torch's choice does not depend on the
    batch, which need not fit in memory here)."""
    H, H_kv = n_head, n_kv_head or n_head
    qkv = torch.empty(1, seq_len, H + 2 * H_kv, head_dim, device=device, dtype=dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, H_kv, H_kv], dim=2))
    return sdpa_backend_in_use(q, k, v, backend=backend, masked=masked)


# WANDB_MODE's values, W&B's old names included
_WANDB_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "run": "online", "dryrun": "offline"}


def wandb_mode(mode: str | None) -> str:
    """wandb.mode if set (the command line wins), else WANDB_MODE from the environment, else offline;
    ValueError for a WANDB_MODE that is none of them."""
    if mode is not None:
        return str(mode)
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env and env not in _WANDB_MODES:
        raise ValueError(f"choose one of {', '.join(_WANDB_MODES)}")
    return _WANDB_MODES.get(env, "offline")


def wandb_online_problem(timeout: float = 5.0) -> str | None:
    """Why W&B cannot log online from this machine now, or None: no API key, or its server not
    reachable or refusing the key within `timeout` seconds (one request, as W&B's login makes)."""
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/")
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        try:
            key = (netrc.netrc(os.environ.get("NETRC")).authenticators(urlparse(base).hostname or "") or (0, 0, 0))[2]
        except (OSError, netrc.NetrcParseError):
            key = None
    if not key and not os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "no W&B API key (set WANDB_API_KEY, or run `wandb login`)"
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Basic " + base64.b64encode(f"api:{key}".encode()).decode()
    try:
        request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": "{ viewer { id } }"}).encode(),
                                         headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.load(response)
        # GraphQL says an error with "data": null
        viewer = (answer.get("data") or {}).get("viewer") if isinstance(answer, dict) else None
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return f"{base} refused the API key (HTTP {e.code})"
        return f"{base} answered HTTP {e.code}"
    except (OSError, ValueError) as e:  # not a URL; no network, DNS, refused, timed out; not JSON
        reason = getattr(e, "reason", e)
        return f"{base} cannot be reached ({type(reason).__name__}: {str(reason)[:80]})"
    if key and not viewer:
        return f"{base} does not accept the API key"
    return None
