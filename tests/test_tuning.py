"""The kernels' block configs follow the GPU they run on: shared memory and capabilities as the card
reports them. Smaller and older cards are simulated on any machine (their Chip as their properties
would read); one GPU test has the compiler refuse a config the estimate let through."""

import pytest
import torch

from kernels import LAUNCHERS
from kernels.runtime import chips
from kernels.runtime.chips import Chip, NoConfigFits
from kernels.triton import config

# shared memory per block (opt-in) and capability as each card reports them
CHIPS = [chips.H100,
         Chip("NVIDIA A100-SXM4-80GB", (8, 0), 163 * 1024),
         Chip("NVIDIA GeForce RTX 4090", (8, 9), 99 * 1024),
         Chip("a 100 KB card", (8, 0), 100 * 1024),
         Chip("Tesla T4", (7, 5), 64 * 1024)]
# per kernel: (resident rows key, streamed rows key, resident tiles) as kernels/triton/config.py keeps them
TILES = {"fwd": ("BLOCK_M", "BLOCK_N", 1), "dq": ("BLOCK_M", "BLOCK_N", 2), "dkdv": ("BLOCK_N", "BLOCK_M", 2)}


def _tile_bytes(name, config, block_d, itemsize):
    """The kernel's tiles in shared memory: the resident ones, and K/V (or Q/dO) per pipeline stage."""
    resident, streamed, tiles = TILES[name]
    rows = tiles * config.kwargs[resident] + 2 * config.num_stages * config.kwargs[streamed]
    return rows * block_d * itemsize


@pytest.mark.parametrize("chip", CHIPS, ids=lambda c: c.name)
@pytest.mark.parametrize("block_d, itemsize", [(64, 2), (128, 2), (256, 2), (64, 4), (128, 4), (256, 4)])
def test_only_configs_that_fit_the_card_are_candidates(chip, block_d, itemsize):
    for name, launcher in LAUNCHERS.items():
        try:
            kept = launcher.candidates({"HEAD_DIM": block_d}, itemsize, chip)
        except NoConfigFits as e:
            # one line naming the head dim, the card and its shared memory
            assert "\n" not in str(e) and f"head_dim {block_d}" in str(e) and chip.name in str(e), e
            assert all(_tile_bytes(name, c, block_d, itemsize) > chip.smem_bytes - config.SMEM_RESERVED
                       for c in launcher.configs)
            continue
        assert kept, (name, chip)
        assert all(c in launcher.configs for c in kept)  # in the tuned order of preference
        assert [c for c in launcher.configs if c in kept] == kept
        for c in kept:
            assert _tile_bytes(name, c, block_d, itemsize) <= chip.smem_bytes - config.SMEM_RESERVED, (name, c)
        # a config that fits the card's shared memory yet was dropped is dropped on the H100 too:
        # registers, the same on every card
        for c in launcher.configs:
            if c not in kept and _tile_bytes(name, c, block_d, itemsize) <= chip.smem_bytes - config.SMEM_RESERVED:
                assert c not in launcher.candidates({"HEAD_DIM": block_d}, itemsize, chips.H100)


def test_the_fixed_config_is_chosen_per_card():
    # FLASH_ATTENTION_AUTOTUNE=0 runs the first candidate: the H100's first forward config at D = 128
    # (~128 KB of tiles) is more than an RTX 4090 has, so the 4090 starts further down the list
    h100 = LAUNCHERS["fwd"].candidates({"HEAD_DIM": 128}, 2, chips.H100)[0]
    rtx = LAUNCHERS["fwd"].candidates({"HEAD_DIM": 128}, 2, CHIPS[2])[0]
    assert _tile_bytes("fwd", h100, 128, 2) > 99 * 1024 >= _tile_bytes("fwd", rtx, 128, 2)
    assert h100 != rtx


def test_a_head_dim_no_config_fits_is_one_clear_error():
    with pytest.raises(NoConfigFits, match=r"head_dim 256 \(32-bit\) in the 64 KB .* Tesla T4: the smallest needs"):
        LAUNCHERS["fwd"].candidates({"HEAD_DIM": 256}, 4, CHIPS[-1])
    assert issubclass(NoConfigFits, ValueError)


@pytest.mark.parametrize("capability, bf16, tma", [((7, 0), False, False), ((7, 5), False, False),
                                                   ((8, 0), True, False), ((8, 6), True, False),
                                                   ((8, 9), True, False), ((9, 0), True, True),
                                                   ((10, 0), True, True)])
def test_capabilities_by_compute_capability(capability, bf16, tma):
    chip = Chip("card", capability, 100 * 1024)
    assert (chip.bf16, chip.tma) == (bf16, tma)
    assert not Chip("card", capability, 100 * 1024, nvidia=False).tma


@pytest.mark.gpu
def test_gpu_reads_the_card_it_runs_on():
    chip = chips.chip(torch.cuda.current_device())
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert chip.capability == (props.major, props.minor)
    assert props.shared_memory_per_block <= chip.smem_bytes <= props.shared_memory_per_multiprocessor


@pytest.mark.gpu
def test_gpu_a_config_the_compiler_refuses_is_skipped_without_autotuning(monkeypatch):
    # a card claiming 1 MB of shared memory lets a ~416 KB tile config through the estimate; the
    # compiler refuses it on the real card (OutOfResources, before anything launches) and the next runs
    import triton

    from kernels import flash_attn_forward
    from kernels.runtime.launch import Launcher
    from kernels.triton import fwd

    monkeypatch.setenv("FLASH_ATTENTION_AUTOTUNE", "0")
    monkeypatch.setattr(chips, "chip", lambda index: Chip("a 1 MB card", (9, 0), 1024 * 1024))
    huge, small = (triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=6),
                   triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2))
    launcher = Launcher(fwd._fwd_kernel, [huge, small], config.CPU_FWD, config.FWD_PRUNE)
    monkeypatch.setattr(fwd, "FWD", launcher)
    q, k, v = (torch.randn(1, 2, 300, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, _ = flash_attn_forward(q, k, v)
    assert list(launcher.chosen.values()) == [small]
    with launcher.pinned(small):
        assert torch.equal(flash_attn_forward(q, k, v)[0], o)


def test_what_a_card_cannot_run_is_known_before_training(monkeypatch):
    # configs/validate.py asks this for attn=triton on CUDA: one line before anything is created
    from kernels import unsupported

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(chips, "chip", lambda index: CHIPS[-1])  # a T4
    assert "bfloat16 needs compute capability 8.0 or newer; Tesla T4 is 7.5" in unsupported(64, torch.bfloat16, cuda)
    assert "no tile size fits head_dim 256 (32-bit) in the 64 KB" in unsupported(256, torch.float32, cuda)
    assert unsupported(64, torch.float16, cuda) is None
    monkeypatch.setattr(chips, "chip", lambda index: chips.H100)
    assert unsupported(256, torch.float32, cuda) is None and unsupported(256, torch.bfloat16, cuda) is None
    assert unsupported(256, torch.float32, torch.device("cpu")) is None
