"""Datasets as flat files of GPT-2 tokens: prepare them once, then draw random training windows.

prepare() lives in data.prepare (`from data.prepare import prepare`; scripts/prepare_data.py
runs it from the command line); this package's own import stays light.
"""

from data.loader import SPLITS, DatasetError, TokenWindows, load_meta
from data.tokenizer import EOT, VOCAB_SIZE, TokenizerError, document_ids, get_encoding

__all__ = ["EOT", "SPLITS", "VOCAB_SIZE", "DatasetError", "TokenWindows", "TokenizerError", "document_ids",
           "get_encoding", "load_meta"]
