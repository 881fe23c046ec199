"""One launch layer: a Bound launch hands Triton's C launcher, in the kernel's argument order, host
TMA descriptors rebuilt over the new tensors' addresses, the other tensors' addresses, and the
arguments and constexprs its first launch fixed. The Hopper kernels launch this way from their
second call on (their GPU test, test_gluon_later_launches_use_the_new_tensors, checks the results);
here the arguments themselves are checked, on any machine, with the C launcher replaced by a
recorder.

    .venv/bin/python -m pytest tests/test_launch.py -q
"""

import subprocess
import sys
from types import SimpleNamespace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.runtime import internals, launch
from tests.helpers import REPO


@triton.jit
def _kernel(a_desc, b_desc, C, D, c_strides, n, scale, WIDTH: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Descriptor(NamedTuple):
    """What bind reads of a host TensorDescriptor: its box, shape, strides and padding."""
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    padding: str


def test_a_bound_launch_rebuilds_descriptors_and_fixes_the_rest(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "launch_compiled", lambda compiled, grid, device, args: calls.append(
        (compiled, grid, device, args)))
    monkeypatch.setattr(launch, "hooked", lambda: False)
    first = [torch.zeros(4, 8) for _ in range(4)]
    descs = [_Descriptor(t, list(t.shape), list(t.stride()), [2, 8], "zero") for t in first[:2]]
    args = (*descs, first[2], first[3], (8, 1), 7, 0.5)
    bound = launch.bind(_kernel, "compiled", (3, 2), args, {"WIDTH": 16, "FLAG": True, "num_warps": 4})
    assert bound.grid == (3, 2, 1) and bound.tail == ((8, 1), 7, 0.5, 16, True)

    later = [torch.ones(4, 8) for _ in range(4)]
    bound(*later)
    (compiled, grid, _, passed), = calls
    assert compiled == "compiled" and grid == (3, 2, 1)
    for got, tensor, desc in zip(passed[:2], later[:2], descs, strict=True):
        assert got == launch.HostDescriptor(launch.Address(tensor.data_ptr()), desc.shape, desc.strides, "zero")
        assert got.base.data_ptr() == tensor.data_ptr()
    assert passed[2:] == (later[2].data_ptr(), later[3].data_ptr(), (8, 1), 7, 0.5, 16, True)


def test_a_triton_launch_binds_its_tensors_as_addresses(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "launch_compiled", lambda compiled, grid, device, args: calls.append(args))
    monkeypatch.setattr(launch, "hooked", lambda: False)
    tensors = [torch.zeros(2) for _ in range(4)]
    bound = launch.bind(_kernel, "compiled", (1,), (*tensors, (2, 1), 3, 1.0), {"WIDTH": 8, "FLAG": False})
    assert bound.descriptors == ()
    bound(*tensors)
    assert calls == [(*(t.data_ptr() for t in tensors), (2, 1), 3, 1.0, 8, False)]


def test_an_absent_operand_is_passed_as_none_wherever_it_sits(monkeypatch):
    # an optional operand among the tensors (ALiBi's slopes between the bounds and the sinks):
    # absent (None), every later call passes it as None again, never as an address
    calls = []
    monkeypatch.setattr(launch, "launch_compiled", lambda compiled, grid, device, args: calls.append(args))
    monkeypatch.setattr(launch, "hooked", lambda: False)
    tensors = [torch.zeros(2) for _ in range(2)]
    bound = launch.bind(_kernel, "compiled", (1,), (tensors[0], None, tensors[1], None, (2, 1), 3, 1.0),
                        {"WIDTH": 8, "FLAG": False})
    assert bound.operands == 4 and bound.tail == ((2, 1), 3, 1.0, 8, False)
    later = [torch.ones(2) for _ in range(2)]
    bound(later[0], None, later[1], None)
    assert calls == [(later[0].data_ptr(), None, later[1].data_ptr(), None, (2, 1), 3, 1.0, 8, False)]


def test_a_direct_launch_calls_the_c_function_and_encodes_each_address_once(monkeypatch):
    """Triton 3.6's launcher object is skipped: its C function gets the grid, the stream, the
    kernel's handle and metadata, each descriptor expanded (encoded once per address, then kept),
    the other tensors' addresses and the fixed tail, as the launcher object would pass them."""
    monkeypatch.setattr(launch.triton, "__version__", "3.6.0")
    expanded = []

    def expand(desc, meta):
        expanded.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr()), *desc.shape, *desc.strides]
    monkeypatch.setattr(internals, "_expand", expand)
    calls = []

    def c_launch(*args):
        calls.append(args)
    c_launch.__name__ = "launch"

    def expanding(*args):  # as Triton wraps the C function of a kernel that takes descriptors
        return c_launch(*args)
    run = SimpleNamespace(launch=expanding, global_scratch_size=0, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, function=1234, packed_metadata=(4, 1, 0),
                               metadata=SimpleNamespace(tensordesc_meta=None))
    monkeypatch.setattr(launch, "hooked", lambda: False)
    monkeypatch.setattr(internals, "current_stream", lambda: lambda device: 77)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # CPU tensors' device index
    first = [torch.zeros(4, 8) for _ in range(4)]
    descs = [_Descriptor(t, list(t.shape), list(t.stride()), [2, 8], "zero") for t in first[:2]]
    bound = launch.bind(_kernel, compiled, (3, 2), (*descs, first[2], first[3], (8, 1), 7, 0.5),
                        {"WIDTH": 16, "FLAG": True})
    later = [torch.ones(4, 8) for _ in range(4)]
    for tensors in (first, later, first):
        bound(*tensors)
    head = (3, 2, 1, 77, 1234, False, False, None, None, (4, 1, 0), None, None, None)
    for call, tensors in zip(calls, (first, later, first), strict=True):
        a, b, c, d = (t.data_ptr() for t in tensors)
        assert call == (*head, ("map", a), 4, 8, 8, 1, ("map", b), 4, 8, 8, 1, c, d, (8, 1), 7, 0.5, 16, True)
    assert expanded == [t.data_ptr() for t in (*first[:2], *later[:2])]  # the third call encoded nothing

    # past KEPT addresses a descriptor argument drops its oldest: here first's, which comes back anew
    monkeypatch.setattr(internals.DirectLaunch, "KEPT", 2)
    third = [torch.full((4, 8), 2.0) for _ in range(4)]
    expanded.clear()
    for tensors in (third, later, first):
        bound(*tensors)
    assert expanded == [t.data_ptr() for t in (*third[:2], *first[:2])]


def test_prepared_launches_are_one_bounded_cache_for_both_dialects(monkeypatch):
    # a Triton launcher's bound launch and a Hopper kernel's live in the one cache, keyed by owner
    # and signature; past LIMIT the least recently used goes, a launch used since stays
    monkeypatch.setattr(launch, "PREPARED", launch.PreparedLaunches())
    monkeypatch.setattr(launch.PreparedLaunches, "LIMIT", 3)
    launcher = launch.Launcher(_kernel, [triton.Config({})], triton.Config({}))
    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, grid, args, key, **constexprs: None)
    monkeypatch.setattr(launch, "interprets", lambda device: False)
    monkeypatch.setattr(launch, "bind", lambda kernel, compiled, grid, args, named, tma=False: ("bound", compiled))
    launcher.chosen["key"] = config = launch.triton.Config({})
    tensors = (torch.zeros(2),)
    launcher.compiled[launcher._compiled_key(config, tensors, {})] = "compiled"
    launcher.bind("signature", lambda kwargs: (1,), tensors, "key")
    assert launcher.bound_for("signature") == ("bound", "compiled") == launch.PREPARED[(launcher, "signature")]
    for name in ("forward", "backward"):  # as kernels/hopper/fwd.py and bwd.py keep theirs
        launch.PREPARED[(name, "signature")] = name
    assert launch.PREPARED.get((launcher, "signature")) is not None  # used: now the most recent
    launch.PREPARED[("forward", "another")] = "forward again"
    assert list(launch.PREPARED) == [("backward", "signature"), (launcher, "signature"), ("forward", "another")]
    with launcher.pinned(config):  # a pinned config decides: no bound launch
        assert launcher.bound_for("signature") is None


def test_a_triton_release_whose_internals_are_unknown_fails_at_import_in_one_line():
    # a fresh process whose triton says it is a release past the ones kernels/runtime/internals.py knows
    script = "import triton\ntriton.__version__ = '3.10.0'\nimport kernels\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: kernels: triton 3.10.0 is not a release whose internals kernels/runtime/internals.py knows "
        "(3.6 to 3.9): pip install 'triton>=3.6,<3.10'")
