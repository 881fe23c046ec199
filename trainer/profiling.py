"""profile=true: a torch.profiler trace of a few steady steps, and on CUDA a memory snapshot.

Written into the run dir: `profile/trace.json` (Chrome trace format: open it in Perfetto,
ui.perfetto.dev, or chrome://tracing) covers steps 3-5 of the run (the first two hold
compilation and Triton's autotuning; the second is the profiler's warmup); on CUDA
`profile/memory_snapshot.pickle` records every allocation with its stack from the first step to
the last profiled one (drag it into pytorch.org/memory_viz, or turn it into HTML with
`python -m torch.cuda._memory_viz trace_plot profile/memory_snapshot.pickle -o memory.html`).
Each file is written whole or not at all (data/files.py); one that does not fit fails the run in
one line, as any full disk does.
"""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from data.files import atomic_path

WAIT, WARMUP, ACTIVE = 1, 1, 3  # steps skipped, warmed up (not recorded), recorded
MEMORY_EVENTS = 100_000  # allocations the snapshot keeps (the latest ones)


class Profiler:
    """Call step() after each training step; the files are written once the window has passed."""

    def __init__(self, out_dir: Path, device: torch.device):
        self.out_dir, self.device = Path(out_dir), device
        self.out_dir.mkdir(exist_ok=True)
        self.steps = 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities, schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
                            on_trace_ready=self._write_trace, record_shapes=True, with_stack=True)
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        self.prof.start()

    @property
    def done(self) -> bool:
        return self.steps >= WAIT + WARMUP + ACTIVE

    def step(self) -> None:
        if self.done:
            return
        self.steps += 1
        self.prof.step()
        if self.done:
            self.close()

    def close(self) -> None:
        """Stops recording (also for a run shorter than the window: what it recorded is written)."""
        if self.prof is None:
            return
        self.prof.stop()
        self.prof = None
        if self.device.type == "cuda":
            with atomic_path(self.out_dir / "memory_snapshot.pickle") as tmp:
                torch.cuda.memory._dump_snapshot(str(tmp))
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write_trace(self, prof) -> None:
        with atomic_path(self.out_dir / "trace.json") as tmp:
            prof.export_chrome_trace(str(tmp))
