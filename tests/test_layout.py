"""The packages import downwards only: train.py and scripts/ -> trainer/ -> configs/ -> data/ ->
model/ -> kernels/. A lower layer never names a higher one (not even inside a function), so each
can be read, tested and reused without what sits above it; the model and its kernels import no
config library (Hydra, OmegaConf) at all.

    .venv/bin/python -m pytest tests/test_layout.py -q
"""

import ast
import subprocess
import sys

import pytest

from tests.helpers import REPO

LAYERS = ["trainer", "configs", "data", "model", "kernels"]  # top to bottom; train.py and scripts/ above all


def imported_packages(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_the_layers_below_it(package):
    above = set(LAYERS[:LAYERS.index(package)]) | {"train", "scripts", "tests"}
    for path in sorted((REPO / package).rglob("*.py")):
        upward = imported_packages(path) & above
        assert not upward, f"{path.relative_to(REPO)} imports {sorted(upward)}, which sit above {package}/"


def test_the_model_imports_no_config_library():
    # a fresh process: the test session itself has Hydra loaded
    script = ("import sys, model, kernels\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf')))")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]", f"`import model` pulls in {run.stdout.strip()}"
