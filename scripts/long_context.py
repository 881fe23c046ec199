"""The longest sequence one GPU trains: a ladder of seq_len per attention and activation checkpointing.

For each attn x ac, seq_len doubles from --min until a step runs out of memory (recorded, and the
next cell goes on) or passes --max; each rung trains experiment=long_context (GPT-2-small shape,
one sequence per step, RoPE, chunked loss, dtype=auto: bf16 from compute capability 8.0) for 3
steps, 1 from 524,288 on where a step takes minutes. Every rung runs in this one process (a fresh
model and optimizer, the CUDA cache emptied between them). Autotuning is off
(FLASH_ATTENTION_AUTOTUNE=0): at these lengths one benchmark pass of every config would cost
minutes. Writes long_context.csv, .md and .png into --out; the plot's title names the precision.

    python scripts/long_context.py                               # naive, sdpa, triton x none, selective, full
    python scripts/long_context.py --attns triton --acs full --max 1048576
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

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

import train  # noqa: E402
from configs.runtime import precision, resolve_device  # noqa: E402
from configs.schema import AttnName, Checkpointing  # noqa: E402
from scripts.args import ArgumentParser, directory, fail, names, positive_int, require_cuda, train_config  # noqa: E402

FIELDS = ["attn", "ac", "seq_len", "status", "steps", "tokens_per_s", "step_s", "peak_mem_alloc_gib"]
TEXT_FIELDS = ("attn", "ac", "status")


def ladder(low: int, high: int) -> list[int]:
    """seq_len doubling from low, up to high."""
    return [low * 2**i for i in range((high // low).bit_length())]


def rung_config(attn: str, ac: str, seq_len: int, extra: list[str]) -> DictConfig:
    steps = 3 if seq_len < 524288 else 1
    return train_config(["experiment=long_context", f"attn={attn}", f"ac={ac}", f"seq_len={seq_len}",
                         f"max_steps={steps}", "wandb.mode=disabled", *extra])


def rung(cfg: DictConfig, out: Path) -> dict:
    attn, ac, seq_len = str(cfg.attn.name), str(cfg.ac), cfg.seq_len
    start = time.perf_counter()
    try:
        summary = train.train(cfg, out / f"{attn}_{ac}_T{seq_len}")
    except (train.ConfigError, train.DatasetError) as e:  # e.g. a split shorter than seq_len
        print(f"error: {e}")
        return {"attn": attn, "ac": ac, "seq_len": seq_len, "status": "error"}
    wall = time.perf_counter() - start
    tok_s = summary["mean_tokens_per_s"]
    return {"attn": attn, "ac": ac, "seq_len": seq_len, "status": summary["status"], "steps": summary["steps"],
            "tokens_per_s": tok_s, "step_s": seq_len / tok_s if tok_s else None,
            "peak_mem_alloc_gib": summary["peak_mem_alloc_gib"], "wall_s": wall}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def table(rows: list[dict], attns: list[str], acs: list[str]) -> str:
    lines = ["| attn | ac | longest seq_len | tokens/s there | step s | peak allocated GiB | first OOM |",
             "|---|---|--:|--:|--:|--:|--:|"]
    for attn in attns:
        for ac in acs:
            ok = [r for r in rows if (r["attn"], r["ac"], r["status"]) == (attn, ac, "ok")]
            oom = [r["seq_len"] for r in rows if (r["attn"], r["ac"], r["status"]) == (attn, ac, "oom")]
            best = max(ok, key=lambda r: r["seq_len"]) if ok else None
            cells = ([f"{best['seq_len']:,.0f}", f"{best['tokens_per_s']:,.0f}", f"{best['step_s']:.1f}",
                      f"{best['peak_mem_alloc_gib']:.1f}"] if best else ["—"] * 4)
            lines.append(f"| {attn} | {ac} | " + " | ".join(cells) + f" | {f'{oom[0]:,.0f}' if oom else '—'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, key in enumerate(sorted({(r["attn"], r["ac"]) for r in rows})):
        ok = sorted((r["seq_len"], r) for r in rows if (r["attn"], r["ac"]) == key and r["status"] == "ok")
        style = dict(marker="o", color=f"C{i}", label=f"{key[0]}, ac={key[1]}")
        if ok:
            axes[0].plot([t for t, _ in ok], [r["tokens_per_s"] for _, r in ok], **style)
            axes[1].plot([t for t, _ in ok], [r["peak_mem_alloc_gib"] for _, r in ok], **style)
    for ax, label in zip(axes, ("tokens/s", "peak allocated GiB")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="seq_len (one sequence per step)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GPT-2-small shape, one sequence per step, RoPE, chunked loss | {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
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
    missing = [k for k in FIELDS if k not in header]
    if missing or not records:
        bad("", "it is empty" if not header else f"no column {', '.join(missing)}" if missing else "no rows")
    rows = []
    for line, r in enumerate(records, start=2):
        row = {k: r[k] if k in TEXT_FIELDS else number(line, k, r[k]) for k in FIELDS}
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
    if args.from_csv:
        rows = read_rows(args.from_csv)
        args.out.mkdir(parents=True, exist_ok=True)
        write(rows, args.attns, args.acs, args.out, args.title)
        return
    seq_lens = ladder(args.min, args.max)
    # every rung's config checked before the first one trains, and before the GPU check
    configs = {(attn, ac, seq_len): rung_config(attn, ac, seq_len, args.overrides)
               for attn in args.attns for ac in args.acs for seq_len in seq_lens}
    require_cuda("long_context.py")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for attn in args.attns:
        for ac in args.acs:
            for seq_len in seq_lens:
                row = rung(configs[attn, ac, seq_len], args.out)
                free()
                rows.append(row)
                print(f"{attn:7s} ac={ac:9s} T={seq_len:>8,}: {row['status']}"
                      + (f", {row['tokens_per_s']:,.0f} tokens/s, {row['peak_mem_alloc_gib']:.1f} GiB"
                         if row["status"] == "ok" else ""), flush=True)
                if row["status"] != "ok":
                    break
    with open(args.out / "long_context.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)
    cfg = next(iter(configs.values()))  # every rung runs in the same precision
    write(rows, args.attns, args.acs, args.out, f"{torch.cuda.get_device_name()}, "
          f"{precision(cfg.dtype, resolve_device(cfg.device))}, torch {torch.__version__}")


def write(rows: list[dict], attns: list[str], acs: list[str], out: Path, title: str) -> None:
    md = table(rows, attns, acs)
    (out / "long_context.md").write_text(md + "\n")
    plot(rows, out / "long_context.png", title)
    print("\n" + md)


if __name__ == "__main__":
    main()
