"""The longest sequence one GPU trains: a ladder of seq_len per attention and activation checkpointing.

For each attn x ac, seq_len doubles from --min until a step runs out of memory (recorded, and the
next cell goes on) or passes --max; each rung trains experiment=long_context (GPT-2-small shape,
one sequence per step, RoPE, chunked loss, bf16) for 3 steps, 1 from 524,288 on where a step takes
minutes. Every rung runs in this one process (a fresh model and optimizer, the CUDA cache emptied
between them). Autotuning is off (FLASH_ATTENTION_AUTOTUNE=0): at these lengths one benchmark
pass of every config would cost minutes. Writes long_context.csv, .md and .png into --out.

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
from hydra import compose, initialize_config_dir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages

import train  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FIELDS = ["attn", "ac", "seq_len", "status", "steps", "tokens_per_s", "step_s", "peak_mem_alloc_gib"]


def rung(attn: str, ac: str, seq_len: int, out: Path, extra: list[str]) -> dict:
    steps = 3 if seq_len < 524288 else 1
    overrides = ["experiment=long_context", f"attn={attn}", f"ac={ac}", f"seq_len={seq_len}", f"max_steps={steps}",
                 "wandb.mode=disabled", *extra]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
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
    fig.suptitle(f"GPT-2-small shape, one sequence per step, bf16, RoPE, chunked loss | {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attns", default="naive,sdpa,triton")
    p.add_argument("--acs", default="none,selective,full")
    p.add_argument("--min", type=int, default=8192)
    p.add_argument("--max", type=int, default=1048576)
    p.add_argument("--out", type=Path, default=Path("bench") / f"long_context_{time.strftime('%Y-%m-%d_%H-%M-%S')}",
                   help="a new folder: each rung trains into a run dir of its own there")
    p.add_argument("--from-csv", type=Path, help="no training: table and plot of the rows in this CSV")
    p.add_argument("--title", default="", help="with --from-csv: where the rows were measured")
    p.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. model.loss_chunk=2048")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    attns, acs = args.attns.split(","), args.acs.split(",")
    if args.from_csv:
        with open(args.from_csv) as f:
            rows = [{k: (v if k in ("attn", "ac", "status") else float(v) if v else None) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        write(rows, attns, acs, args.out, args.title)
        return
    if not torch.cuda.is_available():
        sys.exit("long_context needs a CUDA GPU")
    rows = []
    for attn in attns:
        for ac in acs:
            seq_len = args.min
            while seq_len <= args.max:
                row = rung(attn, ac, seq_len, args.out, args.overrides)
                free()
                rows.append(row)
                print(f"{attn:7s} ac={ac:9s} T={seq_len:>8,}: {row['status']}"
                      + (f", {row['tokens_per_s']:,.0f} tokens/s, {row['peak_mem_alloc_gib']:.1f} GiB"
                         if row["status"] == "ok" else ""), flush=True)
                if row["status"] != "ok":
                    break
                seq_len *= 2
    with open(args.out / "long_context.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore", restval="")
        writer.writeheader()
        writer.writerows(rows)
    write(rows, attns, acs, args.out, f"{torch.cuda.get_device_name()}, torch {torch.__version__}")


def write(rows: list[dict], attns: list[str], acs: list[str], out: Path, title: str) -> None:
    md = table(rows, attns, acs)
    (out / "long_context.md").write_text(md + "\n")
    plot(rows, out / "long_context.png", title)
    print("\n" + md)


if __name__ == "__main__":
    main()
