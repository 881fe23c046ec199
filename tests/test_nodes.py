"""Several nodes under torchrun, on one CPU machine: two torchrun launches of one gloo process each,
`--nnodes=2 --node-rank=N` meeting at a c10d rendezvous on localhost, as two hosts would.

A SIGTERM to one node's torchrun (what a scheduler sends to one host of a job) goes to its worker;
both ranks stop after the same step, rank 0 checkpoints it, and the two nodes launched again with
resume= go on to the end: the losses and gradient norms equal those of the same job run through,
bit for bit.
    .venv/bin/python -m pytest tests/test_nodes.py -q
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ENV, REPO, TINY, curve, last_step, torchrun
from trainer.checkpoint import load_checkpoint

# the lr schedule runs to max_steps: the same for the stopped, the resumed and the uninterrupted run
RUN = TINY + ["batch_tokens=256", "log_interval=1", "eval_interval=4", "wandb.mode=disabled", "ckpt_interval=50",
              "sample_tokens=0", "max_steps=40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(rank: int, port: int, args: list[str], cwd: Path, log: Path, rendezvous: str) -> subprocess.Popen:
    """One node's torchrun of one worker. rendezvous "static": the node's rank is --node-rank, node 0
    hosts the store at --master-addr:--master-port; "c10d": torchrun's elastic rendezvous at
    --rdzv-endpoint, which hands out the ranks in its own order (hosted by node 0's agent)."""
    meet = ([f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}"] if rendezvous == "static" else
            ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nodes-test",
             f"--rdzv-conf=is_host={int(rank == 0)}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", *meet,
           str(REPO / "train.py"), *args]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def both(args: list[str], cwd: Path, tag: str, rendezvous: str) -> list[subprocess.Popen]:
    port = free_port()
    return [node(rank, port, args, cwd, cwd / f"{tag}-node{rank}.log", rendezvous) for rank in (0, 1)]


def worker_rank(agent: int) -> int | None:
    """The RANK of the worker that torchrun `agent` started, once it has one."""
    try:
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        environ = Path(f"/proc/{children[0]}/environ").read_bytes().decode()
    except (OSError, IndexError):
        return None
    return int(dict(kv.split("=", 1) for kv in environ.split("\0") if "=" in kv).get("RANK", -1))


def logs(cwd: Path, tag: str) -> str:
    return "\n".join((cwd / f"{tag}-node{rank}.log").read_text() for rank in (0, 1))


@pytest.mark.slow
def test_two_nodes_stop_together_on_a_sigterm_to_one_and_resume_bit_for_bit(data_root, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, f"data.root={data_root}", f"hydra.run.dir={run_dir}"]
    nodes = both(args, tmp_path, "first", "static")
    deadline = time.monotonic() + 600
    while last_step(run_dir) < 3 and all(p.poll() is None for p in nodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.poll() is None for p in nodes), logs(tmp_path, "first")[-3000:]
    assert [worker_rank(p.pid) for p in nodes] == [0, 1]
    os.kill(nodes[1].pid, signal.SIGTERM)  # to node 1's torchrun, which passes it to its worker
    for p in nodes:
        p.wait(timeout=300)
    assert all(p.returncode != 0 for p in nodes), logs(tmp_path, "first")[-3000:]
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert step == last_step(run_dir) and 3 <= step < 40, logs(tmp_path, "first")[-3000:]
    said = (tmp_path / "first-node0.log").read_text()  # rank 0, whose node got no signal, says why it stopped
    assert f"stopped by SIGTERM after step {step};" in said, said[-3000:]

    # through c10d's rendezvous: either node may be rank 0 now, reading the other's checkpoint
    again = both([*args, f"resume={run_dir}"], tmp_path, "again", "c10d")
    for p in again:
        p.wait(timeout=600)
    assert [p.returncode for p in again] == [0, 0], logs(tmp_path, "again")[-3000:]
    through = tmp_path / "through"  # one launch, one node: the same two ranks' sums
    torchrun(2, [str(REPO / "train.py"), *RUN, f"data.root={data_root}", f"hydra.run.dir={through}"], tmp_path,
             timeout=600, env=ENV)
    assert curve(run_dir) == curve(through)  # every step once, bit for bit
