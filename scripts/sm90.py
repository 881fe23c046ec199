"""Compile the Hopper kernels for an H100 (sm_90) on a machine without one.

Triton asks its active driver which GPU it compiles for; kernels/runtime/internals.py's stand-in
answers sm_90 and launches nothing, so `kernel.warmup(...)` runs the whole compiler (Gluon ->
TTGIR -> PTX -> ptxas) and returns the cubin, its register and shared-memory counts, and SASS
through the wheel's nvdisasm. CI compiles the Hopper kernels this way (tests/test_hopper.py), and
it is how to read a kernel's SASS without spending GPU time:

    python scripts/sm90.py            # registers, spills, shared memory of each Hopper kernel
    python scripts/sm90.py --sass     # and their SASS, beside the cubins under bench/sass/
    python scripts/sm90.py --head-dims 64  # one head dim's kernels
"""

import argparse
import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
import torch  # noqa: E402
import triton  # noqa: E402

from kernels.runtime.internals import stand_in  # noqa: E402

MASKS = ("full", "causal", "documents")  # documents: causal within packed documents (windows: the same kernels)
SEQ = 4096  # T = S of the compiled inputs: the forward's tiles of long sequences


def compile_hopper(direction: str, head_dim: int, dtype: torch.dtype, mask: str):
    """The compiled forward or backward kernel for one configuration, at SEQ keys and queries
    (compiled in a fresh Triton cache key only when its source or options changed)."""
    from kernels.hopper import bwd, fwd

    B, H, H_kv = 1, 2, 1
    q, do = (torch.empty(B, SEQ, H, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.empty(B, SEQ, H_kv, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))
    causal, documents = mask != "full", mask == "documents"
    with stand_in():
        if direction == "fwd":
            return fwd.compile_only(q, k, v, causal, documents)
        return bwd.compile_only(do, q, k, v, causal, documents)


def kernels(head_dims) -> list[tuple[str, int, str]]:
    """(direction, head dim, mask) of every kernel the rows of these head dims run (a row's backward
    order follows its mask, not the length)."""
    return [(direction, D, mask) for direction in ("fwd", "bwd") for D in head_dims for mask in MASKS]


def _tool(name: str) -> str:
    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def main() -> None:
    from kernels.hopper.config import HEAD_DIMS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="write each kernel's SASS under --out")
    parser.add_argument("--out", default="bench/sass")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="comma list (default: all)")
    args = parser.parse_args()
    head_dims = args.head_dims.split(",")
    if not set(head_dims) <= set(map(str, HEAD_DIMS)):
        parser.error(f"--head-dims {args.head_dims}: the Hopper kernels have head dims {', '.join(map(str, HEAD_DIMS))}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for direction, head_dim, mask in kernels(list(map(int, head_dims))):
        kernel = compile_hopper(direction, head_dim, torch.bfloat16, mask)
        name = f"{direction}_d{head_dim}_{mask}"
        cubin = out / f"{name}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = re.search(r"REG:(\d+) STACK:(\d+)", _run(_tool("cuobjdump"), "-res-usage", str(cubin)))
        sass = _run(_tool("nvdisasm"), "-c", str(cubin))
        if args.sass:
            (out / f"{name}.sass").write_text(sass)
        print(f"{name}: {usage[1]} registers, {usage[2]} B stack (spills), {kernel.metadata.shared} B shared, "
              f"{sass.count('HGMMA')} HGMMA")


if __name__ == "__main__":
    main()
