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


def imported_modules(path) -> set[str]:
    """The modules a file imports, by their full names (`from a.b import c` is a.b.c where this
    repository has c as a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            folder = REPO.joinpath(*node.module.split("."))
            for alias in node.names:
                is_module = (folder / f"{alias.name}.py").is_file() or (folder / alias.name).is_dir()
                names.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return names


def imported_packages(path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


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


# inside kernels/, top to bottom: what calls the kernels; the Hopper kernels (whose Triton passes
# share the portable kernels' blocks); the portable kernels; what both accept; the mask, the FLOP
# count and what launches any kernel. The names are the first part of a module's name under kernels.
KERNEL_LAYERS = [{"__init__", "api", "backends", "ring_attention", "decode", "cross_entropy", "reference"},
                 {"hopper"}, {"triton"}, {"inputs"}, {"masking", "score_mods", "flops", "runtime"}]


def _kernel_layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    layers = [i for i, names in enumerate(KERNEL_LAYERS) if part in names]
    assert layers, f"{module}: kernels/{part} has no layer in KERNEL_LAYERS: add it where it belongs"
    return layers[0]


def test_inside_kernels_imports_point_down():
    for path in sorted((REPO / "kernels").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        layer = _kernel_layer(module)
        kernel_modules = (m for m in imported_modules(path) if m.split(".")[0] == "kernels")
        upward = sorted(m for m in kernel_modules if _kernel_layer(m) < layer)
        assert not upward, f"{module} imports {upward}, which sit above it in kernels/"


def test_the_kernels_limits_and_constants_have_one_home():
    # a constant defined twice drifts: each is assigned in one module only
    for name in ("MAX_HEAD_DIM", "LOG2E"):
        homes = [str(path.relative_to(REPO)) for path in sorted((REPO / "kernels").rglob("*.py"))
                 if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
                        for node in ast.parse(path.read_text()).body)]
        assert len(homes) == 1, f"{name} is assigned in {homes}"


# Triton's modules and names outside its public API: they change from one release to the next
TRITON_INTERNALS = ("triton._C", "triton.runtime", "triton.backends", "triton.compiler", "triton.language.core",
                    "triton.experimental.gluon.language._core")


def test_only_one_file_reaches_into_triton():
    # one file to read, and to change, when Triton moves its internals: kernels/runtime/internals.py
    files = [REPO / "train.py", *(path for folder in ("kernels", "model", "trainer", "scripts", "tests")
                                  for path in sorted((REPO / folder).rglob("*.py")))]
    for path in files:
        if path == REPO / "kernels/runtime/internals.py":
            continue
        reached = sorted(m for m in imported_modules(path) if m.startswith(TRITON_INTERNALS))
        assert not reached, f"{path.relative_to(REPO)} imports {reached}: use kernels/runtime/internals.py"


def test_kernels_functions_are_short_and_kernels_take_few_parameters():
    # a kernel or helper of more than 16 parameters takes aggregates instead (tuples of strides,
    # sizes, scales; the Hopper kernels' buffers and work); no function runs past 80 lines
    for path in sorted((REPO / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            where = f"{path.relative_to(REPO)}: {node.name}"
            assert node.end_lineno - node.lineno < 80, f"{where} runs {node.end_lineno - node.lineno + 1} lines"
            jit = any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)
            params = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
            assert not jit or params <= 16, f"{where} takes {params} parameters"


def test_no_test_module_imports_another():
    # what the test files share lives in tests/helpers.py (and the workers they start)
    for path in sorted((REPO / "tests").glob("test_*.py")):
        imported = {m for m in imported_modules(path) if m.startswith("tests.test_")}
        assert not imported, f"{path.name} imports {sorted(imported)}: move what it shares to tests/helpers.py"
