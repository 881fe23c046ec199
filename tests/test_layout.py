"""The packages import downwards only: train.py and scripts/ -> trainer/ -> configs/ -> data/ ->
model/ -> kernels/. A lower layer never names a higher one (not even inside a function), so each
can be read, tested and reused without what sits above it.

    .venv/bin/python -m pytest tests/test_layout.py -q
"""

import ast

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
