"""What every test file shares: the environment, the markers, and Shakespeare prepared once.

- FLASH_ATTENTION_AUTOTUNE=0 and a fixed BLAS thread count for the whole suite (subprocesses
  inherit them). Benchmarking every block config for every new test shape would take most of a
  GPU run; correctness cannot depend on it, and test_gpu_every_tuning_config_is_correct runs
  each config instead.
- Markers: `gpu` tests need CUDA and are skipped, with that reason, where there is none; `slow`
  tests start processes or train for tens of steps (`-m "not slow"` leaves them out while iterating).
- Every test ends with TF32 as it found it (training turns it on for its process).
- `data_root`: the real Shakespeare dataset, prepared once per session into a temp dir;
  `short_docs`: overrides for a dataset of short documents (a local JSON corpus through the
  Hugging Face path), so that a training window holds several of them.
"""

import json
import os
import random

os.environ["FLASH_ATTENTION_AUTOTUNE"] = "0"
# a fixed thread count for the BLAS (subprocesses too): one that adapts it to the machine's load
# sums in another order from run to run, and the bit-for-bit resume tests would depend on the load
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

import pytest  # noqa: E402
import torch  # noqa: E402

from data.prepare import prepare  # noqa: E402
from tests.helpers import compose  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: starts processes or trains for tens of steps")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run the suite on a CUDA machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _float32_matmuls_as_found():
    # training turns TF32 on for its process (train.py: setup); a test that trains in this process
    # must not hand it to the float32 tests after it, whose tolerances assume full float32 products
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("data")
    prepare(compose([f"data.root={root}"]).data)
    return str(root)


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory) -> list[str]:
    corpus = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = "the a king queen lord lady sword crown night day love war speak hear come go".split()
    with open(corpus / "train.jsonl", "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(2, 20)))}) + "\n")
    overrides = ["data=tinystories", "data.name=shortdocs", f"data.hf_path={corpus}", "data.val_fraction=0.2",
                 f"data.root={tmp_path_factory.mktemp('shortdocs')}"]
    prepare(compose(overrides).data)
    return overrides
