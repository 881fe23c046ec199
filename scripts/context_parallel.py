"""Context-parallel scaling: one long sequence per step on 1, 2, 4 ... GPUs of one host.

For each seq_len, attention (--attns: triton, our ring over our kernels; sdpa, torch's
context_parallel over SDPA's) and GPU count N, trains experiment=long_context (GPT-2-small
shape, RoPE, chunked loss, bf16) for --steps steps: N = 1 as a plain process, N > 1 under
torchrun with parallel.cp=N (every sequence split over the N GPUs). Prints and writes
(context_parallel.csv and .md in --out) tokens/s, the time of one step, the peak memory of the
fullest GPU, the scaling efficiency against one GPU with the same attention on the same sequence,
tokens/s(N) / (N x tokens/s(1)), and the last step's loss (the same batches at every N: equal up
to bf16 rounding). --head-groups runs our ring on N > 1 GPUs once for each value of
parallel.cp_head_groups (its heads in that many passes round the ring). Autotuning is off, as in
scripts/long_context.py. A stop signal goes on to the run in flight, which checkpoints and stops;
the script then writes the rows so far and exits as the signal would have ended it.

    python scripts/context_parallel.py --gpus 1,2,4 --seq-lens 65536,131072
    python scripts/context_parallel.py --gpus 1,2 --seq-lens 131072,524288 --attns triton,sdpa
    python scripts/context_parallel.py --gpus 4 --seq-lens 1048576 --steps 1 ac=full
    python scripts/context_parallel.py --gpus 1,2 --seq-lens 131072 --attns triton --head-groups 1,2,4
"""

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

from data.lifetime import die_with_parent  # noqa: E402
from model.attention import ATTENTIONS  # noqa: E402
from trainer.metrics import read_metrics  # noqa: E402
from trainer.signals import STOP_SIGNALS  # noqa: E402
from scripts.args import (ArgumentParser, directory, fail, names, positive_int, positive_ints,  # noqa: E402
                          require_cuda, train_config)
from scripts.outputs import write_csv, write_text  # noqa: E402
from scripts.stopping import Stop, stoppable  # noqa: E402

FIELDS = ["attn", "gpus", "head_groups", "seq_len", "status", "tokens_per_s", "step_s", "peak_mem_alloc_gib",
          "efficiency", "loss", "wall_s"]
SPLITTING = [a.name for a in ATTENTIONS.values() if a.context_parallel]  # what can split a sequence over GPUs


def train_overrides(attn: str, gpus: int, seq_len: int, steps: int, overrides: list[str], head_groups: int = 1
                    ) -> list[str]:
    return (["experiment=long_context", f"attn={attn}", f"seq_len={seq_len}", f"max_steps={steps}",
             "wandb.mode=disabled", *overrides] + ([f"parallel.cp={gpus}"] if gpus > 1 else [])
            + ([f"parallel.cp_head_groups={head_groups}"] if head_groups > 1 else []))


def _child_start(parent: int, mask: set) -> None:
    """In the child, before it runs train.py: killed (kill -9), the script can pass no signal on, so
    the kernel sends the child SIGTERM then (it checkpoints and stops); the stop signals come through
    again."""
    die_with_parent(parent, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def run_child(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, int]:
    """cmd run to its end, and the stop signal this script got meanwhile (0 if none). SIGTERM,
    SIGUSR1 and SIGHUP go on to the child (train.py checkpoints and stops; torchrun passes them to
    its ranks), which would otherwise run on, orphaned, holding the GPUs; Ctrl-C reaches it from the
    terminal, and a second one it sends would cut its own handling short."""
    got = []

    def forward(signum: int, frame) -> None:
        got.append(signum)
        if signum != signal.SIGINT:
            child.send_signal(signum)

    # held back while Popen forks (a stop there would land in the fork's callbacks, logging's, where
    # Python drops it with a traceback) and until the child's are passed on
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    previous = {}
    # its output goes to files, not pipes: were the script killed, a pipe with no reader would end the
    # child at its next line, before the checkpoint its SIGTERM asks for
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            child = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True,
                                     preexec_fn=functools.partial(_child_start, os.getpid(), held))
            previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:
            child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr), got[0] if got else 0


def run(attn: str, gpus: int, seq_len: int, steps: int, out: Path, overrides: list[str], head_groups: int = 1
        ) -> tuple[dict, int]:
    """The row of one run, and the stop signal that arrived during it (0 if none)."""
    run_dir = out / (f"{attn}_gpus{gpus}_T{seq_len}" + (f"_groups{head_groups}" if head_groups > 1 else ""))
    launcher = ([sys.executable] if gpus == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"])
    cmd = [*launcher, str(REPO / "train.py"), f"hydra.run.dir={run_dir}",
           *train_overrides(attn, gpus, seq_len, steps, overrides, head_groups)]
    env = {**os.environ, "FLASH_ATTENTION_AUTOTUNE": "0", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done, stopped = run_child(cmd, env)
    wall = time.perf_counter() - start
    row = {"attn": attn, "gpus": gpus, "head_groups": head_groups, "seq_len": seq_len, "wall_s": wall}
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        print(done.stderr[-2000:], file=sys.stderr)
        oom = "out of memory" in done.stderr.lower()
        return {**row, "status": "oom" if oom else f"failed (exit {done.returncode})"}, stopped
    summary = json.loads(summary_path.read_text())
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if "tokens_per_s" in r][-1]  # a step, even the only one
    tok_s = summary["mean_tokens_per_s"]
    return {**row, "status": summary["status"], "tokens_per_s": tok_s,
            "step_s": summary["tokens_per_step"] / last["tokens_per_s"],
            "peak_mem_alloc_gib": summary["peak_mem_alloc_gib"], "loss": summary["final_loss"]}, stopped


def table(rows: list[dict]) -> str:
    lines = ["| attn | GPUs | head groups | seq_len | tokens/s | s per step | peak allocated GiB (fullest GPU) "
             "| efficiency vs 1 GPU | last loss |",
             "|:--|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['attn']} | {r['gpus']} | {r['head_groups']} | {r['seq_len']:,} | {r['status']} "
                         "| | | | |")
            continue
        eff = f"{r['efficiency']:.2f}" if r.get("efficiency") is not None else "—"
        mem = "—" if r["peak_mem_alloc_gib"] is None else f"{r['peak_mem_alloc_gib']:.1f}"  # None on the CPU
        lines.append(f"| {r['attn']} | {r['gpus']} | {r['head_groups']} | {r['seq_len']:,} | {r['tokens_per_s']:,.0f} "
                     f"| {r['step_s']:.2f} | {mem} | {eff} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main():
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=positive_ints, default=[1, 2, 4],
                   help="comma list of GPU counts (1: no context parallelism)")
    p.add_argument("--seq-lens", type=positive_ints, default=[131072],
                   help="comma list of seq_len, one sequence per step")
    p.add_argument("--attns", type=names(SPLITTING), default=SPLITTING,
                   help=f"comma subset of {','.join(SPLITTING)}: each over every GPU count")
    p.add_argument("--steps", type=positive_int, default=4,
                   help="training steps per run; tokens/s leaves out the first")
    p.add_argument("--head-groups", type=positive_ints, default=[1],
                   help="comma list of parallel.cp_head_groups for our ring on N > 1 GPUs")
    p.add_argument("--out", type=directory, default=f"bench/context_parallel_{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    p.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. ac=full")
    args = p.parse_args()
    ring = [a for a in args.attns if ATTENTIONS[a].context_parallel == "ring"]
    if args.head_groups != [1] and not (ring and max(args.gpus) > 1):
        fail(f"--head-groups {','.join(map(str, args.head_groups))}: no run would use it: it splits our ring's "
             "heads, which runs for triton in --attns on more than one GPU in --gpus")
    ladder = [(s, a, g, h) for s in args.seq_lens for a in args.attns for g in args.gpus
              for h in (args.head_groups if g > 1 and a in ring else [1])]
    for seq_len, attn, gpus, groups in ladder:  # as train.py will check each run, in its number of processes
        train_config(train_overrides(attn, gpus, seq_len, args.steps, args.overrides, groups), world=gpus)
    require_cuda(f"context_parallel.py --gpus {','.join(map(str, args.gpus))}", max(args.gpus))
    args.out.mkdir(parents=True, exist_ok=True)
    rows, stopped = [], 0
    for seq_len, attn, gpus, groups in ladder:
        row, stopped = run(attn, gpus, seq_len, args.steps, args.out, args.overrides, groups)
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        if stopped:
            break
    for row in rows:  # against one GPU with the same attention on the same sequence, wherever it came in --gpus
        one = next((r for r in rows if (r["attn"], r["gpus"], r["seq_len"], r["status"])
                    == (row["attn"], 1, row["seq_len"], "ok")), None)
        if one and row["status"] == "ok" and row["gpus"] > 1:
            row["efficiency"] = row["tokens_per_s"] / (row["gpus"] * one["tokens_per_s"])
    write_csv(args.out / "context_parallel.csv", rows, FIELDS)
    md = table(rows)
    write_text(args.out / "context_parallel.md", md + "\n")
    print("\n" + md)
    if stopped:
        raise Stop(stopped)


if __name__ == "__main__":
    with stoppable("context_parallel.py", lambda: "the run in flight checkpointed and stopped with it; the rows "
                                                  "so far are in --out's table"):
        main()
