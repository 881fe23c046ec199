"""Every use of Triton's internals, in one file behind one version check.

Triton's public API (triton.jit, triton.Config, triton.language, Gluon) builds and launches the
kernels. Four things need more, and reach into modules and attributes whose names and signatures
change from one Triton release to the next:

- the interpreted twin of a kernel, so that CPU tensors run in Triton's interpreter in the same
  process whose CUDA tensors run compiled kernels (`interpreted`, `interpreting`);
- a launch straight into a compiled kernel's C launcher, without the front door's per-call Python
  (`DirectLaunch`, `launch_compiled`; kernels/runtime/launch.py's Bound uses them);
- what a GPU reports (`max_shared_memory`), and a driver that compiles for sm_90 where there is
  none (`stand_in`);
- what Gluon builds but does not name: its aggregates, a TMA reduce-add, a buffer viewed under
  another shape (`aggregate`, `tma_add`, `reinterpret`).

RELEASES are the Triton releases these were written against and tested with; another fails at
import with one line that says what to install.
"""

import contextlib
import functools
import re
import sys
import types
from typing import NamedTuple

import numpy as np
import torch
import triton

RELEASES = ((3, 6), (3, 9))  # 3.6: the GPU's (the Hopper kernels' Gluon); up to 3.9: the CPU's, interpreted
_RELEASE = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
if not RELEASES[0] <= _RELEASE <= RELEASES[1]:
    raise ImportError(f"kernels: triton {triton.__version__} is not a release whose internals kernels/runtime/"
                      f"internals.py knows (3.6 to 3.9): pip install 'triton>=3.6,<3.10'")

# Triton's argument specializer imports Gluon on first use, and Gluon's import needs
# triton.language's functions to be the compiled ones: it is imported here, before any swap
import triton.experimental.gluon  # noqa: E402, F401
from triton import knobs  # noqa: E402  (the names below exist in RELEASES)
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402, F401  (for kernels/runtime/launch.py)
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language._core import builtin  # noqa: E402
from triton.language.core import _aggregate as aggregate  # noqa: E402, F401  (Gluon's own: no public name)
from triton.runtime import _allocation, driver  # noqa: E402
from triton.runtime import interpreter as _triton_interpreter  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402, F401  (for kernels/runtime/launch.py)
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# --------------------------------------------------------------------------------------------
# the interpreted twin: Triton decides between compiling and interpreting once, when @triton.jit
# runs, from TRITON_INTERPRET. Here the choice follows the tensors instead. `interpreted(kernel)`
# builds the twin: the kernel's Python function and every @triton.jit helper it calls, each rebound
# to a copy of its own module's globals in which the helpers it names are interpreted too (a helper
# is found where it is imported by name, not as a module attribute). Triton's own @triton.jit
# library functions (tl.max, tl.sum, ...) are swapped for interpreted twins only while a CPU launch
# runs (`interpreting()`), which also puts back everything the interpreter patched in
# triton.language, so compiled kernels never see it. When TRITON_INTERPRET=1 was set before import,
# every kernel already is an InterpretedFunction and is used as it is.

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
        if "INTERPRETED" in namespace:  # a module's kernels ask where they run (no inline PTX here)
            namespace["INTERPRETED"] = triton.language.constexpr(True)
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
    return [m for name, m in list(sys.modules.items())
            if name == "triton.language" or name.startswith("triton.language.")]


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
    # Triton 3.6 converts interpreter scalars with int(array of shape (1,)), which numpy >= 2.4
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


# --------------------------------------------------------------------------------------------
# launching a compiled kernel


class HostDescriptor(NamedTuple):
    """What Triton's C launcher reads of a host TensorDescriptor (base address, shape, strides,
    padding) and nothing more: the tensor itself is not kept, and none of TensorDescriptor's checks
    run again (the first launch of the signature ran them)."""
    base: "Address"
    shape: list
    strides: list
    padding: str


class Address(NamedTuple):
    """A device address where a descriptor wants its base tensor: all a later launch reads of it."""
    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


class DirectLaunch:
    """The C launch function of one compiled kernel (of the Triton release `of` checks for), called
    as Triton's launcher object calls it, less that object's per-call Python: the scratch it asks
    for (none here), and the expansion of each host TMA descriptor into an encoded tensor map, its
    shape and strides, which is made once per address here and kept (a training step's tensors
    come back at the same addresses from torch's caching allocator, step after step)."""

    KEPT = 1024  # encoded descriptors kept per descriptor argument, the oldest dropped first past that

    def __init__(self, launch, head: tuple, expand, descriptors: tuple):
        self.launch = launch
        self.head = head  # function, cooperative, pdl, scratch (2), kernel metadata, launch metadata, hooks (2)
        self.expand = expand  # (HostDescriptor, index) -> [tensor map, *shape, *strides]
        self.descriptors = descriptors
        self.encoded = [{} for _ in descriptors]  # per descriptor argument: address -> its expansion

    @classmethod
    def of(cls, compiled, descriptors: tuple) -> "DirectLaunch | None":
        """The direct launch of `compiled`, or None where its launcher is not the one known here
        (another Triton, scratch memory to allocate per launch, a stand-in)."""
        run = getattr(compiled, "run", None)
        if run is None or not triton.__version__.startswith("3.6.") or getattr(run, "global_scratch_size", 1) \
                or getattr(run, "profile_scratch_size", 1):
            return None
        launch = run.launch
        if descriptors:  # the C function sits inside the wrapper that expands descriptors
            launch = next((c.cell_contents for c in launch.__closure__ or ()
                           if getattr(c.cell_contents, "__name__", "") == "launch"), None)
        if not callable(launch) or getattr(launch, "__name__", "") != "launch":
            return None
        metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descriptors)
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
                None, None, None)
        return cls(launch, head, lambda desc, i: _expand(desc, metas[i]), descriptors)

    def __call__(self, grid: tuple[int, int, int], device: int, tensors: tuple, tail: tuple) -> None:
        args = []
        for i, (t, encoded) in enumerate(zip(tensors, self.encoded)):
            address = t.data_ptr()
            expanded = encoded.get(address)
            if expanded is None:
                if len(encoded) >= self.KEPT:
                    del encoded[next(iter(encoded))]  # dicts keep insertion order: the oldest
                expanded = encoded[address] = self.expand(HostDescriptor(Address(address), *self.descriptors[i]), i)
            args += expanded
        args += [None if t is None else t.data_ptr() for t in tensors[len(self.encoded):]]
        with on_device_index(device):
            self.launch(*grid, current_stream()(device), *self.head, *args, *tail)


def _expand(descriptor: HostDescriptor, meta: dict | None) -> list:
    """What Triton's launcher passes for a host TMA descriptor: the encoded tensor map (where
    the kernel was compiled to take one), its shape and strides."""
    from triton.backends.nvidia.driver import make_tensordesc_arg
    return make_tensordesc_arg(descriptor, meta)


def launch_compiled(compiled, grid: tuple[int, int, int], device: int, args: tuple) -> None:
    """Launches a compiled kernel through Triton's C launcher on the device's current stream, every
    argument given in order (tensors as addresses or tensors, constexprs included), without the
    front door's binding and specialization: the caller has compiled it for these arguments."""
    with on_device_index(device):
        if hooked():
            compiled[grid](*args)
            return
        # grid, stream, function, metadata, launch metadata and hooks (none), args
        compiled.run(*grid, current_stream()(device), compiled.function, compiled.packed_metadata, None, None, None,
                     *args)


def hooked() -> bool:
    """Whether Triton's launch hooks are set (a HookChain, or in older releases a callable or None)."""
    return any(getattr(hook, "calls", hook) for hook in (knobs.runtime.launch_enter_hook,
                                                         knobs.runtime.launch_exit_hook))


def _descriptor_memory(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory a launch asks for: here, the TMA descriptors its programs build (on the current
    device and stream; the caching allocator's 512-byte alignment covers Triton's 128)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Descriptors made in a kernel need a scratch allocator. Triton keeps it in a context variable,
    so autograd's backward thread starts without one: checked per launch, and one a user set is kept."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_memory)


def on_device_index(index: int):
    """Makes CUDA device `index` current, where it is not already (checking costs less than switching)."""
    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


@functools.cache
def current_stream():
    """Triton's current-stream lookup (torch's raw stream handle), resolved once through its driver proxy."""
    return driver.active.get_current_stream


def max_shared_memory(device_index: int) -> int:
    """The shared memory one block may opt into on CUDA device `device_index`."""
    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# --------------------------------------------------------------------------------------------
# compiling for sm_90 without a GPU


class StandIn(DriverBase):
    """A Triton driver for an sm_90 GPU that is not there: it compiles, and launches nothing."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the sm_90 stand-in compiles only: there is no GPU to time")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


@contextlib.contextmanager
def stand_in():
    """Triton compiles for sm_90 inside this block, whatever the machine has."""
    previous = driver._active  # None until something asked: reset_active() would look for a real GPU
    driver.set_active(StandIn())
    try:
        yield
    finally:
        driver._active = previous


# --------------------------------------------------------------------------------------------
# Gluon


@gluon.jit
def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """Shared memory `smem` viewed under another dtype, shape and layout (the pinned Gluon's
    _reinterpret; later releases call it reinterpret)."""
    return smem._reinterpret(dtype, shape, layout)


@builtin
def tma_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of shared memory `src` into the descriptor's box at `coord` (Gluon builds the
    op but exposes no wrapper)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
