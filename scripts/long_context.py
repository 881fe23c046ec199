"""The longest sequence one GPU trains: a ladder of seq_len per attention, activation checkpointing and MLP tiling.

For each attn x ac x model.mlp_chunk, seq_len doubles from --min until a rung fails or passes
--max. A failure (out of memory, a shape a kernel refuses, a kernel error) is recorded with its
one-line reason and the next setting goes on. Each rung trains experiment=long_context (GPT-2-small
shape, one sequence per step, RoPE, chunked loss, dtype=auto: bf16 from compute capability 8.0)
for 3 steps, 1 from 524,288 on where a step takes minutes. Every rung runs in this one process (a
fresh model and optimizer, the CUDA cache emptied between them). Autotuning is off
(FLASH_ATTENTION_AUTOTUNE=0): at these lengths one benchmark pass of every config would cost
minutes. Beside the table, a straight-line fit of each setting's peak memory against seq_len
predicts the longest sequence an 80 GB and a 141 GB card hold. Writes long_context.csv, .md and
.png into --out; the plot's title names the precision.

    python scripts/long_context.py                               # naive, sdpa, triton x every ac
    python scripts/long_context.py --attns triton,sdpa --acs full,offload --mlp-chunks 0,65536 --max 1048576
    python scripts/long_context.py --from-csv docs/long_context/long_context.csv --out docs/long_context --title ...
"""

import argparse
import csv
import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("FLASH_ATTENTION_AUTOTUNE", "0")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from configs.runtime import precision, resolve_device  # noqa: E402
from configs.schema import AttnName, Checkpointing  # noqa: E402
from scripts.args import (ArgumentParser, directory, fail, names, non_negative_ints, positive_int,  # noqa: E402
                          require_cuda, train_config)
from data.files import save_figure  # noqa: E402
from scripts.outputs import write_csv, write_text  # noqa: E402
from scripts.stopping import stoppable, trained  # noqa: E402

FIELDS = ["attn", "ac", "mlp_chunk", "seq_len", "status", "steps", "tokens_per_s", "step_s", "peak_mem_alloc_gib",
          "reason"]
TEXT_FIELDS = ("attn", "ac", "status", "reason")
OPTIONAL = {"mlp_chunk": 0.0, "reason": ""}  # columns a CSV of an older version of this script lacks
# allocated GiB a card leaves to tensors once the CUDA context and the allocator's slack are taken
CARDS = {"80 GB": 78.0, "141 GB": 139.0}


def ladder(low: int, high: int) -> list[int]:
    """seq_len doubling from low, up to high."""
    return [low * 2**i for i in range((high // low).bit_length())]


def rung_config(attn: str, ac: str, mlp_chunk: int, seq_len: int, extra: list[str]) -> DictConfig:
    steps = 3 if seq_len < 524288 else 1
    return train_config(["experiment=long_context", f"attn={attn}", f"ac={ac}", f"model.mlp_chunk={mlp_chunk}",
                         f"seq_len={seq_len}", f"max_steps={steps}", "wandb.mode=disabled", *extra])


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def rung(cfg: DictConfig, out: Path) -> dict:
    row = {"attn": str(cfg.attn.name), "ac": str(cfg.ac), "mlp_chunk": cfg.model.mlp_chunk, "seq_len": cfg.seq_len}
    start = time.perf_counter()
    try:
        summary = trained(cfg, out / f"{row['attn']}_{row['ac']}_mlp{row['mlp_chunk']}_T{row['seq_len']}")
    except Exception as e:  # a shape a kernel refuses, a kernel error, a split too short: the rung failed
        return {**row, "status": "oom" if isinstance(e, torch.OutOfMemoryError) else "error", "reason": one_line(e)}
    tok_s = summary["mean_tokens_per_s"]
    reason = "CUDA out of memory" if summary["status"] == "oom" else (summary["message"] or "")
    return {**row, "status": summary["status"], "steps": summary["steps"], "tokens_per_s": tok_s,
            "step_s": row["seq_len"] / tok_s if tok_s else None, "peak_mem_alloc_gib": summary["peak_mem_alloc_gib"],
            "reason": reason, "wall_s": time.perf_counter() - start}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


Setting = tuple[str, str, int]  # attn, ac, model.mlp_chunk


def settings(rows: list[dict]) -> list[Setting]:
    return list(dict.fromkeys((r["attn"], r["ac"], r["mlp_chunk"]) for r in rows))


def label(setting: Setting) -> str:
    attn, ac, mlp_chunk = setting
    return f"{attn}, ac={ac}" + (f", mlp_chunk={mlp_chunk:,}" if mlp_chunk else "")


def of(rows: list[dict], setting: Setting, status: str | None = None) -> list[dict]:
    return sorted((r for r in rows if (r["attn"], r["ac"], r["mlp_chunk"]) == setting
                   and (status is None or r["status"] == status)), key=lambda r: r["seq_len"])


def table(rows: list[dict]) -> str:
    lines = ["| attn | ac | mlp_chunk | longest seq_len | tokens/s there | step s | peak allocated GiB | first failure |",
             "|---|---|--:|--:|--:|--:|--:|---|"]
    for setting in settings(rows):
        ok, failed = of(rows, setting, "ok"), [r for r in of(rows, setting) if r["status"] != "ok"]
        best = ok[-1] if ok else None
        cells = ([f"{best['seq_len']:,.0f}", f"{best['tokens_per_s']:,.0f}", f"{best['step_s']:.1f}",
                  f"{best['peak_mem_alloc_gib']:.1f}"] if best else ["—"] * 4)
        failure = (f"{failed[0]['seq_len']:,.0f}: {failed[0]['reason'] or failed[0]['status']}".replace("|", "/")
                   if failed else "—")
        attn, ac, mlp_chunk = setting
        lines.append(f"| {attn} | {ac} | {mlp_chunk or '—'} | " + " | ".join(cells) + f" | {failure} |")
    return "\n".join(lines)


def fit(rows: list[dict]) -> dict[Setting, tuple[float, float]]:
    """(fixed GiB, GiB per token) of each setting with two or more rungs that ran: least squares
    of peak allocated memory against seq_len (activations grow linearly in it; weights and
    optimizer state do not)."""
    fits = {}
    for setting in settings(rows):
        ok = of(rows, setting, "ok")
        if len(ok) >= 2:
            t = torch.tensor([r["seq_len"] for r in ok], dtype=torch.float64)
            gib = torch.tensor([r["peak_mem_alloc_gib"] for r in ok], dtype=torch.float64)
            slope, fixed = torch.linalg.lstsq(torch.stack([t, torch.ones_like(t)], 1), gib[:, None]).solution[:, 0]
            fits[setting] = (fixed.item(), slope.item())
    return fits


def fit_table(rows: list[dict]) -> str:
    cards = list(CARDS)
    lines = ["| setting | fixed GiB | GiB per 2^20 tokens | largest fit residual GiB | "
             + " | ".join(f"longest on {c} ({CARDS[c]:.0f} GiB)" for c in cards) + " |",
             "|---|--:|--:|--:|" + "--:|" * len(cards)]
    for setting, (fixed, per_token) in fit(rows).items():
        residual = max(abs(r["peak_mem_alloc_gib"] - fixed - per_token * r["seq_len"]) for r in of(rows, setting, "ok"))
        longest = [f"{(CARDS[c] - fixed) / per_token:,.0f}" if per_token > 0 else "—" for c in cards]
        lines.append(f"| {label(setting)} | {fixed:.2f} | {per_token * 2**20:.2f} | {residual:.2f} | "
                     + " | ".join(longest) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, setting in enumerate(settings(rows)):
        ok = of(rows, setting, "ok")
        style = dict(marker="o", color=f"C{i % 10}", label=label(setting))
        if ok:
            axes[0].plot([r["seq_len"] for r in ok], [r["tokens_per_s"] for r in ok], **style)
            axes[1].plot([r["seq_len"] for r in ok], [r["peak_mem_alloc_gib"] for r in ok], **style)
    for ax, ylabel in zip(axes, ("tokens/s", "peak allocated GiB")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="seq_len (one sequence per step)", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GPT-2-small shape, one sequence per step, RoPE, chunked loss | {title}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def read_rows(path: Path) -> list[dict]:
    """The rows of a long_context.csv this script wrote (numbers as floats); one line and exit 2 for
    anything else."""
    def bad(where: str, problem: str):
        fail(f"--from-csv {path}{where}: {problem}: pass a long_context.csv written by this script "
             f"(columns {','.join(FIELDS)})")

    def number(line: int, key: str, value: str | None) -> float | None:
        try:
            return float(value) if value else None
        except ValueError:
            bad(f", line {line}", f"{key}={value!r} is not a number")

    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header, records = reader.fieldnames or [], list(reader)
    except OSError as e:
        bad("", e.strerror)
    except (UnicodeDecodeError, csv.Error) as e:
        bad("", f"not CSV text ({e})")
    missing = [k for k in FIELDS if k not in header and k not in OPTIONAL]
    if missing or not records:
        bad("", "it is empty" if not header else f"no column {', '.join(missing)}" if missing else "no rows")
    rows = []
    for line, r in enumerate(records, start=2):
        row = {k: (r[k] if k in TEXT_FIELDS else number(line, k, r[k])) if k in r else OPTIONAL[k] for k in FIELDS}
        row["mlp_chunk"] = int(row["mlp_chunk"] or 0)
        needed = ["seq_len"] + (["tokens_per_s", "step_s", "peak_mem_alloc_gib"] if row["status"] == "ok" else [])
        empty = [k for k in needed if row[k] is None]
        if empty:
            bad(f", line {line}", f"{empty[0]} is empty, and status {row['status']!r} needs it")
        rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    attns, acs = [a.value for a in AttnName], [c.value for c in Checkpointing]
    p.add_argument("--attns", type=names(attns), default=attns, help=f"comma subset of {','.join(attns)}")
    p.add_argument("--acs", type=names(acs), default=acs,
                   help=f"comma subset of {','.join(acs)} (activation checkpointing)")
    p.add_argument("--mlp-chunks", type=non_negative_ints, default=[0],
                   help="comma list of model.mlp_chunk values (0: the MLP untiled), e.g. 0,65536")
    p.add_argument("--min", type=positive_int, default=8192, help="the first seq_len of each ladder")
    p.add_argument("--max", type=positive_int, default=1048576, help="no seq_len beyond this")
    p.add_argument("--out", type=directory, default=f"bench/long_context_{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                   help="a new folder: each rung trains into a run dir of its own there")
    p.add_argument("--from-csv", type=Path, help="no training: table and plot of the rows in this CSV")
    p.add_argument("--title", default="", help="with --from-csv: where the rows were measured (GPU, precision, torch)")
    p.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. model.loss_chunk=2048")
    args = p.parse_args()
    if args.min > args.max:
        p.error(f"argument --min: {args.min} exceeds --max {args.max}: the ladder would be empty")
    return args


def main():
    args = parse_args()
    rows = []
    # a stop keeps the rungs measured before it in long_context.csv; the one in flight is left out
    with stoppable("long_context.py", lambda: f"{len(rows)} rungs measured before it are in "
                                              f"{args.out / 'long_context.csv'}" if rows else "no rung was measured"):
        ladders(args, rows)


def ladders(args: argparse.Namespace, rows: list[dict]) -> None:
    """Runs every ladder, appending each rung's row to rows (with --from-csv: writes the CSV's)."""
    if args.from_csv:
        read = read_rows(args.from_csv)
        args.out.mkdir(parents=True, exist_ok=True)
        write(read, args.out, args.title)
        return
    seq_lens = ladder(args.min, args.max)
    grid = [(attn, ac, chunk) for attn in args.attns for ac in args.acs for chunk in args.mlp_chunks]
    # every rung's config checked before the first one trains, and before the GPU check
    configs = {(*setting, seq_len): rung_config(*setting, seq_len, args.overrides)
               for setting in grid for seq_len in seq_lens}
    require_cuda("long_context.py")
    args.out.mkdir(parents=True, exist_ok=True)
    for setting in grid:
        for seq_len in seq_lens:
            row = rung(configs[(*setting, seq_len)], args.out)
            free()
            rows.append(row)
            print(f"{label(setting)} T={seq_len:,}: {row['status']}"
                  + (f", {row['tokens_per_s']:,.0f} tokens/s, {row['peak_mem_alloc_gib']:.1f} GiB"
                     if row["status"] == "ok" else f" ({row['reason']})"), flush=True)
            # rewritten after each rung
            write_csv(args.out / "long_context.csv", rows, FIELDS)
            if row["status"] != "ok":
                break
    cfg = next(iter(configs.values()))  # every rung runs in the same precision
    write(rows, args.out, f"{torch.cuda.get_device_name()}, "
          f"{precision(cfg.dtype, resolve_device(cfg.device))}, torch {torch.__version__}")


def write(rows: list[dict], out: Path, title: str) -> None:
    md = table(rows) + "\n\nPeak allocated memory against seq_len, fitted per setting:\n\n" + fit_table(rows)
    write_text(out / "long_context.md", md + "\n")
    plot(rows, out / "long_context.png", title)
    print("\n" + md)


if __name__ == "__main__":
    main()
