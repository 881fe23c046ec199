"""A script that is stopped while torch.compile builds its kernels (tests/test_script_stops.py):
inside scripts/stopping.py's stoppable, it compiles a function of 40 steps for the CPU, whose
kernels Inductor builds in a pool of compile threads, a C++ compiler process each. Prints
`compiling` first; a stop then must end it at once, not once every queued kernel is built.

    TORCHINDUCTOR_CACHE_DIR=NEW_DIR python tests/compile_stop_worker.py"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "2"  # a pool, with work queued, on any machine

from trainer.startup import startup  # noqa: E402

startup(__name__)

import torch  # noqa: E402

from scripts.stopping import stoppable  # noqa: E402


def steps(x: torch.Tensor) -> torch.Tensor:
    for i in range(40):  # the matmuls keep the pointwise ops from fusing into one kernel
        x = torch.sin(x) * (i + 1) + torch.cos(x @ x.T)
    return x


with stoppable("compile_stop_worker.py", lambda: "nothing kept"):
    print("compiling", flush=True)
    torch.compile(steps)(torch.randn(64, 64))
    print("compiled", flush=True)
