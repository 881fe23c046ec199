"""Turns an ablation sweep's runs, or single runs side by side, into a table (Markdown, CSV) and plots,
from the local files alone.

    python train.py -m experiment=sweep                              # writes multirun/<date>/<time>/
    python scripts/sweep_summary.py multirun/<date>/<time> [--out DIR]
    python train.py attn=naive; python train.py attn=sdpa           # each writes outputs/<date>/<run>/
    python scripts/sweep_summary.py outputs/<date>/*_naive_T256 outputs/<date>/*_sdpa_T256 --out compare

Reads every Hydra job under a sweep directory, and every run directory named (`.hydra/config.yaml`
for the setting: attn, attn.window, model.n_kv_head, seq_len and the attention modifications;
`metrics.jsonl` for the curves, `summary.json` for the outcome) and writes, into --out (default: the
one directory named):
- summary.csv: one row per job, raw numbers;
- summary.md:  the same rows sorted by seq_len then setting, and tokens/s pivoted seq_len x setting
               (a setting: the attention, with its window and key/value heads where not the default,
               and the modifications that are on: softcap C, alibi, sinks, prefix P, per-layer
               windows W=[...], window warm-up; e.g. `triton W=[1024,1024,1024,0] warmup=40`);
- sweep.png:   tokens/s (from zero) and peak allocated GPU memory (on the CPU, peak RSS) against
               seq_len, one line per setting, out-of-memory jobs marked with an x on the axis;
- losses.png:  every job's training (solid) and validation (dashed, dots) loss against the step, each
               labelled by the config keys in which the runs differ (attn=naive, attn=sdpa, ...), and
               beside them each job's loss minus the first job's, where curves on top of each other part;
- ablation.png: per setting (and seq_len, where the jobs have several), side by side: its loss
               curves (training solid, validation dashed with dots), its tokens/s and its peak
               allocated GPU memory as bars (on the CPU, which records no GPU memory, peak RSS).
No network and no W&B: the same numbers are in W&B, grouped by sweep, but this works offline.

tokens/s and MFU are means over the logged intervals after the first, which holds warmup,
Triton autotuning and compilation (train.py's summary.json uses the same rule); peak memory is the
maximum over those intervals too (see job_row for why). Reserved memory in a multirun also keeps
the blocks that earlier jobs in the same process left in PyTorch's cache: the plot shows allocated.
status: ok (finished), oom (ran out of GPU memory; the sweep went on), diverged (NaN/inf loss
or gradient), skipped (its config cannot run: the reason is listed under the table), failed
(crashed, was killed or is still running: no summary.json and no OOM record).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from matplotlib import ticker  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from data.files import save_figure  # noqa: E402
from trainer.metrics import read_metrics, steady  # noqa: E402
from scripts.args import ArgumentParser, directory, fail, unwritable  # noqa: E402
from scripts.outputs import write_csv, write_text  # noqa: E402
from scripts.stopping import stoppable  # noqa: E402

COLUMNS = ["attn", "window", "n_kv_head", "mods", "seq_len", "status", "steps", "tokens_per_s", "mfu",
           "peak_mem_alloc_gib", "peak_mem_reserved_gib", "peak_rss_gib", "final_loss", "final_val_loss", "device",
           "message"]
PEAKS = ("peak_mem_alloc_gib", "peak_mem_reserved_gib", "peak_rss_gib")  # GPU allocator's; the CPU process's RSS
# what train.py writes: a number (or null, for a non-finite one) under these keys of a metrics record
NUMBERS = ("loss", "val_loss", "tokens_per_s", "mfu", *PEAKS)
# config keys that name or place a run rather than set what it trains: not what tells runs apart
NOT_SETTINGS = ("resume", "wandb.")
STATUSES = ("ok", "oom", "diverged", "failed", "skipped", "stopped")
# the modifications an ablation turns on (configs/ablate/), by config key: how a setting names each
MODS = {"attn.softcap": lambda c: f"softcap={c:g}", "attn.alibi": lambda _: "alibi", "attn.sinks": lambda _: "sinks",
        "attn.prefix": lambda p: f"prefix={p}", "model.window_pattern": lambda w: f"W=[{','.join(map(str, w))}]",
        "attn.window_warmup": lambda n: f"warmup={n}"}


class SweepError(ValueError):
    """A sweep dir, or a job file in it, that is not what train.py writes; the message names the file."""


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def flat(node, prefix: str = "") -> dict:
    """A config's leaves by dotted key: {"attn.name": "sdpa", "seq_len": 256, ...}."""
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()} if node else {}


def job_config(path: Path) -> tuple[str, int, int, int, dict]:
    """(attn, seq_len, attn.window, model.n_kv_head, every key flat) from a job's .hydra/config.yaml
    (a config from before window and n_kv_head existed: 0, their default)."""
    try:
        cfg = OmegaConf.load(path)
        keys = {k.rstrip("."): v for k, v in flat(OmegaConf.to_container(cfg)).items()}
        attn, seq_len, window, n_kv_head = (
            OmegaConf.select(cfg, key, default=default) if isinstance(cfg, DictConfig) else None
            for key, default in (("attn.name", None), ("seq_len", None), ("attn.window", 0), ("model.n_kv_head", 0)))
    except OSError as e:
        raise SweepError(f"{path}: {e.strerror}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise SweepError(f"{path} is not a readable YAML config ({_one_line(e)[:150]})") from None
    if not isinstance(attn, str) or not _is_int(seq_len):
        raise SweepError(f"{path} holds attn.name={attn!r}, seq_len={seq_len!r}: a train.py job's config has a string "
                         "attn.name and an integer seq_len")
    for key, value in (("attn.window", window), ("model.n_kv_head", n_kv_head)):
        if not _is_int(value) or value < 0:
            raise SweepError(f"{path} holds {key}={value!r}: a train.py job's config has an integer >= 0 there")
    return attn, seq_len, window, n_kv_head, keys


def label_differences(rows: list[dict]) -> None:
    """Sets each row's label: the settings in which the rows differ (attn=naive, seq_len=512), or its
    directory's name where they differ in none."""
    keys = sorted({k for r in rows for k in r["config"] if not k.startswith(NOT_SETTINGS)})
    differ = [k for k in keys if len({repr(r["config"].get(k)) for r in rows}) > 1]
    for r in rows:
        said = [f"{k.removesuffix('.name')}={r['config'].get(k)}" for k in differ]
        r["label"] = ", ".join(said) or r["dir"].name


def modifications(config: dict) -> str:
    """The modifications a job's config turns on, in a label ("softcap=30 alibi"; "" for none)."""
    return " ".join(name(config[key]) for key, name in MODS.items() if config.get(key))


def setting(row: dict) -> str:
    """What a job ablates, in a label: the attention, its window and key/value heads if set, and the
    modifications that are on (naive W=8 kv=1, triton softcap=30, triton W=[1024,0] warmup=40)."""
    return " ".join(filter(None, (row["attn"], row["window"] and f"W={row['window']}",
                                  row["n_kv_head"] and f"kv={row['n_kv_head']}", row["mods"])))


def job_records(path: Path) -> list[dict]:
    """A job's metrics.jsonl records (none if it has none), each checked to be one that train.py writes."""
    try:
        records = read_metrics(path)
    except OSError as e:
        raise SweepError(f"{path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SweepError(f"{path} is not UTF-8 text") from None
    except ValueError as e:  # a line before the last that is not JSON; the message names the file and line
        raise SweepError(str(e)) from None
    for line, r in enumerate(records, start=1):
        if not isinstance(r, dict) or not _is_int(r.get("step")):
            raise SweepError(f"{path}, line {line}: {json.dumps(r)[:80]} is not a train.py metrics record "
                             "(a JSON object with an integer step)")
        wrong = next((k for k in NUMBERS if r.get(k) is not None and not _is_number(r[k])), None)
        if wrong:
            raise SweepError(f"{path}, line {line}: {wrong}={r[wrong]!r} is not a number")
    return records


def job_summary(path: Path) -> dict:
    """A job's summary.json ({} if it wrote none: it crashed, or is still running)."""
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text())
    except OSError as e:
        raise SweepError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise SweepError(f"{path} is not JSON ({_one_line(e)[:100]})") from None
    if not isinstance(summary, dict) or summary.get("status") not in STATUSES:
        raise SweepError(f"{path} holds {json.dumps(summary)[:80]}: a train.py summary is a JSON object whose "
                         f"status is one of {', '.join(STATUSES)}")
    if not _is_int(summary.get("steps", 0)):
        raise SweepError(f"{path}: steps={summary['steps']!r} is not an integer")
    for key in ("device", "message"):
        if not isinstance(summary.get(key), (str, type(None))):
            raise SweepError(f"{path}: {key}={summary[key]!r} is not a string")
    return summary


def job_row(job: Path) -> dict:
    """One sweep job's row: what it ran (its Hydra config) and how it went (its metrics)."""
    attn, seq_len, window, n_kv_head, config = job_config(job / ".hydra" / "config.yaml")
    records = job_records(job / "metrics.jsonl")
    summary = job_summary(job / "summary.json")
    train = [r for r in records if "loss" in r]
    steady_train = steady(train)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    if summary:
        status = summary["status"]
    else:
        status = "oom" if any(r.get("event") == "oom" for r in records) else "failed"
    peaks = {k: max((r[k] for r in steady_train if r.get(k) is not None), default=None) for k in PEAKS}
    return {"attn": attn, "window": window, "n_kv_head": n_kv_head, "mods": modifications(config),
            "seq_len": seq_len, "status": status,
            "steps": summary.get("steps", train[-1]["step"] if train else 0),
            "tokens_per_s": mean([r.get("tokens_per_s") for r in steady_train]),
            "mfu": mean([r.get("mfu") for r in steady_train]),
            **peaks, "final_loss": train[-1]["loss"] if train else None, "final_val_loss": val[-1] if val else None,
            "device": summary.get("device"), "message": summary.get("message"),
            "curve": [(r["step"], r["loss"]) for r in train if r.get("loss") is not None],
            "val_curve": [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None],
            "dir": job, "config": config}


WHAT_TO_PASS = ("pass the multirun/<date>/<time> directory of `train.py -m`, or run directories of `train.py` "
                "(outputs/<date>/<time>_<attn>_T<seq_len>)")


def read_sweep(*dirs: Path) -> list[dict]:
    """Every job's row of each sweep dir or run dir, by seq_len then setting, labelled by what tells
    them apart; SweepError naming the first file that is not train.py's."""
    jobs = []
    for path in dirs:
        if not path.is_dir():
            raise SweepError(f"{path}: no such directory: {WHAT_TO_PASS}")
        found = [path] if (path / ".hydra" / "config.yaml").exists() else sorted(
            p.parent.parent for p in path.glob("*/.hydra/config.yaml"))
        if not found:
            raise SweepError(f"no Hydra record (.hydra/config.yaml) in {path} or the jobs under it: {WHAT_TO_PASS}")
        jobs += [job for job in found if job not in jobs]
    rows = []
    for job in jobs:
        try:
            rows.append(job_row(job))
        except SweepError as e:
            where = "its sweep dir" if job not in dirs else "the command line"
            raise SweepError(f"{e}: repair it, or leave {job.name} out of {where} to summarise the other jobs") from None
    label_differences(rows)
    return sorted(rows, key=lambda r: (r["seq_len"], r["attn"], r["window"], r["n_kv_head"]))


# -----------------------------------------------------------------------------
# outputs


def plot_losses(rows: list[dict], path: Path) -> None:
    """Every job's losses against the step (validation points marked), and beside them each job's
    loss minus the first job's at the steps both logged: curves that lie on top of each other on
    the left part on the right. Earlier jobs draw thicker lines, so one is seen under a later one."""
    fig, (ax, diff) = plt.subplots(1, 2, figsize=(13, 4.5))
    first = next((r for r in rows if r["curve"]), None)
    for i, r in enumerate(rows):
        style = {"color": f"C{i % 10}", "linewidth": max(1.0, 2.6 - 0.5 * i)}
        if r["curve"]:
            ax.plot(*zip(*r["curve"]), **style, label=r["label"])
        if r["val_curve"]:
            ax.plot(*zip(*r["val_curve"]), "o--", **style, markersize=5, label=f"{r['label']} (val)")
        if first is not None and r is not first:
            for key, fmt in (("curve", "-"), ("val_curve", "o--")):
                base = dict(first[key])
                both = [(step, loss - base[step]) for step, loss in r[key] if step in base]
                if both:
                    diff.plot(*zip(*both), fmt, **style, markersize=5,
                              label=f"{r['label']}{' (val)' if key == 'val_curve' else ''}")
    if first is None:
        ax.text(0.5, 0.5, "no job logged a loss", ha="center", va="center", transform=ax.transAxes, color="gray")
    else:
        ax.legend(fontsize=8)
    if diff.get_legend_handles_labels()[0]:
        diff.axhline(0.0, color="gray", linewidth=0.8)
        diff.legend(fontsize=8)
    else:
        diff.text(0.5, 0.5, "one job: nothing to subtract", ha="center", va="center", transform=diff.transAxes,
                  color="gray")
    ax.set_ylabel("loss (dashed, dots: validation)")
    diff.set_ylabel(f"loss − {first['label']}'s" if first else "loss difference")
    for a in (ax, diff):
        a.set_xlabel("step")
        a.grid(True, alpha=0.3)
    labels = [r["label"] for r in rows]
    fig.suptitle("loss: " + ", ".join(labels) if len(", ".join(labels)) <= 110 else f"loss of {len(rows)} runs")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(rows: list[dict], source: str) -> str:
    attns = list(dict.fromkeys(setting(r) for r in rows))
    devices = sorted({r["device"] for r in rows if r["device"]}) or ["unknown"]
    lines = [f"## Runs of `{source}`", "",
             f"Device: {', '.join(devices)}. tokens/s, MFU (means) and peak memory (max) over the logged "
             "intervals after the first.", "",
             "| attn | window | kv heads | modifications | seq_len | status | steps | tokens/s | MFU "
             "| peak alloc GiB | peak reserved GiB | final loss | final val loss |",
             "|---|--:|--:|---|--:|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        mfu = None if r["mfu"] is None else 100 * r["mfu"]
        lines.append(f"| {r['attn']} | {r['window'] or 'all'} | {r['n_kv_head'] or 'n_head'} "
                     f"| {r['mods'] or 'none'} | {r['seq_len']} | {r['status']} | {r['steps']} "
                     f"| {fmt(r['tokens_per_s'], ',.0f')} "
                     f"| {fmt(mfu, '.1f')}{'%' if mfu is not None else ''} | {fmt(r['peak_mem_alloc_gib'], '.2f')} "
                     f"| {fmt(r['peak_mem_reserved_gib'], '.2f')} | {fmt(r['final_loss'], '.4f')} "
                     f"| {fmt(r['final_val_loss'], '.4f')} |")
    cells = {(r["seq_len"], setting(r)): r for r in rows}
    lines += ["", "tokens/s by seq_len (rows) and setting (columns):", "",
              "| seq_len | " + " | ".join(attns) + " |", "|--:|" + "--:|" * len(attns)]
    for seq_len in sorted({r["seq_len"] for r in rows}):
        row = []
        for attn in attns:
            r = cells.get((seq_len, attn))
            row.append("—" if r is None else "OOM" if r["status"] == "oom"
                       else fmt(r["tokens_per_s"], ",.0f") if r["status"] == "ok" else r["status"])
        lines.append(f"| {seq_len} | " + " | ".join(row) + " |")
    notes = [f"- {setting(r)}, seq_len {r['seq_len']}: {r['status']}: {r['message']}" for r in rows if r["message"]]
    if notes:
        lines += ["", "Jobs that did not finish:", "", *notes]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    # memory on a log2 axis: naive's T x T scores make it grow 4x per doubling of seq_len
    # on the CPU, which records no GPU memory, the process's peak resident set instead
    gpu = any(r["peak_mem_alloc_gib"] is not None for r in rows)
    memory = ("peak_mem_alloc_gib", "peak allocated GPU memory (GiB)") if gpu else \
        ("peak_rss_gib", "peak RSS of the process (GiB), CPU")
    panels = [("tokens_per_s", "tokens/s (from 0)", {"value": "linear"}, "no job finished"),
              (*memory, {"value": "log", "base": 2}, "no memory recorded")]
    seq_lens = sorted({r["seq_len"] for r in rows})
    attns = list(dict.fromkeys(setting(r) for r in rows))
    for ax, (key, label, yscale, empty_note) in zip(axes, panels):
        done = {a: [r for r in rows if setting(r) == a and r["status"] == "ok" and r[key] is not None] for a in attns}
        for i, attn in enumerate(attns):
            if done[attn]:
                ax.plot([r["seq_len"] for r in done[attn]], [r[key] for r in done[attn]], "o-", color=f"C{i}",
                        label=attn)
        if any(done.values()):
            ax.set_yscale(**yscale)
        else:
            ax.text(0.5, 0.5, empty_note, ha="center", va="center", transform=ax.transAxes, color="gray")
        # a job that ran out of memory has no value: an x on the bottom edge of the panel instead
        bottom = ax.get_ylim()[0]
        for i, attn in enumerate(attns):
            oom = [r["seq_len"] for r in rows if setting(r) == attn and r["status"] == "oom"]
            if oom:
                ax.plot(oom, [bottom] * len(oom), "x", color=f"C{i}", markersize=10, mew=2, clip_on=False,
                        label=f"{attn}: OOM")
        ax.set_ylim(bottom=0 if key == "tokens_per_s" else bottom)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
        ax.set_xlim(seq_lens[0] / 1.3, seq_lens[-1] * 1.3)
        ax.set_xlabel("seq_len")
        ax.set_ylabel(label)
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 100 else f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_ablation(rows: list[dict], path: Path) -> None:
    """ablation.png: one row of panels, one colour per setting: the loss curves, tokens/s and peak memory."""
    several = len({r["seq_len"] for r in rows}) > 1
    names = [setting(r) + (f" T={r['seq_len']}" if several else "") for r in rows]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    memory = ("peak_mem_alloc_gib", "peak allocated GPU memory (GiB)", ".2f")
    if all(r["peak_mem_alloc_gib"] is None for r in rows):  # the CPU's: one process runs a sweep's jobs
        memory = ("peak_rss_gib", "peak RSS (GiB): no GPU memory recorded;\nthe process's, grows over a sweep", ".2f")
    fig, (losses, *bars) = plt.subplots(1, 3, figsize=(16, max(4.5, 1.5 + 0.4 * len(rows))),
                                        gridspec_kw={"width_ratios": [1.6, 1, 1]})
    for r, name, color in zip(rows, names, colors):
        if r["curve"]:
            losses.plot(*zip(*r["curve"]), color=color, label=name)
        if r["val_curve"]:  # a dot too: a sweep that evaluates once, at the end, has one point
            losses.plot(*zip(*r["val_curve"]), "o--", color=color)
    if any(r["curve"] for r in rows):
        losses.legend(fontsize=8)
    losses.set(xlabel="step", ylabel="loss (dashed, dots: validation)")
    losses.grid(True, alpha=0.3)
    for ax, (key, label, spec) in zip(bars, [("tokens_per_s", "tokens/s", ",.0f"), memory]):
        values = [r[key] if r["status"] == "ok" else None for r in rows]
        ax.barh(range(len(rows)), [v or 0 for v in values], color=colors)
        for i, (v, r) in enumerate(zip(values, rows)):  # the value, or why there is none
            note = format(v, spec) if v is not None else r["status"] if r["status"] != "ok" else "not recorded"
            ax.text(v or 0, i, f" {note}", va="center", fontsize=8, color="black" if v is not None else "gray")
        ax.set_yticks(range(len(rows)), names if ax is bars[0] else [])
        ax.set_xlim(0, 1.25 * max((v for v in values if v is not None), default=1))
        ax.xaxis.set_major_locator(ticker.MaxNLocator(4))
        # thousands as k: six-digit tokens/s side by side would run into each other
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(
            lambda v, _: f"{v / 1000:,.0f}k" if v >= 10_000 else f"{v:,.0f}" if v >= 100 else f"{v:g}"))
        ax.invert_yaxis()  # the first setting on top, as in the legend
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                        help="the multirun/<date>/<time> directory of `train.py -m`, or run directories of train.py")
    parser.add_argument("--out", type=directory,
                        help="where to write summary.csv/.md, sweep.png, losses.png and ablation.png "
                             "(default: the one DIR)")
    args = parser.parse_args()
    if len(args.dirs) > 1 and args.out is None:
        parser.error(f"{len(args.dirs)} directories and no --out: pass --out DIR to write their comparison into")
    try:
        rows = read_sweep(*args.dirs)
    except SweepError as e:
        fail(str(e))
    out = args.out or args.dirs[0]
    problem = unwritable(out)
    if problem:
        fail(f"{out}: {problem}: pass --out a directory to write the summary into")
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "summary.csv", rows, COLUMNS)
    table = markdown(rows, ", ".join(map(str, args.dirs)))
    write_text(out / "summary.md", table)
    plot(rows, out / "sweep.png")
    plot_losses(rows, out / "losses.png")
    plot_ablation(rows, out / "ablation.png")
    print(f"wrote {out / 'summary.csv'}, {out / 'summary.md'}, {out / 'sweep.png'}, {out / 'losses.png'}, "
          f"{out / 'ablation.png'}\n")
    print(table)


if __name__ == "__main__":
    with stoppable("sweep_summary.py", lambda: "each summary file is whole: the one written before, or this one"):
        main()
