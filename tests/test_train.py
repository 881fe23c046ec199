"""Training end to end on the CPU: every attention learns, resume is exact, W&B and metrics are real.

Each test trains a tiny GPT for a few steps on the real prepared Shakespeare data. The W&B runs are
real offline runs, read back from their .wandb files; the multirun test launches train.py itself.
    .venv/bin/python -m pytest tests/test_train.py -q
"""

import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch

import train as train_module
from configs.validate import ConfigError
from data import TokenWindows
from model import GPT
from tests.helpers import REPO, TINY, compose, metrics, wandb_file
from tests.wandb_records import history, run_info


@pytest.mark.parametrize("attn", ["naive", "sdpa", "triton"])
def test_each_attention_lowers_the_loss(attn, data_root, tmp_path):
    cfg = compose(TINY + [f"attn={attn}", f"data.root={data_root}", "max_steps=12", "log_interval=1",
                          "eval_interval=0", "wandb.mode=disabled"])
    summary = train_module.train(cfg, tmp_path)
    losses = [r["loss"] for r in metrics(tmp_path) if "loss" in r]
    assert summary["status"] == "ok" and len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def _sdpa_backends():
    # on the CPU torch has flash and math kernels; on CUDA all four
    runnable = {"flash", "cudnn", "efficient", "math"} if torch.cuda.is_available() else {"flash", "math"}
    return [pytest.param(b, b in runnable, marks=[pytest.mark.gpu] if torch.cuda.is_available() else [], id=b)
            for b in ("flash", "cudnn", "efficient", "math")]


@pytest.mark.parametrize("backend, runnable", _sdpa_backends())
def test_each_sdpa_backend_trains_or_is_refused_in_one_line(backend, runnable, data_root, tmp_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = compose(TINY + ["attn=sdpa", f"attn.sdpa_backend={backend}", f"device={device}", f"data.root={data_root}",
                          "max_steps=3", "log_interval=1", "eval_interval=0", "wandb.mode=disabled"])
    if not runnable:
        with pytest.raises(ConfigError, match=f"attn.sdpa_backend={backend}: torch has no such kernel"):
            train_module.train(cfg, tmp_path)
        return
    summary = train_module.train(cfg, tmp_path)  # the pinned context is entered at every step and eval
    assert summary["status"] == "ok" and summary["sdpa_backend"] == backend


@pytest.mark.gpu
def test_gpu_cuda_graphs_give_the_compiled_runs_losses(data_root, tmp_path):
    # compile_mode=reduce-overhead replays each compiled graph (our kernels inside, their TMA
    # descriptors written to scratch at each replay) as one CUDA graph: the same kernels on the same
    # inputs, so the same bits as compile=true alone, eval and two micro-steps included
    base = [o for o in TINY if o != "device=cpu"] + ["attn=triton", "device=cuda", f"data.root={data_root}",
                                                     "max_steps=8", "log_interval=1", "eval_interval=4", "grad_accum=2",
                                                     "compile=true", "wandb.mode=disabled"]
    runs = {}
    for mode in ("default", "reduce-overhead"):
        assert train_module.train(compose(base + [f"compile_mode={mode}"]), tmp_path / mode)["status"] == "ok"
        runs[mode] = [(r.get("loss"), r.get("val_loss")) for r in metrics(tmp_path / mode)]
    assert runs["default"] == runs["reduce-overhead"] and len(runs["default"]) >= 8


def test_wandb_offline_run_and_metrics_hold_throughput_and_memory(data_root, tmp_path):
    cfg = compose(TINY + [f"data.root={data_root}", "max_steps=6", "log_interval=2", "eval_interval=3",
                          "wandb.mode=offline"])
    summary = train_module.train(cfg, tmp_path)
    keys = {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_alloc_gib", "peak_mem_reserved_gib",
            "attn", "seq_len"}
    rows = [r for r in metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4, 6] and all(keys <= r.keys() for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert [r["step"] for r in metrics(tmp_path) if "val_loss" in r] == [3, 6]
    logged = history(wandb_file(tmp_path))  # what W&B itself recorded
    train_rows = [r for r in logged if "loss" in r]
    assert [r["_step"] for r in train_rows] == [2, 4, 6]
    assert all(r["tokens_per_s"] > 0 and "seq_len" in r for r in train_rows)
    # memory is a GPU quantity: on the CPU the keys exist in metrics.jsonl as null (W&B skips nulls)
    assert all(r["peak_mem_alloc_gib"] is None for r in rows) and summary["device"] == "cpu"
    assert json.loads((tmp_path / "summary.json").read_text())["mean_tokens_per_s"] > 0


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    """No W&B key anywhere W&B looks (a developer's own ~/.netrc may hold one), no WANDB_MODE."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


class _RefusesEveryKey(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.send_response(401)
        self.end_headers()

    def log_message(self, *args):
        pass


class _GraphQLError(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"data": None, "errors": [{"message": "permission denied"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("server", ["no key", "no server", "key refused", "a GraphQL error", "not a URL"])
def test_wandb_online_where_it_cannot_log_falls_back_to_offline_in_one_line(server, data_root, tmp_path, monkeypatch,
                                                                            capsys, no_wandb_login):
    if server == "no server":  # a key, but nothing listens where W&B would be
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    httpd = None
    if server in ("key refused", "a GraphQL error"):  # a real HTTP server on this machine: 401, or data null
        httpd = http.server.HTTPServer(("127.0.0.1", 0), _RefusesEveryKey if server == "key refused" else _GraphQLError)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{httpd.server_port}")
    if server == "not a URL":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        monkeypatch.setenv("WANDB_BASE_URL", "notaurl")
    cfg = compose(TINY + [f"data.root={data_root}", "max_steps=2", "wandb.mode=online"])
    summary = train_module.train(cfg, tmp_path)
    if httpd:
        httpd.shutdown()
    said = [line for line in capsys.readouterr().err.splitlines() if "logging offline instead" in line]
    reason = {"no key": "no W&B API key", "no server": "cannot be reached", "key refused": "refused the API key",
              "a GraphQL error": "does not accept the API key", "not a URL": "notaurl cannot be reached"}
    assert len(said) == 1 and reason[server] in said[0] and "wandb sync" in said[0], said
    assert summary["status"] == "ok" and history(wandb_file(tmp_path))  # the run went on, logged offline


@pytest.mark.parametrize("env, override, offline_files", [("disabled", None, False), ("offline", None, True),
                                                          ("disabled", "offline", True)])
def test_wandb_mode_comes_from_the_command_line_then_the_environment(env, override, offline_files, data_root, tmp_path,
                                                                      monkeypatch, no_wandb_login):
    monkeypatch.setenv("WANDB_MODE", env)
    extra = [f"wandb.mode={override}"] if override else []
    train_module.train(compose(TINY + [f"data.root={data_root}", "max_steps=2", *extra]), tmp_path)
    assert bool(list(tmp_path.glob("wandb/offline-run-*"))) == offline_files


@pytest.mark.parametrize("how", [["wandb.mode=disabled"], ["WANDB_MODE=disabled"]], ids=["override", "environment"])
def test_wandb_disabled_is_never_imported(how, data_root, tmp_path):
    # a machine without wandb trains with W&B disabled: here a wandb that fails when imported stands in
    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise RuntimeError("wandb was imported")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)])}
    overrides = [o for o in how if "=" in o and not o.startswith("WANDB_")]
    env |= dict(o.split("=", 1) for o in how if o.startswith("WANDB_"))
    proc = subprocess.run([sys.executable, "train.py", *TINY, f"data.root={data_root}", "max_steps=2", *overrides,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"


def test_profile_writes_a_trace_of_the_training_steps(data_root, tmp_path):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the memory snapshot too
    cfg = compose(TINY + [f"data.root={data_root}", "max_steps=6", "wandb.mode=disabled", "profile=true",
                          f"device={device}"])
    train_module.train(cfg, tmp_path)
    events = json.loads((tmp_path / "profile" / "trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {f"ProfilerStep#{i}" for i in (2, 3, 4)} <= names  # the three recorded steps (counted from 0)
    assert any(n.startswith("aten::mm") for n in names) and any("backward" in n.lower() for n in names)
    if device == "cuda":
        assert (tmp_path / "profile" / "memory_snapshot.pickle").stat().st_size > 0


def test_resume_reproduces_the_uninterrupted_run_exactly(data_root, tmp_path, monkeypatch):
    common = TINY + [f"data.root={data_root}", "max_steps=10", "log_interval=1", "eval_interval=5",
                     "ckpt_interval=5", "wandb.mode=offline", "model.dropout=0.1"]
    straight = tmp_path / "straight"
    train_module.train(compose(common), straight)

    # interrupt a second run like Ctrl-C during step 8, after its checkpoint at step 5
    interrupted = tmp_path / "interrupted"
    real_next_batch = TokenWindows.next_batch
    calls = {"n": 0}

    def next_batch_then_interrupt(self):
        if self.path.name == "train.bin":
            calls["n"] += 1
            if calls["n"] == 8:
                raise KeyboardInterrupt
        return real_next_batch(self)

    monkeypatch.setattr(TokenWindows, "next_batch", next_batch_then_interrupt)
    stopped = train_module.train(compose(common), interrupted)
    monkeypatch.undo()
    assert (stopped["status"], stopped["signal"], stopped["steps"]) == ("stopped", "SIGINT", 7)
    assert torch.load(interrupted / "ckpt.pt", weights_only=True)["step"] == 5
    assert not [p for p in interrupted.iterdir() if p.name.endswith(".tmp")]

    train_module.train(compose(common + [f"resume={interrupted}"]), tmp_path / "ignored")
    want, got = metrics(straight), metrics(interrupted)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for key in ("loss", "val_loss", "grad_norm", "lr"):
            assert a.get(key) == b.get(key), (a["step"], key)  # bit-identical on CPU fp32
    # the resumed W&B run is the same run (same id) continuing after step 5
    runs = sorted(interrupted.glob("wandb/offline-run-*/run-*.wandb"))
    assert len({run_info(p)["id"] for p in runs}) == 1
    assert [r["_step"] for r in history(runs[-1]) if "loss" in r] == [6, 7, 8, 9, 10]


def test_cuda_oom_is_recorded_and_does_not_raise(data_root, tmp_path, monkeypatch):
    # the CPU cannot run out of GPU memory: raise the real exception type where the model runs
    def forward_out_of_memory(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 45.00 GiB")

    monkeypatch.setattr(GPT, "forward", forward_out_of_memory)
    cfg = compose(TINY + [f"data.root={data_root}", "max_steps=3", "wandb.mode=offline"])
    summary = train_module.train(cfg, tmp_path)
    assert summary["status"] == "oom"
    assert metrics(tmp_path)[-1]["event"] == "oom"
    assert any(r.get("oom") == 1 for r in history(wandb_file(tmp_path)))


def test_resume_with_another_model_shape_or_of_a_finished_run_is_refused(data_root, tmp_path):
    base = TINY + [f"data.root={data_root}", "max_steps=2", "wandb.mode=disabled"]
    train_module.train(compose(base), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"model.d_model 32 -> 64 would not continue the same run"):
        train_module.train(compose(base + ["model.d_model=64", f"resume={tmp_path / 'run'}"]), tmp_path / "other")
    with pytest.raises(ConfigError, match="already finished at step 2; raise max_steps above 2"):
        train_module.train(compose(base + [f"resume={tmp_path / 'run'}"]), tmp_path / "other")


@pytest.mark.slow
def test_multirun_makes_one_wandb_run_per_job(data_root, tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "attn=naive,sdpa", *TINY, f"data.root={data_root}", "max_steps=2",
           "eval_interval=0", f"hydra.sweep.dir={sweep}"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=600)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [p.name for p in jobs] == ["0_naive_T32", "1_sdpa_T32"]
    infos = [run_info(wandb_file(p)) for p in jobs]
    assert len({i["id"] for i in infos}) == 2
    assert len({i["group"] for i in infos}) == 1 and infos[0]["group"].startswith("sweep-")


@pytest.mark.slow
def test_sample_script_generates_from_a_checkpoint(data_root, tmp_path):
    train_module.train(compose(TINY + [f"data.root={data_root}", "max_steps=2", "wandb.mode=disabled"]),
                       tmp_path / "run")
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "sample.py"), f"ckpt={tmp_path / 'run'}",
                          "prompt=ROMEO:", "max_new_tokens=8", "device=cpu"],
                         cwd=workdir, check=True, capture_output=True, text=True, timeout=300).stdout
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:")
    assert list(workdir.iterdir()) == []  # sampling writes nothing
