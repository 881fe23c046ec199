"""One launch layer for both dialects: a @triton.jit kernel under a config chosen per shape, and a
compiled kernel of either (Triton or Gluon) again, without Triton's front door, as a `Bound`.

CUDA tensors run the compiled kernel under the config that autotuning picked for the shape's
tuning key (benchmarked once per key among the candidates that fit the GPU; with
FLASH_ATTENTION_AUTOTUNE=0 the first of them that compiles and launches). CPU tensors, and any
tensors when TRITON_INTERPRET=1 was set before import, run the kernel's interpreted twin
(kernels/runtime/internals.py) under one small fixed config, so that nothing is benchmarked there.

A launch through Triton's front door binds and specializes every argument again (more Python per
launch than a short sequence's kernel takes: docs/perf-notes.md). A
`Bound` is a compiled kernel with its grid and every argument that is not a tensor fixed for one
input signature; calling it passes the tensors' addresses straight to Triton's C launcher, and
the host TMA descriptors that Gluon kernels take, encoded once per address from the shapes and
strides the signature fixes. `Launcher.bind` binds a Triton kernel's launch, `bind` any compiled
kernel's.
"""

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable

import torch
import triton
from triton import knobs
from triton.testing import do_bench

from kernels.runtime import chips
from kernels.runtime.internals import (Address, CompilationError, DirectLaunch, HostDescriptor, OutOfResources,
                                       ensure_allocator, hooked, interpreted, interpreting, launch_compiled,
                                       on_device_index)

Grid = Callable[[dict], tuple[int, ...]]  # config kwargs -> launch grid


def interprets(device: torch.device) -> bool:
    """Whether @triton.jit kernels launched on `device` run in Triton's interpreter: on the CPU, and
    anywhere when TRITON_INTERPRET=1 made every kernel an InterpretedFunction."""
    return device.type == "cpu" or INTERPRET_ALL


INTERPRET_ALL = bool(knobs.runtime.interpret)  # read as @triton.jit reads it, when the kernels are made


def autotuning() -> bool:
    return os.environ.get("FLASH_ATTENTION_AUTOTUNE", "1") != "0"


class PreparedLaunches(OrderedDict):
    """The launches prepared so far, for both dialects, by (owner, input signature): a Bound, or an
    owner's group of them (the Hopper backward's three). The least recently used goes past LIMIT:
    a process that meets ever new shapes (decoding at every length, say) keeps only the recent."""

    LIMIT = 256

    def get(self, key, default=None):
        try:
            self.move_to_end(key)  # used now: the last to go
        except KeyError:
            return default
        return super().get(key, default)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.LIMIT:
            self.popitem(last=False)


PREPARED = PreparedLaunches()  # every prepared launch of the process


class Launcher:
    """One kernel, its candidate configs in order of preference, and the choices made so far.

    prune(configs, constexprs, itemsize, chip) keeps the configs that fit the chip for those
    constexprs and that input width (None: all); it raises chips.NoConfigFits if none does.
    """

    def __init__(self, kernel, configs: list[triton.Config], cpu_config: triton.Config,
                 prune: Callable[[list[triton.Config], dict, int, chips.Chip], list[triton.Config]] | None = None):
        self.kernel, self.configs, self.cpu_config, self.prune = kernel, configs, cpu_config, prune
        self.chosen: dict[tuple, triton.Config] = {}  # tuning key -> config
        self.compiled: dict[tuple, object] = {}  # (config, constexprs, device, specialization) -> CompiledKernel
        self._pinned: triton.Config | None = None

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def candidates(self, constexprs: dict, itemsize: int, chip: chips.Chip) -> list[triton.Config]:
        """The configs autotuning chooses among for these constexprs, input width and GPU."""
        return self.prune(self.configs, constexprs, itemsize, chip) if self.prune else self.configs

    @contextlib.contextmanager
    def pinned(self, config: triton.Config):
        """Runs every launch inside under `config`, on the GPU and the CPU alike (tests, tuning)."""
        self._pinned = config
        try:
            yield
        finally:
            self._pinned = None

    def __call__(self, grid: Grid, args: tuple, key: tuple, **constexprs) -> None:
        """Launches kernel(*args, **constexprs) on args[0]'s device; key names the shape class."""
        if interprets(args[0].device):
            config = self._pinned or self.cpu_config
            with interpreting():
                interpreted(self.kernel)[grid(config.kwargs)](*args, **constexprs, **config.kwargs)
            return
        config = self._pinned or self.chosen.get(key)
        if config is not None:
            self._launch(config, grid, args, constexprs)
        elif autotuning():
            self.chosen[key] = config = self._tune(grid, args, constexprs)
            self._launch(config, grid, args, constexprs)
        else:
            self.chosen[key] = self._first_that_launches(grid, args, constexprs)

    def bound_for(self, signature: tuple) -> "Bound | None":
        """The launch bound for this input signature by an earlier call of `bind` (None while a
        config is pinned: the pin decides)."""
        return None if self._pinned else PREPARED.get((self, signature))

    def bind(self, signature: tuple, grid: Grid, args: tuple, key: tuple, **constexprs) -> None:
        """Launches like __call__, then binds the compiled kernel, its grid and args' non-tensor
        arguments to `signature`, which must fix all of them, and the leading tensors' dtypes and
        16-byte alignment (nothing is bound on the CPU or while a config is pinned)."""
        self(grid, args, key, **constexprs)
        if interprets(args[0].device) or self._pinned:
            return
        config = self.chosen[key]
        compiled = self.compiled[self._compiled_key(config, args, constexprs)]
        PREPARED[(self, signature)] = bind(self.kernel, compiled, grid(config.kwargs), args,
                                           {**constexprs, **config.kwargs}, tma=bool(constexprs.get("TMA")))

    def _launch(self, config: triton.Config, grid: Grid, args: tuple, constexprs: dict) -> None:
        # Triton's own launch path binds and specializes every argument on every call (tens of
        # microseconds, several times a training step); the compiled kernel is cached here per
        # (config, constexprs, device, specialization) and launched directly
        key = self._compiled_key(config, args, constexprs)
        if constexprs.get("TMA"):
            ensure_allocator()
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid(config.kwargs)](*args, **constexprs, **config.all_kwargs())
            return
        named = {**constexprs, **config.kwargs}
        dims = (*grid(config.kwargs), 1, 1)[:3]  # the compiled kernel's launcher takes exactly three
        compiled[dims](*args, *(named[name] for name in self.kernel.arg_names[len(args):]))

    @staticmethod
    def _compiled_key(config: triton.Config, args: tuple, constexprs: dict) -> tuple:
        return (config, *constexprs.items(), args[0].device.index, *map(_specialization, args))

    def _first_that_launches(self, grid: Grid, args: tuple, constexprs: dict) -> triton.Config:
        """Launches the first candidate that compiles and fits the GPU (the estimate in
        kernels/triton/config.py counts tiles, the compiler all of it); returns it."""
        configs = self.candidates(constexprs, args[0].element_size(), chips.chip(args[0].device.index))
        for config in configs:
            try:
                self._launch(config, grid, args, constexprs)
                return config
            except (OutOfResources, CompilationError):  # raised before the launch: nothing ran
                continue
        chip = chips.chip(args[0].device.index)
        raise chips.NoConfigFits(f"{self.name}: none of {len(configs)} tile configs at head dim "
                                  f"{constexprs.get('HEAD_DIM')} fits the shared memory of {chip.name}")

    def _tune(self, grid: Grid, args: tuple, constexprs: dict) -> triton.Config:
        configs = self.candidates(constexprs, args[0].element_size(), chips.chip(args[0].device.index))
        if len(configs) == 1:
            return configs[0]
        # a tuned kernel writes each output element once, from inputs it does not write: benchmarking
        # cannot corrupt them (an in-place kernel gets one config, and never reaches this loop)
        timings = {}
        for config in configs:
            try:
                timings[config] = do_bench(lambda: self._launch(config, grid, args, constexprs),
                                           warmup=10, rep=40, return_mode="median")
            except (OutOfResources, CompilationError):  # does not fit after all: not a candidate
                continue
        return min(timings, key=timings.get) if timings else configs[-1]


class Bound:
    """One compiled kernel launched with a fixed grid and fixed non-tensor arguments."""

    def __init__(self, compiled, grid: tuple[int, int, int], operands: int, tail: tuple, device: int, tma: bool,
                 descriptors: tuple = ()):
        self.compiled = compiled  # triton's CompiledKernel
        self.grid = grid
        self.operands = operands  # how many leading tensors a call passes (absent ones as None)
        self.tail = tail  # every argument after the leading tensors, constexprs included, in order
        self.device = device
        self.tma = tma  # the kernel makes TMA descriptors itself: it needs a scratch allocator
        self.descriptors = descriptors  # (shape, strides, padding) of the leading host TMA descriptors, one each
        self._direct = DirectLaunch.of(compiled, descriptors)  # None: through Triton's launcher object

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launches on the current stream of the tensors' device: the first len(descriptors) go in
        as host TMA descriptors over their addresses, the rest as addresses. The caller's
        signature fixes their 16-byte alignment, the descriptors' shapes and strides, and which
        optional operands are absent: those are None here as they were when bound (a constexpr
        the kernel was compiled for)."""
        tensors = tensors[:self.operands]
        if self.tma:
            ensure_allocator()
        n = len(self.descriptors)
        if hooked():  # a profiler listens to launches: Triton's front door, with its metadata
            with on_device_index(self.device):
                self.compiled[self.grid](*self._descriptors(tensors), *tensors[n:], *self.tail)
            return
        if self._direct is not None:
            self._direct(self.grid, self.device, tensors, self.tail)
            return
        if n:
            args = (*self._descriptors(tensors), *map(address, tensors[n:]), *self.tail)
        else:
            args = (*map(address, tensors), *self.tail)
        launch_compiled(self.compiled, self.grid, self.device, args)

    def _descriptors(self, tensors) -> list:
        return [HostDescriptor(Address(t.data_ptr()), *d) for t, d in zip(tensors, self.descriptors)]


def bind(kernel, compiled, grid: tuple[int, ...], args: tuple, named: dict, tma: bool = False) -> Bound:
    """The Bound of `compiled`, just launched as kernel(*args, **named) on `grid` through Triton's
    front door: args' leading host TMA descriptors and tensors are passed anew on every call, the
    arguments after them and the named constexprs are fixed. An optional operand may sit anywhere
    among the tensors: absent (None), every call passes None there again."""
    n_descs = next(i for i, a in enumerate(args) if not hasattr(a, "block_shape"))
    n = next(i for i, a in enumerate(args) if i >= n_descs and not (a is None or isinstance(a, torch.Tensor)))
    tail = (*args[n:], *(named[name] for name in kernel.arg_names[len(args):]))
    kept = tuple((d.shape, d.strides, d.padding) for d in args[:n_descs])
    return Bound(compiled, (*grid, 1, 1)[:3], n, tail, args[n_descs].device.index, tma, kept)


def address(t: torch.Tensor | None) -> int | None:
    """What a launch passes for a tensor operand: its address; None for an absent one."""
    return None if t is None else t.data_ptr()


def launch_and_bind(kernel, grid: tuple[int, ...], args: tuple, named: dict | None = None) -> Bound:
    """Launches kernel(*args, **named) on `grid` through Triton's front door (compiling it for these
    arguments) and returns it bound for later launches of the same layout (bind)."""
    named = named or {}
    return bind(kernel, kernel[grid](*args, **named), grid, args, named)


def _specialization(arg) -> tuple:
    """What Triton compiles a kernel argument's value into (at least): a pointer's dtype and 16-byte
    alignment; an integer's width, divisibility by 16 and being 1; a tuple's, its elements'."""
    if isinstance(arg, tuple):
        return tuple(map(_specialization, arg))
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int, arg % 16 == 0, arg == 1, -(2**31) <= arg < 2**31
    return (type(arg),)


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's."""
    return on_device_index(t.device.index) if t.is_cuda else contextlib.nullcontext()
