"""Every script refuses a bad command line in one line, before it needs a GPU, and creates nothing.

Each row of BAD runs a script as a real process (in an empty working directory, its input files in
another) and checks what a user sees: exit code 2, exactly one stderr line, `error: ...`, naming the
argument or key and the value; the working directory still empty and the input files untouched.
The rows cover one of argparse's errors per script (the argument types' refusals, value by value,
are tests/test_script_args.py's, in this process), each script's value checks, damaged input
files, train.py overrides the benchmarks pass on, and the refusal without CUDA (those rows run only where there
is none: elsewhere the command would start the benchmark). Then host_overhead.py --help, and
sample.py with each attention and with the one the checkpoint trained with (attention=null), with
a prompt holding a comma, as typed, and refusing in one line an attention this machine cannot run
(FlashAttention-4 on the CPU).
Each process imports torch: five minutes or so on 2 cores, so marked slow:

    .venv/bin/python -m pytest tests/test_scripts.py -q
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train as train_module
from model.peers import fa4_unsupported
from tests.helpers import REPO, TINY, compose
from trainer.checkpoint import CHECKPOINT_NAME, KEYS, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.slow

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this command would start the benchmark")
NOT_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
HEADER = "attn,ac,seq_len,status,steps,tokens_per_s,step_s,peak_mem_alloc_gib\n"


def sweep(inputs: Path, files: dict[str, str | None]) -> None:
    """inputs/sweep: one job, its files as train.py writes them except for `files` (None: a directory)."""
    job = inputs / "sweep" / "0_sdpa_T64"
    written = {".hydra/config.yaml": "attn:\n  name: sdpa\nseq_len: 64\n",
               "metrics.jsonl": '{"step": 1, "loss": 5.0, "tokens_per_s": 10.0}\n',
               "summary.json": '{"status": "ok", "steps": 1}\n', **files}
    for name, text in written.items():
        path = job / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if text is None else path.write_text(text)


def read_only(inputs: Path) -> None:
    (inputs / "ro").mkdir(mode=0o555)


def case(script: str, args: str, expected: str, setup=None, what: str | None = None, marks=()):
    """A row: `script args` ({in}: the input dir, which setup(inputs) fills) fails naming `expected`."""
    return pytest.param(script, args, expected, setup, id=f"{script} {what or args}", marks=marks)


BAD = [
    # bench_attention.py
    case("bench_attention.py", "--seq-lens 0", "argument --seq-lens: '0': '0' is not a positive integer"),
    case("bench_attention.py", "--seq-lens 1024,1024", "'1024' is listed twice"),
    case("bench_attention.py", "--seq-lens 3000", "--seq-lens: [3000] do not divide --tokens 16384"),
    case("bench_attention.py", "--documents synthetic --head-dims 100", "--head-dims: [100] do not divide --width"),
    case("bench_attention.py", "--quick", "bench_attention.py needs a CUDA GPU", marks=NO_CUDA),
    # bench_loss.py
    case("bench_loss.py", "--tokens 1024,abc", "argument --tokens: '1024,abc': 'abc'"),
    case("bench_loss.py", "", "bench_loss.py needs a CUDA GPU", what="(no CUDA)", marks=NO_CUDA),
    # tune_attention.py
    case("tune_attention.py", "--seq-lens abc", "argument --seq-lens: 'abc'"),
    case("tune_attention.py", "--head-dims 512", "--head-dims: [512]"),
    case("tune_attention.py", "", "tune_attention.py needs a CUDA GPU", what="(no CUDA)", marks=NO_CUDA),
    # host_overhead.py
    case("host_overhead.py", "--bogus", "unrecognized arguments: --bogus; host_overhead.py takes -h, --help"),
    case("host_overhead.py", "", "host_overhead.py needs a CUDA GPU", what="(no CUDA)", marks=NO_CUDA),
    case("bench_attention.py", "--window 512 --documents synthetic",
         "--documents, --window and --mods are three modes"),
    case("bench_attention.py", "--window 512 --seq-lens 1000", "bench_attention.py needs a CUDA GPU", marks=NO_CUDA),
    # bench_decode.py
    case("bench_decode.py", "--kv-heads 5", "--kv-heads 5: must divide the 12 query heads"),
    case("bench_decode.py", "--new 64 --context 64", "--new 64: must be below --context 64"),
    case("bench_decode.py", "--cache-lens 0", "argument --cache-lens: '0'"),
    case("bench_decode.py", "--new 8", "--new 8: must be at least 16"),
    case("bench_decode.py", "", "bench_decode.py needs a CUDA GPU", what="(no CUDA)", marks=NO_CUDA),
    # profile_attention.py
    case("profile_attention.py", "--head-dims 100", "--head-dims: [100] do not divide --width 1024"),
    case("profile_attention.py", "--seq-lens 3000", "--seq-lens: [3000] do not divide --tokens 16384"),
    case("profile_attention.py", "--steps 0", "argument --steps: '0'"),
    case("profile_attention.py", "", "profile_attention.py needs a CUDA GPU", what="(no CUDA)", marks=NO_CUDA),
    # long_context.py
    case("long_context.py", "--from-csv {in}/nonexistent.csv", "nonexistent.csv: No such file"),
    case("long_context.py", "--from-csv {in}/rows.json", "rows.json: no column attn",
         lambda d: (d / "rows.json").write_text('{"attn": "triton"}\n')),
    case("long_context.py", "--from-csv {in}/empty.csv", "empty.csv: it is empty", lambda d: (d / "empty.csv").touch()),
    case("long_context.py", "--from-csv {in}/bad.csv", "bad.csv, line 2: seq_len='long' is not a number",
         lambda d: (d / "bad.csv").write_text(HEADER + "triton,full,long,ok,3,1,1,1\n")),
    case("long_context.py", "--out {in}/file", "argument --out: ", lambda d: (d / "file").write_text("")),
    case("long_context.py", "--min 4096 --max 2048", "--min: 4096 exceeds --max 2048"),
    case("long_context.py", "--attns sdpa --acs none --max 8192 model.n_head=5", "model.d_model=768"),
    case("long_context.py", "--attns sdpa --acs none --max 8192", "long_context.py needs a CUDA GPU", marks=NO_CUDA),
    # context_parallel.py
    case("context_parallel.py", "--gpus 1", "context_parallel.py --gpus 1 needs a CUDA GPU", marks=NO_CUDA),
    case("context_parallel.py", "--gpus 1,abc", "argument --gpus: '1,abc': 'abc'"),
    case("context_parallel.py", "--gpus 2 --seq-lens 131070", "seq_len=131070: must be a multiple of 2 x parallel.cp"),
    case("context_parallel.py", "--gpus 1,2 --attns triton --head-groups 1,5",
         "parallel.cp_head_groups=5: must divide the model's 12 K/V heads"),
    case("context_parallel.py", "--gpus 1 --head-groups 2", "--head-groups 2: no run would use it"),
    # sweep_summary.py
    case("sweep_summary.py", "{in}/nonexistent", "nonexistent: no such directory"),
    case("sweep_summary.py", "{in}/sweep", "metrics.jsonl, line 2, is not JSON",
         lambda d: sweep(d, {"metrics.jsonl": '{"step": 1}\nnot json\n{"step": 2}\n'}), what="bad metrics line"),
    case("sweep_summary.py", "{in}/sweep", "metrics.jsonl: Is a directory",
         lambda d: sweep(d, {"metrics.jsonl": None}), what="metrics.jsonl a directory"),
    case("sweep_summary.py", "{in}/sweep", "tokens_per_s='fast' is not a number",
         lambda d: sweep(d, {"metrics.jsonl": '{"step": 1, "loss": 5.0, "tokens_per_s": "fast"}\n'}),
         what="a string for a number"),
    case("sweep_summary.py", "{in}/sweep", 'line 1: {"hello": 1} is not a train.py metrics record',
         lambda d: sweep(d, {"metrics.jsonl": '{"hello": 1}\n{"hello": 2}\n'}), what="foreign metrics"),
    case("sweep_summary.py", "{in}/sweep", "summary.json is not JSON",
         lambda d: sweep(d, {"summary.json": ""}), what="empty summary.json"),
    case("sweep_summary.py", "{in}/sweep", 'summary.json holds {"hello": 1}',
         lambda d: sweep(d, {"summary.json": '{"hello": 1}'}), what="foreign summary.json"),
    case("sweep_summary.py", "{in}/sweep", "summary.json holds [1]",
         lambda d: sweep(d, {"summary.json": "[1]"}), what="summary.json a list"),
    case("sweep_summary.py", "{in}/sweep", "config.yaml is not a readable YAML config",
         lambda d: sweep(d, {".hydra/config.yaml": "attn: [\n"}), what="bad YAML"),
    case("sweep_summary.py", "{in}/sweep", "config.yaml holds attn.name=None",
         lambda d: sweep(d, {".hydra/config.yaml": "seq_len: 64\n"}), what="config without attn"),
    case("sweep_summary.py", "{in}/sweep --out {in}/file", "argument --out: ",
         lambda d: (sweep(d, {}), (d / "file").write_text(""))),
    case("sweep_summary.py", "{in}/sweep --out {in}/ro/summary", "is not writable",
         lambda d: (sweep(d, {}), read_only(d)), marks=NOT_ROOT),
    # sample.py
    case("sample.py", "ckpt=run attention=nosuch", "attention=nosuch: Invalid value 'nosuch', expected one of [naive"),
    case("sample.py", "ckpt=run attn=naive", "attn=naive: no such key; every key, with its default: configs/schema.py"),
    case("sample.py", "", "ckpt is not set", what="(no ckpt)"),
    case("sample.py", "ckpt=run device=gpu", "device=gpu: choose auto, cpu, cuda or cuda:N"),
    case("sample.py", "ckpt=run device=cuda", "device=cuda: this machine has no CUDA GPU", marks=NO_CUDA),
    case("sample.py", "ckpt=run temperature=0", "temperature=0.0: must be a positive number"),
    case("sample.py", "ckpt=run temperature=nan", "temperature=nan: must be a positive number"),
    case("sample.py", "ckpt=run top_k=0", "top_k=0: must be at least 1"),
    case("sample.py", "ckpt=run num_samples=0", "num_samples=0: must be at least 1"),
    case("sample.py", "ckpt=run max_new_tokens=-1", "max_new_tokens=-1: must be at least 0"),
    case("sample.py", "ckpt=run max_new_tokens=1.5", "max_new_tokens=1.5"),
    case("sample.py", "ckpt=run prompt=", "prompt='': must not be empty"),
    case("sample.py", "ckpt=run temprature=1", "temprature=1: no such key (did you mean temperature?)"),
    case("sample.py", "ckpt=run --bogus", "unrecognized arguments: --bogus"),
    case("sample.py", "ckpt={in}/nonexistent", "/nonexistent: no checkpoint at"),
    # loss_equivalence.py
    case("loss_equivalence.py", "attns=[sdpa]", "attns=['sdpa']: list two or more distinct attentions"),
    case("loss_equivalence.py", "attns=[sdpa,nosuch]", "attns=['sdpa', 'nosuch']"),
    case("loss_equivalence.py", "attns=[sdpa,sdpa]", "attns=['sdpa', 'sdpa']"),
    case("loss_equivalence.py", "attns=sdpa", "attns=sdpa: Invalid value assigned: str is not a ListConfig"),
    case("loss_equivalence.py", "seq_len=-1", "seq_len=-1: must be at least 1"),
    case("loss_equivalence.py", "resume={in}/damaged.pt", "damaged.pt: the check trains every attention from step 0",
         lambda d: (d / "damaged.pt").write_text("not a checkpoint")),
    case("loss_equivalence.py", "device=gpu", "device=gpu: choose auto, cpu, cuda or cuda:N"),
    case("loss_equivalence.py", "data.root={in}/file", "file is a file", lambda d: (d / "file").write_text("")),
    case("loss_equivalence.py", "print_every=0", "print_every=0: must be at least 1"),
    case("loss_equivalence.py", "print_every=-1", "print_every=-1: must be at least 1"),
    case("loss_equivalence.py", "model.n_layers=1", "model.n_layers=1: no such key (did you mean model.n_layer?)"),
    case("loss_equivalence.py", "hydra.run.dir={in}/file", "file: is a file", lambda d: (d / "file").write_text("")),
    case("loss_equivalence.py", "--bogus", "unrecognized arguments: --bogus"),
]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def run(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("script, args, expected, setup", BAD)
def test_a_bad_command_line_exits_2_with_one_line_and_creates_nothing(script, args, expected, setup, tmp_path):
    inputs, cwd = tmp_path / "inputs", tmp_path / "cwd"
    inputs.mkdir()
    cwd.mkdir()
    if setup:
        setup(inputs)
    before = snapshot(inputs)
    done = run(script, shlex.split(args.format(**{"in": inputs})), cwd)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert list(cwd.iterdir()) == [] and snapshot(inputs) == before


def test_what_stops_a_script_before_its_first_step_is_one_line_and_leaves_no_run_dir(tmp_path):
    # loss_equivalence.py preparing its data with a tokenizer cache that cannot be made: train.py's
    # one line (exit 2), and the run dir it claimed for its first attention given up
    (tmp_path / "file").write_text("")
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "loss_equivalence.py"), *TINY, "attns=[sdpa,naive]",
                           f"data.root={tmp_path / 'data'}", "wandb.mode=disabled", f"hydra.run.dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TIKTOKEN_CACHE_DIR": str(tmp_path / "file" / "x")})
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[20")]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: TIKTOKEN_CACHE_DIR="), done.stderr
    assert not (out / "sdpa").exists()


def test_a_directory_in_place_of_a_scripts_output_file_is_one_line(tmp_path):
    sweep(tmp_path, {})
    (tmp_path / "out" / "summary.md").mkdir(parents=True)
    done = run("sweep_summary.py", [str(tmp_path / "sweep"), "--out", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'out' / 'summary.md'} cannot be written: Is a directory (temp file removed; the previous "
        "file is intact)"], done.stderr


def test_long_context_records_a_failed_rung_and_fits_memory(data_root, tmp_path):
    from scripts import long_context as lc

    # a rung that cannot run is a row with its one-line reason, not a traceback: here a window
    # longer than the training split, with data.cycle off
    cfg = compose(TINY + [f"data.root={data_root}", "seq_len=2000000", "model.max_seq_len=2000000",
                          "wandb.mode=disabled", "data.cycle=false"])
    row = lc.rung(cfg, tmp_path)
    assert (row["status"], row["seq_len"], row["mlp_chunk"]) == ("error", 2000000, 0)
    assert row["reason"].startswith("DatasetError: ") and "data.cycle=true" in row["reason"]
    # peak = 2 GiB + 1 GiB per 2^20 tokens: the fit finds both, and the longest that fits
    ok = [{"attn": "triton", "ac": "offload", "mlp_chunk": 65536, "seq_len": t, "status": "ok", "tokens_per_s": 1.0,
           "step_s": 1.0, "peak_mem_alloc_gib": 2 + t / 2**20, "reason": ""} for t in (2**18, 2**19, 2**20)]
    rows = ok + [{**row, "attn": "triton", "ac": "offload", "mlp_chunk": 65536, "seq_len": 2**21}]
    ((fixed, per_token),) = lc.fit(rows).values()
    assert fixed == pytest.approx(2) and per_token * 2**20 == pytest.approx(1)
    table = lc.table(rows)
    assert "| triton | offload | 65536 | 1,048,576 |" in table and "| 2,097,152: DatasetError: " in table
    assert f"| {76 * 2**20:,} | {137 * 2**20:,} |" in lc.fit_table(rows)


def test_host_overhead_has_a_help(tmp_path):
    done = run("host_overhead.py", ["--help"], tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: host_overhead.py [-h]")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def checkpoint(data_root, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sample") / "run"
    train_module.train(compose(TINY + [f"data.root={data_root}", "max_steps=2", "wandb.mode=disabled"]), run_dir)
    return run_dir


@pytest.mark.parametrize("attention", ["naive", "sdpa", "triton", "null"])
def test_sample_runs_with_each_attention_and_the_trained_one(attention, checkpoint, tmp_path):
    done = run("sample.py", [f"ckpt={checkpoint}", f"attention={attention}", "prompt=ROMEO:", "max_new_tokens=4",
                             "device=cpu"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ROMEO:") and len(done.stdout) > len("ROMEO:")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def fa4_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The checkpoint as a run with attn=fa4 writes it: a machine without FlashAttention-4 cannot train one."""
    state = load_checkpoint(checkpoint / CHECKPOINT_NAME)
    state["config"]["attn"]["name"] = "fa4"
    path = tmp_path_factory.mktemp("fa4") / CHECKPOINT_NAME
    save_checkpoint(path, {key: state[key] for key in KEYS})
    return path


@pytest.mark.skipif(fa4_unsupported(16, torch.float32, torch.device("cpu")) is None, reason="FA4 runs here")
@pytest.mark.parametrize("attention, said", [
    ("null", "attention=null: the checkpoint trained with attn=fa4, which cannot run here: FlashAttention-4 needs"),
    ("fa4", "attention=fa4: cannot run here: FlashAttention-4 needs")])
def test_sample_refuses_an_attention_this_machine_cannot_run_in_one_line(attention, said, fa4_checkpoint, tmp_path):
    done = run("sample.py", [f"ckpt={fa4_checkpoint}", f"attention={attention}", "device=cpu"], tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr[-2000:]
    assert done.stderr.startswith(f"error: {said}") and "attention=sdpa" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_sample_takes_a_prompt_with_a_comma_as_typed(checkpoint, tmp_path):
    done = run("sample.py", [f"ckpt={checkpoint}", "prompt=To be, or not", "max_new_tokens=2", "device=cpu"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("To be, or not")
