"""The ablation sweep and the loss-curve equivalence check run end to end on the CPU.

- scripts/loss_equivalence.py: naive, sdpa and triton (through Triton's interpreter) train a tiny GPT
  on the same batches in fp32 and their loss curves agree within 1e-4 at every step; an attention
  with a wrong softmax scale is caught; the command line exits 0 on AGREE; the check's own W&B run
  holds every attention's curve.
- train.py -m experiment=sweep_cpu runs the attn x seq_len matrix, and scripts/sweep_summary.py turns
  it into summary.csv, summary.md and sweep.png with one row per job.
- train.py -m experiment=ablation_mods_cpu trains the baseline and each attention modification alone
  (softcap, ALiBi, sinks, prefix-LM, a local/global window pattern warmed up), and the summary names
  each setting by its modification and draws ablation.png; the GPU preset composes each setting.
- sweep_summary.py marks an out-of-memory job and a crashed one, and leaves the warmup interval out.
    .venv/bin/python -m pytest tests/test_sweep_and_equivalence.py -q
"""

import csv
import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F
from omegaconf import OmegaConf

from configs.validate import ConfigError, validate
from model import attention
from tests.helpers import REPO, TINY, compose
from tests.wandb_records import history, run_info


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


equivalence = load_script("loss_equivalence")
sweep_summary = load_script("sweep_summary")


def compose_equivalence(overrides: list[str]):
    return compose(overrides, config_name="equivalence", schema=equivalence.EquivalenceConfig)


# -----------------------------------------------------------------------------
# loss-curve equivalence


@pytest.mark.slow
def test_fp32_loss_curves_of_all_attentions_agree(data_root, tmp_path):
    cfg = compose_equivalence(TINY + [f"data.root={data_root}", "max_steps=20", "attns=[sdpa,naive,triton]",
                                      "wandb.mode=offline"])
    result = equivalence.check(cfg, tmp_path)
    assert result["mode"] == "strict" and result["verdict"] == "AGREE"
    for name in ("naive", "triton"):
        d = result["abs_diff"][name]
        assert len(d) == 20 and max(d) <= 1e-4, (name, d)  # NaN fails max(d) <= 1e-4
        assert result["stats"][name]["val_abs_diff"] <= 1e-4
    assert (tmp_path / "equivalence.png").stat().st_size > 0
    assert json.loads((tmp_path / "equivalence.json").read_text())["verdict"] == "AGREE"
    # the check's own W&B run: every attention's loss and difference at every step, in group "equivalence"
    run = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))[-1]
    rows = [r for r in history(run) if "loss/sdpa" in r]
    assert [r["_step"] for r in rows] == list(range(1, 21))
    assert all({"loss/naive", "loss/triton", "abs_diff/naive", "abs_diff/triton"} <= r.keys() for r in rows)
    assert run_info(run)["group"] == "equivalence"


def test_fp32_loss_curves_agree_with_documents_masked(short_docs, tmp_path):
    # windows of 32 tokens over documents of 3-21 tokens: every attention masks several per window
    cfg = compose_equivalence(TINY + short_docs + ["data.doc_mask=true", "max_steps=10", "attns=[sdpa,naive,triton]",
                                                   "wandb.mode=disabled"])
    result = equivalence.check(cfg, tmp_path)
    assert result["mode"] == "strict" and result["verdict"] == "AGREE", result["stats"]
    unmasked = equivalence.check(compose_equivalence(TINY + short_docs + ["max_steps=10", "attns=[sdpa,naive]",
                                                                          "wandb.mode=disabled"]), tmp_path / "plain")
    assert unmasked["curves"]["sdpa"] != result["curves"]["sdpa"]  # the mask changed the training


def test_fp32_loss_curves_agree_with_a_window_and_one_kv_head(data_root, tmp_path):
    # the ablation's knobs: every attention windows and groups its heads alike
    cfg = compose_equivalence(TINY + [f"data.root={data_root}", "attn.window=5", "model.n_kv_head=1", "max_steps=8",
                                      "attns=[sdpa,naive,triton]", "wandb.mode=disabled"])
    result = equivalence.check(cfg, tmp_path)
    assert result["mode"] == "strict" and result["verdict"] == "AGREE", result["stats"]


def test_a_wrong_softmax_scale_is_caught(data_root, tmp_path, monkeypatch):
    def unscaled_attention(q, k, v, doc_ids=None):  # the classic bug: scores not divided by sqrt(head_dim)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)

    naive = attention.ATTENTIONS["naive"]
    monkeypatch.setitem(attention.ATTENTIONS, "naive", dataclasses.replace(naive, fn=unscaled_attention))
    cfg = compose_equivalence(TINY + [f"data.root={data_root}", "max_steps=10", "attns=[sdpa,naive]",
                                      "wandb.mode=disabled"])
    result = equivalence.check(cfg, tmp_path)
    assert result["verdict"] == "DISAGREE" and result["stats"]["naive"]["max_abs_diff"] > 1e-4


@pytest.mark.slow
def test_command_line_exits_0_on_agreement(data_root, tmp_path):
    cmd = [sys.executable, "scripts/loss_equivalence.py", *TINY, f"data.root={data_root}", "max_steps=5",
           "attns=[sdpa,naive]", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verdict: AGREE" in proc.stdout
    assert (tmp_path / "naive" / "metrics.jsonl").exists() and (tmp_path / "equivalence.png").exists()


# -----------------------------------------------------------------------------
# sweep and its summary


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_cpu_sweep_runs_the_matrix_and_is_summarised(data_root, tmp_path):
    sweep, out = tmp_path / "sweep", tmp_path / "summary"
    subprocess.run([sys.executable, "train.py", "-m", "experiment=sweep_cpu", f"data.root={data_root}",
                    "wandb.mode=offline", f"hydra.sweep.dir={sweep}"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "scripts/sweep_summary.py", str(sweep), "--out", str(out)],
                          cwd=REPO, check=True, capture_output=True, text=True, timeout=120)
    rows = read_csv(out / "summary.csv")
    assert list(rows[0]) == sweep_summary.COLUMNS
    assert [(r["seq_len"], r["attn"]) for r in rows] == [(str(t), a) for t in (32, 64)
                                                          for a in ("naive", "sdpa", "triton")]
    assert all(r["status"] == "ok" and r["steps"] == "4" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert all(math.isfinite(float(r["final_loss"])) and r["device"] == "cpu" for r in rows)
    assert all(r["peak_mem_alloc_gib"] == "" for r in rows)  # GPU memory: not logged on the CPU
    md = (out / "summary.md").read_text()
    assert "| seq_len | naive | sdpa | triton |" in md and proc.stdout.rstrip().endswith(md.rstrip())
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_ablation_sweep_is_summarised_per_setting(data_root, tmp_path):
    sweep, out = tmp_path / "sweep", tmp_path / "summary"
    subprocess.run([sys.executable, "train.py", "-m", "experiment=ablation_cpu", f"data.root={data_root}",
                    "wandb.mode=disabled", f"hydra.sweep.dir={sweep}"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "scripts/sweep_summary.py", str(sweep), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=120)
    rows = read_csv(out / "summary.csv")
    assert [(r["window"], r["n_kv_head"]) for r in rows] == [("0", "0"), ("0", "1"), ("8", "0"), ("8", "1")]
    assert all(r["status"] == "ok" and r["steps"] == "6" for r in rows)
    assert len({r["final_loss"] for r in rows}) == 4  # each setting trains its own model
    md = (out / "summary.md").read_text()
    assert "| seq_len | sdpa | sdpa kv=1 | sdpa W=8 | sdpa W=8 kv=1 |" in md
    assert (out / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# each setting of the modifications' presets (configs/ablate/, configs/ablate_cpu/): the modifications it turns on
MODS_GPU = {"none": "", "softcap": "softcap=30", "alibi": "alibi", "sinks": "sinks", "prefix": "prefix=1024",
            "local_global": "W=[1024,1024,1024,0] warmup=40"}
MODS_CPU = {**MODS_GPU, "softcap": "softcap=0.1", "prefix": "prefix=4", "local_global": "W=[8,0] warmup=4"}


@pytest.mark.parametrize("experiment, group, mods", [("ablation_mods", "ablate", MODS_GPU),
                                                     ("ablation_mods_cpu", "ablate_cpu", MODS_CPU)])
def test_modifications_presets_sweep_every_setting_of_their_group(experiment, group, mods):
    preset = OmegaConf.load(REPO / "configs" / "experiment" / f"{experiment}.yaml")
    assert preset.hydra.sweeper.params[group].split(",") == list(mods)  # the baseline first
    assert {p.stem for p in (REPO / "configs" / group).glob("*.yaml")} == set(mods)
    refused = {}
    for name, label in mods.items():
        cfg = compose([f"experiment={experiment}", f"{group}={name}", "device=cpu"])
        keys = {k.rstrip("."): v for k, v in sweep_summary.flat(OmegaConf.to_container(cfg)).items()}
        assert sweep_summary.modifications(keys) == label, name
        try:
            validate(cfg)
        except ConfigError as e:
            refused[name] = str(e)
    assert not refused, refused  # attn=triton (the GPU preset's) and attn=naive (the CPU's) compute every one


@pytest.mark.slow
def test_cpu_modifications_sweep_trains_each_alone_and_is_summarised(data_root, tmp_path):
    # 6 jobs of 6 steps on a 2-layer model (about 15-25 s on 2 cores); attn=naive computes every modification
    sweep, out = tmp_path / "sweep", tmp_path / "summary"
    subprocess.run([sys.executable, "train.py", "-m", "experiment=ablation_mods_cpu", f"data.root={data_root}",
                    "wandb.mode=disabled", f"hydra.sweep.dir={sweep}"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "scripts/sweep_summary.py", str(sweep), "--out", str(out)],
                          cwd=REPO, check=True, capture_output=True, text=True, timeout=120)
    jobs = sweep_summary.read_sweep(sweep)
    # one job per setting, in the sweep's order, each dir named by its setting (0_none_naive_T32, ...)
    assert [r["dir"].name for r in jobs] == [f"{i}_{name}_naive_T32" for i, name in enumerate(MODS_CPU)]
    assert [sweep_summary.setting(r) for r in jobs] == [f"naive {label}".strip() for label in MODS_CPU.values()]
    rows = read_csv(out / "summary.csv")
    assert [r["mods"] for r in rows] == list(MODS_CPU.values())
    assert all(r["status"] == "ok" and r["steps"] == "6" and r["device"] == "cpu" for r in rows)
    assert all(float(r["tokens_per_s"]) > 0 and float(r["peak_rss_gib"]) > 0 for r in rows)
    assert len({r["final_loss"] for r in rows}) == 6  # each modification changes what the model learns
    md = (out / "summary.md").read_text()
    assert sum(line.startswith("| naive | all | n_head | ") for line in md.splitlines()) == 6  # a row per job
    assert "| seq_len | " + " | ".join(sweep_summary.setting(r) for r in jobs) + " |" in md
    assert "ablation.png" in proc.stdout and (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_job(sweep: Path, name: str, attn: str, seq_len: int, records: list[dict], status: str | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "config.yaml").write_text(f"attn:\n  name: {attn}\nseq_len: {seq_len}\n")
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if status is not None:  # a crashed job writes no summary.json
        (job / "summary.json").write_text(json.dumps({"status": status, "steps": records[-1]["step"],
                                                      "device": "NVIDIA H100 80GB HBM3"}))


def step(n: int, tok_s: float, alloc: float) -> dict:
    return {"step": n, "loss": 10.0 - n / 10, "tokens_per_s": tok_s, "mfu": tok_s / 1e6,
            "peak_mem_alloc_gib": alloc, "peak_mem_reserved_gib": alloc + 1}


def test_summary_marks_oom_and_failed_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    # the first interval: warmup, and a peak left over from the previous job in the same process
    write_job(sweep, "0_sdpa_T8192", "sdpa", 8192, [step(10, 100.0, 70.0), step(20, 300.0, 6.0), step(30, 500.0, 4.0),
                                                     {"step": 30, "val_loss": 7.5}], "ok")
    write_job(sweep, "1_naive_T8192", "naive", 8192, [step(10, 50.0, 70.0),
                                                       {"step": 10, "event": "oom", "oom": 1, "message": "OOM"}], "oom")
    write_job(sweep, "2_triton_T8192", "triton", 8192, [step(10, 80.0, 3.0)], None)
    rows = {r["attn"]: r for r in sweep_summary.read_sweep(sweep)}
    assert {a: r["status"] for a, r in rows.items()} == {"sdpa": "ok", "naive": "oom", "triton": "failed"}
    ok = rows["sdpa"]
    assert ok["tokens_per_s"] == 400.0 and ok["mfu"] == pytest.approx(4e-4)  # steps 20 and 30: first left out
    assert (ok["peak_mem_alloc_gib"], ok["peak_mem_reserved_gib"]) == (6.0, 7.0)
    assert (ok["final_loss"], ok["final_val_loss"], ok["steps"]) == (7.0, 7.5, 30)
    table = sweep_summary.markdown(list(rows.values()), sweep)
    assert "| 8192 | OOM | 400 | failed |" in table
    sweep_summary.plot(list(rows.values()), tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    sweep_summary.plot_ablation(list(rows.values()), tmp_path / "ablation.png")  # no bars for oom and failed
    assert (tmp_path / "ablation.png").stat().st_size > 0


def _figures(monkeypatch) -> list:
    """The figures sweep_summary saves, kept for a look at what they draw."""
    figures = []
    monkeypatch.setattr(sweep_summary, "save_figure", lambda fig, path: figures.append(fig))
    return figures


def test_the_losses_plot_shows_what_differs(monkeypatch, tmp_path):
    # two curves on top of each other part in the second panel, each run's loss minus the first's;
    # a single validation point is a marker, and the figure says what it compares
    figures = _figures(monkeypatch)
    rows = [{"label": "attn=naive", "curve": [(1, 3.0), (2, 2.5), (3, 2.2)], "val_curve": [(3, 2.6)]},
            {"label": "attn=sdpa", "curve": [(1, 3.0), (2, 2.4), (3, 2.2)], "val_curve": [(3, 2.7)]}]
    sweep_summary.plot_losses(rows, tmp_path / "losses.png")
    (fig,) = figures
    losses, diff = fig.axes
    assert fig._suptitle.get_text() == "loss: attn=naive, attn=sdpa"
    assert all(line.get_marker() == "o" for line in losses.lines if line.get_label().endswith("(val)"))
    drawn = {line.get_label(): list(line.get_ydata()) for line in diff.lines if not line.get_label().startswith("_")}
    assert drawn == {"attn=sdpa": pytest.approx([0.0, -0.1, 0.0]), "attn=sdpa (val)": pytest.approx([0.1])}
    assert diff.get_ylabel() == "loss − attn=naive's"


def test_the_sweep_plot_starts_tokens_at_zero_and_draws_peak_rss_on_the_cpu(monkeypatch, tmp_path):
    figures = _figures(monkeypatch)
    rows = [{"attn": attn, "window": 0, "n_kv_head": 0, "mods": "", "seq_len": T, "status": "ok",
             "tokens_per_s": 2000.0 + T, "peak_mem_alloc_gib": None, "peak_rss_gib": rss}
            for attn, rss in (("naive", 1.5), ("sdpa", 1.2)) for T in (64, 128)]
    sweep_summary.plot(rows, tmp_path / "sweep.png")
    tokens, memory = figures[0].axes
    assert tokens.get_ylim()[0] == 0
    assert memory.get_ylabel() == "peak RSS of the process (GiB), CPU"
    assert sorted(y for line in memory.lines for y in line.get_ydata()) == [1.2, 1.2, 1.5, 1.5]

