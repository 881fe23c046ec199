"""Runs @triton.jit kernels on CPU tensors through Triton's interpreter, in any process.

Triton decides between compiling and interpreting once, when `@triton.jit` runs, from
TRITON_INTERPRET. We want the choice to follow the tensors instead: CUDA tensors run the
compiled kernel, CPU tensors an interpreted twin of it, in the same process (a test suite on
a GPU machine does both). `interpreted(kernel)` builds that twin: the kernel's Python function
and every @triton.jit helper it calls, each rebound to a copy of its own module's globals in which
the helpers it names are interpreted too (a helper is found where it is imported by name, not as
a module attribute). Triton's own @triton.jit library functions (tl.max, tl.sum, ...) are swapped
for interpreted twins only while a CPU launch runs (`interpreting()`), which also puts back
everything the interpreter patched in triton.language, so compiled kernels never see it. When
TRITON_INTERPRET=1 was set before import, every kernel already is an InterpretedFunction and is
used as it is.
"""

import contextlib
import sys
import types

import numpy as np
import triton
import triton.experimental.gluon  # noqa: F401  (see below)
from triton.runtime import interpreter as _triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# Triton's argument specializer imports gluon on first use, and gluon's import requires
# triton.language's functions to be compiled ones: it is imported above, before any swap.

_twins: dict[int, InterpretedFunction] = {}  # id(JITFunction) -> its interpreted twin, built once


def _rebind(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """fn with `namespace` as its globals (the interpreter executes its rewritten source there)."""
    twin = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__, twin.__annotations__, twin.__module__ = fn.__kwdefaults__, fn.__annotations__, fn.__module__
    return twin


def interpreted(kernel):
    """The interpreted twin of a @triton.jit kernel (itself, if it already is one)."""
    if isinstance(kernel, InterpretedFunction):
        return kernel
    return _twin(kernel)


_namespaces: dict[str, dict] = {}  # module name -> a copy of its globals, our @triton.jit functions interpreted


def _twin(fn: JITFunction) -> InterpretedFunction:
    """fn's interpreted twin, built once, running in its own module's interpreted globals."""
    if id(fn) not in _twins:
        _twins[id(fn)] = InterpretedFunction(_rebind(fn.fn, _namespace(fn.fn.__module__)))
    return _twins[id(fn)]


def _namespace(module: str) -> dict:
    """A copy of the module's globals in which every @triton.jit function it names, its own and
    those it imports by name (not triton.language's: see interpreting()), is an interpreted twin."""
    if module not in _namespaces:
        namespace = _namespaces[module] = dict(vars(sys.modules[module]))
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction) and not value.fn.__module__.startswith("triton."):
                namespace[name] = _twin(value)
    return _namespaces[module]


def _language_twins() -> list[tuple[types.ModuleType, str, InterpretedFunction]]:
    """(module, name, twin) for every @triton.jit function of triton.language; one twin per
    function, so that the interpreter's identity checks on reduction combine functions hold."""
    swaps = []
    for module in _language_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swaps.append((module, attr, _twins.setdefault(id(value), InterpretedFunction(value.fn))))
    return swaps


def _language_modules() -> list[types.ModuleType]:
    return [m for name, m in list(sys.modules.items()) if name == "triton.language" or name.startswith("triton.language.")]


def _language_state() -> list[tuple[object, dict]]:
    """The attributes of triton.language's modules and classes, which the interpreter patches. It
    restores what it patched on the modules a kernel names (tl), not on those that tl's own
    functions name (triton.language.core): restoring everything is ours to do."""
    owners = _language_modules()
    owners += [c for m in list(owners) for c in vars(m).values()
               if isinstance(c, type) and c.__module__.startswith("triton.language")]
    return [(owner, dict(vars(owner))) for owner in {id(o): o for o in owners}.values()]


def _restore(state: list[tuple[object, dict]]) -> None:
    for owner, attrs in state:
        for name, value in attrs.items():
            if vars(owner).get(name, _MISSING) is not value:
                setattr(owner, name, value)
        if isinstance(owner, type):  # on modules, names the interpreter added stay: its rewritten code uses them
            for name in set(vars(owner)) - set(attrs):
                delattr(owner, name)


_MISSING = object()


def _patch_lang_with_0d_index(fn):
    # Triton < 3.7 converts interpreter scalars with int(array of shape (1,)), which numpy >= 2.4
    # refuses ("only 0-dimensional arrays can be converted"); loops with tensor bounds need it
    scope = _original_patch_lang(fn)
    scope.set_attr(triton.language.tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    return scope


_original_patch_lang = _triton_interpreter._patch_lang


@contextlib.contextmanager
def interpreting():
    """While inside, triton.language's @triton.jit functions are their interpreted twins; on the way
    out, triton.language is exactly as it was, for the compiled kernels."""
    saved = _language_state()
    if not isinstance(triton.language.zeros, InterpretedFunction):  # not when TRITON_INTERPRET=1 made them so
        for module, attr, twin in _language_twins():
            setattr(module, attr, twin)
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        _triton_interpreter._patch_lang = _patch_lang_with_0d_index
    try:
        yield
    finally:
        _triton_interpreter._patch_lang = _original_patch_lang
        _restore(saved)
