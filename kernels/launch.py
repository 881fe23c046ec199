"""Launches a @triton.jit kernel on the device its tensors live on, with a config chosen per shape.

CUDA tensors run the compiled kernel under the config that autotuning picked for the shape's
tuning key (benchmarked once per key among the candidates that fit; the first that fits when
FLASH_ATTENTION_AUTOTUNE=0). CPU tensors, and any tensors when TRITON_INTERPRET=1 was set before
import, run the kernel's interpreted twin (kernels/interpreter.py) under one small fixed config, so
that nothing is benchmarked there.
"""

import contextlib
import os
from collections.abc import Callable

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime import _allocation
from triton.runtime.errors import OutOfResources
from triton.runtime.interpreter import InterpretedFunction
from triton.testing import do_bench

from kernels.interpreter import interpreted, interpreting

Grid = Callable[[dict], tuple[int, ...]]  # config kwargs -> launch grid


def autotuning() -> bool:
    return os.environ.get("FLASH_ATTENTION_AUTOTUNE", "1") != "0"


class Launcher:
    """One kernel, its candidate configs in order of preference, and the choices made so far.

    prune(configs, constexprs, itemsize) keeps the configs that fit the chip for those constexprs
    and that input width (None: all); it never returns an empty list.
    """

    def __init__(self, kernel, configs: list[triton.Config], cpu_config: triton.Config,
                 prune: Callable[[list[triton.Config], dict, int], list[triton.Config]] | None = None):
        self.kernel, self.configs, self.cpu_config, self.prune = kernel, configs, cpu_config, prune
        self.chosen: dict[tuple, triton.Config] = {}  # tuning key -> config
        self.compiled: dict[tuple, object] = {}  # (config, constexprs, device, specialization) -> CompiledKernel
        self._pinned: triton.Config | None = None

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def candidates(self, constexprs: dict, itemsize: int) -> list[triton.Config]:
        """The configs autotuning chooses among for these constexprs and input width."""
        return self.prune(self.configs, constexprs, itemsize) if self.prune else self.configs

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
        if args[0].device.type == "cpu" or isinstance(self.kernel, InterpretedFunction):  # TRITON_INTERPRET=1
            config = self._pinned or self.cpu_config
            with interpreting():
                interpreted(self.kernel)[grid(config.kwargs)](*args, **constexprs, **config.kwargs)
            return
        config = self._pinned or self.chosen.get(key)
        if config is None:
            config = self._tune(grid, args, constexprs, args[0].element_size())
            self.chosen[key] = config
        self._launch(config, grid, args, constexprs)

    def _launch(self, config: triton.Config, grid: Grid, args: tuple, constexprs: dict) -> None:
        # Triton's own launch path binds and specializes every argument on every call (tens of
        # microseconds, several times a training step); the compiled kernel is cached here per
        # (config, constexprs, device, specialization) and launched directly
        key = (config, *constexprs.items(), args[0].device.index, *map(_specialization, args))
        if constexprs.get("TMA"):
            _ensure_allocator()
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid(config.kwargs)](*args, **constexprs, **config.all_kwargs())
            return
        named = {**constexprs, **config.kwargs}
        dims = (*grid(config.kwargs), 1, 1)[:3]  # the compiled kernel's launcher takes exactly three
        compiled[dims](*args, *(named[name] for name in self.kernel.arg_names[len(args):]))

    def _tune(self, grid: Grid, args: tuple, constexprs: dict, itemsize: int) -> triton.Config:
        configs = self.candidates(constexprs, itemsize)
        if len(configs) == 1 or not autotuning():
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


def _specialization(arg) -> tuple:
    """What Triton compiles a kernel argument's value into (at least): a pointer's dtype and 16-byte
    alignment; an integer's width, divisibility by 16 and being 1."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int, arg % 16 == 0, arg == 1, -(2**31) <= arg < 2**31
    return (type(arg),)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory a launch asks for: here, the TMA descriptors its programs build (on the current
    device and stream; the caching allocator's 512-byte alignment covers Triton's 128)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Descriptors made in a kernel need a scratch allocator. Triton keeps it in a context variable,
    so autograd's backward thread starts without one: checked per launch, and one a user set is kept."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
