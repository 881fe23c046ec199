"""curves.png: a run's curves against the step, drawn from its own metrics.jsonl at the end of every
run (finished, stopped, failed or resumed), so it covers every step logged so far.

Three panels: the training and validation loss, tokens/s, and peak memory (CUDA: the allocator's
peak allocated and reserved GiB of each log interval; the CPU: the process's peak RSS). Drawn on a
bare matplotlib Figure, which renders with Agg and needs no display, and written whole
(data/files.py save_figure): a full disk leaves the previous curves.png, never half of one.
"""

import logging
import sys
from pathlib import Path

from data.files import WriteError, free_bytes, save_figure
from trainer.metrics import read_metrics
from trainer.rundir import RESERVE

CURVES_NAME = "curves.png"
# (metrics key, label) of the memory panel's lines: the ones a run logged
MEMORY = (("peak_mem_alloc_gib", "peak allocated (GPU)"), ("peak_mem_reserved_gib", "peak reserved (GPU)"),
          ("peak_rss_gib", "peak RSS (CPU)"))


def _line(ax, records: list[dict], key: str, label: str, **style) -> bool:
    """Plots records' `key` against their step; whether there was any value."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        ax.plot(*zip(*points), marker="o", markersize=3, label=label, **style)
    return bool(points)


def plot_curves(records: list[dict], path: Path, title: str) -> None:
    """The three panels of `records` (metrics.jsonl's), written to path."""
    from matplotlib.figure import Figure  # slow to import: only the end of a run pays for it

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font cache's INFO line in train.log
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    fig.suptitle(title, fontsize=10)
    panels = fig.subplots(1, 3)
    drawn = [_line(panels[0], records, "loss", "train") | _line(panels[0], records, "val_loss", "val"),
             _line(panels[1], records, "tokens_per_s", "tokens/s"),
             any([_line(panels[2], records, key, label) for key, label in MEMORY])]
    for ax, name, ylabel, any_line in zip(panels, ("loss", "throughput", "peak memory"), ("loss", "tokens/s", "GiB"),
                                          drawn):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if any_line:
            ax.legend(fontsize=8, loc="best" if ax is panels[0] else "lower right")  # rates and sizes: lines high up
        else:
            ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax, any_line in zip(panels[1:], drawn[1:]):
        if any_line:  # a rate and a size, from 0: small changes drawn at their scale
            ax.set_ylim(0, 1.1 * ax.dataLim.ymax)
    save_figure(fig, path)


def write_curves(run_dir: Path, title: str) -> Path | None:
    """Draws run_dir/curves.png; None where it is not drawn: on a disk without the room a run keeps
    for its records (the run has said so once already), or, in one line on stderr, where drawing
    fails. Its checkpoint and summary are written before it and stand either way."""
    path = Path(run_dir) / CURVES_NAME
    if free_bytes(path) < RESERVE:
        return None
    try:
        plot_curves(read_metrics(path.with_name("metrics.jsonl")), path, title)
    except WriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    except Exception as e:  # a plot is never worth a run's end: its summary and W&B run close as usual
        print(f"error: {path} was not drawn ({type(e).__name__}: {' '.join(str(e).split())[:150]})", file=sys.stderr)
        return None
    return path
