"""Datasets as flat files of GPT-2 tokens: prepare them once, then draw random training windows.

prepare() lives in data.prepare (`from data.prepare import prepare`) and is not re-exported
here: importing it from this package would make `python -m data.prepare` import that module
twice, which runpy warns about.
"""

from data.loader import SPLITS, DatasetError, TokenWindows, load_meta
from data.tokenizer import EOT, VOCAB_SIZE, get_encoding

__all__ = ["EOT", "SPLITS", "VOCAB_SIZE", "DatasetError", "TokenWindows", "get_encoding", "load_meta"]
