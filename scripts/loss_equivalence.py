"""Loss-curve equivalence: trains one model per attention from the same seed on the same batches, compares the curves.

    python scripts/loss_equivalence.py experiment=equivalence_cpu     # CPU, fp32, triton through the interpreter
    python scripts/loss_equivalence.py experiment=equivalence_gpu     # GPU, bf16: the check docs/results.md reports
    python scripts/loss_equivalence.py attns=[sdpa,triton] max_steps=100 seq_len=512   # any train.py override but resume

Each attention in `attns` (by default sdpa, then every other attention that can train this config
here: flex on CUDA, fa4 where FlashAttention-4 is installed) trains through train.train() with one
config that differs only in attn.name: the same seed gives the same initial weights and batch order;
log_interval=1 records every step's loss; one evaluation at the end gives the final val loss. The
first attention is the reference. The tolerance follows from the arithmetic, so it depends on the precision:

- strict (fp32 on the CPU): the attentions sum the same terms in different orders, so the curves
  differ by rounding alone, carried through the steps. Bound: |Δloss| <= 1e-4 at every step and
  for the final val loss (measured differences: docs/results.md). The bound assumes stable training: at a
  gradient-norm spike the same small weight differences move the loss a lot, so the check prints
  the reference's grad norm at the first step over the bound.
- spread (bf16 or fp16 autocast, or any CUDA run, where train.py enables TF32): rounding is ~1e-3
  relative and grows chaotically over hundreds of steps, so a fixed bound would be a guess. Instead
  the reference trains once more with data_seed + 1 (only the batch order changes): the difference
  between two equally valid runs. Backends must differ from the reference by <= SPREAD_FACTOR x
  that spread (mean |Δloss| over the second half of training) and agree on the final val loss
  within 1% relative.

Writes into the Hydra run dir one subdir per training run, equivalence.json and equivalence.png
(curves overlaid; |Δ| per step underneath, log scale, with the tolerance), logs the same to W&B
(group "equivalence"), prints a per-step table, a summary and AGREE or DISAGREE; exits 1 on DISAGREE.
A stop signal or Ctrl-C ends the check in one line, exit 128 + the signal, with no verdict
(scripts/stopping.py): a run cut short proves nothing either way.
"""

import copy
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

import hydra  # noqa: E402
import matplotlib  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

from configs.overrides import quoted_where_needed, task_config  # noqa: E402
from configs.runtime import autocast_dtype, resolve_device  # noqa: E402
from configs.schema import TrainConfig, plain  # noqa: E402
from configs.store import register_configs  # noqa: E402
from configs.validate import ConfigError, validate  # noqa: E402
from data import DatasetError, TokenizerError  # noqa: E402
from trainer.checkpoint import CheckpointError  # noqa: E402
from trainer.rundir import RUN_FILES  # noqa: E402
from trainer.metrics import read_metrics  # noqa: E402
from data.prepare import dataset_dir  # noqa: E402
from data.files import save_figure  # noqa: E402
from model.attention import ATTENTIONS  # noqa: E402
from trainer.report import open_wandb  # noqa: E402
from scripts.args import fail, hydra_config, unwritable  # noqa: E402
from scripts.outputs import write_text  # noqa: E402
from scripts.stopping import stoppable, trained  # noqa: E402

NAN = float("nan")
STRICT_TOL = 1e-4  # fp32: |Δloss| at every step, and |Δ final val loss|
# bf16: backends on the same batches differ by rounding only; runs on other batches differ by the
# batch-to-batch loss noise as well. Requiring 4x below that spread leaves room for the rounding
# divergence that grows late in training while still failing a backend that trains differently.
SPREAD_FACTOR = 0.25
VAL_REL_TOL = 0.01  # bf16: final val losses within 1% of the reference's


@dataclass
class EquivalenceConfig(TrainConfig):
    # the first is the reference; null: sdpa, PyTorch's own, then every other attention of the
    # registry that can train this config here (attentions())
    attns: Optional[list[str]] = None
    print_every: int = 10  # steps between rows of the printed table


def check_config(cfg: DictConfig) -> None:
    """ConfigError for a config the check cannot run: train.py's rules, then the check's own keys."""
    validate(cfg)
    attns = attentions(cfg)[0]
    if len(attns) < 2 or len(set(attns)) < len(attns) or not set(attns) <= ATTENTIONS.keys():
        raise ConfigError(f"attns={attns}: list two or more distinct attentions of {sorted(ATTENTIONS)}, "
                          "the reference first")
    for name in attns:
        if why := cannot_train(cfg, name):
            raise ConfigError(f"attns={attns}: {why}")
    if cfg.print_every < 1:
        raise ConfigError(f"print_every={cfg.print_every}: must be at least 1 (steps between printed rows)")
    if cfg.resume:  # train() would continue that one run in its own dir, for every attention
        raise ConfigError(f"resume={cfg.resume}: the check trains every attention from step 0 and cannot continue a "
                          "run: drop resume")
    data = dataset_dir(cfg.data)
    problem = None if data.is_dir() else unwritable(data)
    if problem:
        raise ConfigError(f"data.root={cfg.data.root}: the dataset dir {data}: {problem}: point data.root at a "
                          "directory")


def cannot_train(cfg: DictConfig, attn: str) -> str | None:
    """Why this config cannot train with attn here (train.py's one line), or None."""
    run_cfg = copy.deepcopy(cfg)
    run_cfg.attn.name = attn
    try:
        validate(run_cfg)
    except ConfigError as e:
        return str(e)
    return None


def attentions(cfg: DictConfig) -> tuple[list[str], dict[str, str]]:
    """(the attentions to compare, the reference first; those left out, with why): cfg.attns, or if
    it is null sdpa and every other attention of the registry, less those that cannot train here."""
    if cfg.attns is not None:
        return list(cfg.attns), {}
    names = ["sdpa", *(name for name in ATTENTIONS if name != "sdpa")]
    why = {name: cannot_train(cfg, name) for name in names}
    return [name for name in names if not why[name]], {name: w for name, w in why.items() if w}


def precision_mode(cfg: DictConfig) -> str:
    """'strict' for fp32 on the CPU; 'spread' for bf16 or fp16 autocast or CUDA (train.py turns TF32 on)."""
    device = resolve_device(cfg.device)
    return "strict" if device.type == "cpu" and autocast_dtype(cfg.dtype, device) is None else "spread"


def train_curve(cfg: DictConfig, attn: str, run_dir: Path, data_seed: int | None = None) -> dict:
    """Trains with one attention; returns its per-step losses and grad norms, final val loss and status."""
    run_cfg = copy.deepcopy(cfg)
    run_cfg.attn.name = attn  # the attn group's files differ only in name
    run_cfg.log_interval, run_cfg.eval_interval, run_cfg.sample_tokens = 1, 0, 0  # every step; eval at the end
    run_cfg.wandb.group = cfg.wandb.group or "equivalence"
    run_cfg.wandb.name = f"equivalence-{run_dir.name}"
    if data_seed is not None:
        run_cfg.data_seed = data_seed
    summary = trained(run_cfg, run_dir)
    if summary["message"]:  # a run that failed fails the check: say why
        print(f"{attn}: {summary['message']}", file=sys.stderr)
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    return {"loss": [r["loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records],
            "val_loss": summary["final_val_loss"], "status": summary["status"]}


# -----------------------------------------------------------------------------
# comparison


def abs_diff(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else NAN


def compare(runs: dict, reference: str, mode: str, max_steps: int, twin: dict | None) -> dict:
    """|Δ| of every attention against the reference, its statistics, and the verdict."""
    ref, half = runs[reference], max_steps // 2
    diffs = {n: abs_diff(r["loss"], ref["loss"]) for n, r in runs.items() if n != reference}
    spread = abs_diff(twin["loss"], ref["loss"]) if twin else None
    tol = STRICT_TOL if mode == "strict" else SPREAD_FACTOR * mean(spread[half:])
    stats = {}
    for name, d in diffs.items():
        val, ref_val = runs[name]["val_loss"], ref["val_loss"]
        val_diff = abs(val - ref_val) if val is not None and ref_val is not None else NAN
        s = {"max_abs_diff": max(d, default=NAN), "mean_abs_diff": mean(d), "late_mean_abs_diff": mean(d[half:]),
             "val_loss": val, "val_abs_diff": val_diff, "val_rel_diff": val_diff / ref_val if ref_val else NAN,
             "first_step_over_tol": None}
        # every comparison below is False for NaN: a NaN never passes
        if mode == "strict":
            s["first_step_over_tol"] = next((i + 1 for i, x in enumerate(d) if not x <= tol), None)
            within = s["first_step_over_tol"] is None and val_diff <= tol
        else:
            within = s["late_mean_abs_diff"] <= tol and s["val_rel_diff"] <= VAL_REL_TOL
        finished = all(r["status"] == "ok" and len(r["loss"]) == max_steps for r in (runs[name], ref, twin) if r)
        stats[name] = {**s, "ok": bool(within and finished)}
    verdict = "AGREE" if all(s["ok"] for s in stats.values()) else "DISAGREE"
    return {"abs_diff": diffs, "spread_abs_diff": spread, "tolerance": tol, "stats": stats, "verdict": verdict}


def report(runs: dict, reference: str, result: dict, every: int) -> str:
    ref, spread = runs[reference], result["spread_abs_diff"]
    head = f"{'step':>6} {reference + ' loss':>12}" + "".join(f" {n + ' loss':>12} {'|Δ|':>9}"
                                                              for n in result["abs_diff"])
    lines = [head + (f" {'spread |Δ|':>11}" if spread else "")]
    for i in range(len(ref["loss"])):
        if (i + 1) % every and i not in (0, len(ref["loss"]) - 1):
            continue
        row = f"{i + 1:>6} {ref['loss'][i]:>12.6f}"
        for n, d in result["abs_diff"].items():
            row += f" {runs[n]['loss'][i]:>12.6f} {d[i]:>9.2e}" if i < len(d) else f" {'-':>12} {'-':>9}"
        lines.append(row + (f" {spread[i]:>11.2e}" if spread and i < len(spread) else ""))
    lines.append("")
    for n, s in result["stats"].items():
        lines.append(f"{n} vs {reference}: max |Δ| {s['max_abs_diff']:.2e}, mean {s['mean_abs_diff']:.2e}, "
                     f"2nd-half mean {s['late_mean_abs_diff']:.2e}; final val loss {s['val_loss']} "
                     f"(|Δ| {s['val_abs_diff']:.2e}, {s['val_rel_diff']:.3%}) -> {'ok' if s['ok'] else 'FAIL'}")
        step = s["first_step_over_tol"]
        if step:  # rounding differences jump at a gradient-norm spike: say whether this step had one
            lines.append(f"  first step over the bound: {step}, where the reference's grad norm was "
                         f"{ref['grad_norm'][step - 1]:.3g} (median {statistics.median(ref['grad_norm']):.3g})")
    if result["mode"] == "strict":
        lines.append(f"tolerance (strict: fp32 on the CPU): |Δ| <= {STRICT_TOL:g} at every step and for the val loss")
    else:
        lines.append(f"tolerance (spread: low precision): 2nd-half mean |Δ| <= {SPREAD_FACTOR} x spread "
                     f"{result['tolerance'] / SPREAD_FACTOR:.2e} = {result['tolerance']:.2e}; "
                     f"final val loss within {VAL_REL_TOL:.0%}")
    lines.append(f"verdict: {result['verdict']}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# outputs


def plot(runs: dict, reference: str, result: dict, title: str, path: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, height_ratios=[3, 2])
    for i, (name, run) in enumerate(runs.items()):
        top.plot(range(1, len(run["loss"]) + 1), run["loss"], color=f"C{i}", lw=2.5 if name == reference else 1,
                 label=name + (" (reference)" if name == reference else ""))
        if name != reference:
            d = result["abs_diff"][name]
            bottom.plot(range(1, len(d) + 1), d, ".", color=f"C{i}", ms=4, label=f"|{name} - {reference}|")
    steps, spread = len(runs[reference]["loss"]), result["spread_abs_diff"]
    if spread:
        twin = result["spread_curve"]
        top.plot(range(1, len(twin) + 1), twin, color="gray", ls="--", lw=1, label=f"{reference}, another data order")
        bottom.plot(range(1, len(spread) + 1), spread, ".", color="gray", ms=3, alpha=0.6,
                    label="spread: other data order")
        bottom.hlines(result["tolerance"], steps // 2 + 1, steps, colors="k", linestyles="--",
                      label=f"tolerance: {SPREAD_FACTOR} x spread (2nd-half means)")
    else:
        bottom.axhline(STRICT_TOL, color="k", ls="--", label=f"tolerance {STRICT_TOL:g} (every step)")
    top.set(ylabel="training loss", title=title)
    top.legend()
    bottom.set_yscale("log")  # points, not lines: an exact zero (a bit-identical step) has no place on it
    bottom.set(xlabel="step", ylabel="|Δ loss| vs reference\n(exact zeros not drawn)")
    bottom.legend(fontsize="small")
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def log_wandb(cfg: DictConfig, out_dir: Path, runs: dict, result: dict, png: Path) -> None:
    run = open_wandb(cfg, out_dir, group=cfg.wandb.group or "equivalence", job_type="equivalence",
                     name=f"equivalence-{cfg.model.name}-T{cfg.seq_len}",
                     config={**plain(cfg), **result["environment"], "mode": result["mode"]})
    if run.disabled:  # wandb.mode=disabled: wandb is not imported
        return
    import wandb  # slow to import; only needed here

    series = {f"loss/{n}": r["loss"] for n, r in runs.items()}
    series |= {f"abs_diff/{n}": d for n, d in result["abs_diff"].items()}
    if result["spread_abs_diff"]:
        series["abs_diff/spread"] = result["spread_abs_diff"]
    steps = len(runs[result["reference"]]["loss"])
    try:
        for i in range(steps):
            rec = {k: v[i] for k, v in series.items() if i < len(v)}
            if i == steps - 1:
                rec["equivalence"] = wandb.Image(str(png))
            run.log(rec, step=i + 1)
        run.summary.update({"verdict": result["verdict"], "tolerance": result["tolerance"],
                            **{f"{n}/{k}": v for n, s in result["stats"].items() for k, v in s.items()}})
    except BaseException:  # a stop: the W&B run closes now, not in W&B's own lines as the process exits
        run.finish(exit_code=1)
        raise
    run.finish(exit_code=0 if result["verdict"] == "AGREE" else 1)


# -----------------------------------------------------------------------------
# the check


def check(cfg: DictConfig, out_dir: Path) -> dict:
    """Trains every attention of attentions(cfg) (and, in spread mode, the reference's data-order twin),
    compares, reports."""
    check_config(cfg)
    attns, left_out = attentions(cfg)
    for why in left_out.values():
        print(f"left out: {why}")
    mode, reference, device = precision_mode(cfg), attns[0], resolve_device(cfg.device)
    environment = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__}
    print(f"loss equivalence: {attns} (reference {reference}), {cfg.max_steps} steps, mode {mode} | {environment}")

    runs = {name: train_curve(cfg, name, out_dir / name) for name in attns}
    twin = None
    if mode == "spread":
        twin_seed = (cfg.seed if cfg.data_seed is None else cfg.data_seed) + 1
        twin = train_curve(cfg, reference, out_dir / f"{reference}_data_seed{twin_seed}", data_seed=twin_seed)

    result = {"mode": mode, "reference": reference, "max_steps": cfg.max_steps, "environment": environment,
              **compare(runs, reference, mode, cfg.max_steps, twin), "curves": {n: r["loss"] for n, r in runs.items()},
              "val_loss": {n: r["val_loss"] for n, r in runs.items()}, "spread_curve": twin["loss"] if twin else None}
    write_text(out_dir / "equivalence.json", json.dumps(result, indent=2))
    png = out_dir / "equivalence.png"
    title = (f"{' / '.join(attns)}: {result['verdict']} ({mode}) | {cfg.model.name}, seq_len {cfg.seq_len}, "
             f"{cfg.max_steps} steps\n{environment['device']}, torch {environment['torch']}, "
             f"triton {environment['triton']}")
    plot(runs, reference, result, title, png)
    log_wandb(cfg, out_dir, runs, result, png)
    print(report(runs, reference, result, cfg.print_every))  # the verdict last: a stop before it leaves none
    print(f"wrote {out_dir / 'equivalence.json'} and {png}")
    return result


def earlier_runs(run_dir: Path) -> list[str]:
    """The dirs in run_dir that hold a training run (an earlier check's, run into the same dir)."""
    if not run_dir.is_dir():
        return []
    return sorted(d.name for d in run_dir.iterdir() if d.is_dir() and any((d / f).exists() for f in RUN_FILES))


@hydra.main(version_base="1.3", config_path="../configs", config_name="equivalence")
def main(cfg: DictConfig) -> None:
    try:
        result = check(cfg, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, DatasetError, CheckpointError, TokenizerError) as e:
        fail(str(e))
    if result["verdict"] != "AGREE":
        sys.exit(1)


if __name__ == "__main__":
    # config.yaml's defaults list starts with train_schema: the subclass stored under that name makes
    # configs/equivalence.yaml compose train.py's whole config, typed, plus the keys above. Here, not
    # at import: importing this module changes no global state
    register_configs(EquivalenceConfig)
    sys.argv[1:] = quoted_where_needed(sys.argv[1:], EquivalenceConfig)  # as typed: hydra.run.dir=/data/ü_日本
    composed = hydra_config(sys.argv[1:], "equivalence")
    again = "the same command runs it again, in a new dir"
    if composed is not None:  # checked before Hydra makes the run dir, so that a bad config leaves nothing
        try:
            check_config(task_config(composed))
        except ConfigError as e:
            fail(str(e))
        if any(arg.lstrip("+").startswith("hydra.run.dir=") for arg in sys.argv[1:]):
            run_dir = Path(composed.hydra.run.dir)
            again = f"its runs stay in {run_dir}: run it again into another hydra.run.dir, or after removing that dir"
            if held := earlier_runs(run_dir):
                fail(f"hydra.run.dir={run_dir} holds the runs of an earlier check ({', '.join(held)}): the check "
                     "trains every attention from step 0: choose another hydra.run.dir, or remove that dir")
    # a stop ends the check with no verdict: its runs were cut short
    with stoppable("loss_equivalence.py", lambda: f"no verdict: the check compares whole runs ({again})"):
        main()
