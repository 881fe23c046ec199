"""The teaching path holds: kernels/reference/flash_steps.py passes, and docs/flash-attention.md points at real code.

Proves that (1) every step of `python -m kernels.reference.flash_steps` (online softmax, FlashAttention-1
and -2 forwards, P from LSE, delta, the two-pass backward, causal block skipping, GQA, the
repository's reference and Triton kernels) agrees with dense attention within its bound, for
two seeds, and that a NaN error never counts as a pass; (2) the script run as a module exits 0;
(3) every `file.py: function` pointer in docs/flash-attention.md names a function defined at
the top level of that file, so a rename in the kernels cannot leave the doc pointing at nothing.
Pure PyTorch and Triton's CPU interpreter, ~20 seconds on 2 cores:

    .venv/bin/python -m pytest tests/test_flash_steps.py -q
"""

import ast
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from kernels.reference import flash_steps
from tests.helpers import REPO

DOC = REPO / "docs" / "flash-attention.md"
POINTER = re.compile(r"`([\w/]+\.py): (\w+)`")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("step", flash_steps.STEPS, ids=lambda s: s.name)
def test_every_step_passes_its_bound(step, seed):
    error, note = flash_steps.run_step(step, seed)
    assert math.isfinite(error), f"{step.name}: error {error}"
    assert flash_steps.passes(error, step.bound), f"{step.name}: error {error:.3g} > bound {step.bound:.0e} ({note})"


def test_nan_never_passes():
    assert not flash_steps.passes(float("nan"), 1.0)
    # a NaN in any output, not only the first compared, is the step's error
    error = flash_steps.max_error((torch.zeros(3), torch.zeros(3)), (torch.tensor([0.0, float("nan")]), torch.zeros(2)))
    assert math.isnan(error)


@pytest.mark.slow
def test_script_exits_zero():
    done = subprocess.run([sys.executable, "-m", "kernels.reference.flash_steps"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "FAIL" not in done.stdout
    for step in flash_steps.STEPS:
        assert step.name in done.stdout


def _top_level_functions(path):
    """Functions, classes and assigned names (a pointer may name a table the code reads)."""
    tree = ast.parse(path.read_text())
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_doc_pointers_name_existing_functions():
    text = DOC.read_text()
    pointers = POINTER.findall(text)
    assert len(pointers) >= 20, "the doc's `file.py: function` pointers were not found: has their form changed?"
    # a code span that names a .py file must be a pointer of exactly that form (one function each)
    spans = [s for s in re.findall(r"`([^`\n]+)`", text) if re.match(r"[\w/]+\.py:", s)]
    assert all(POINTER.fullmatch(f"`{s}`") for s in spans), [s for s in spans if not POINTER.fullmatch(f"`{s}`")]
    missing = []
    for path, name in sorted(set(pointers)):
        file = REPO / path
        if not file.is_file() or name not in _top_level_functions(file):
            missing.append(f"{path}: {name}")
    assert not missing, f"docs/flash-attention.md points at functions that do not exist: {missing}"
