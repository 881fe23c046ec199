"""How one training job is laid out over its processes: one object for all of it.

Under torchrun every process drives one GPU (or the CPU, through gloo). The processes form a
(world / cp) x cp grid: the cp ranks of a row split each of its sequences (context parallelism,
ring attention), the rows are data-parallel, each drawing its own slice of the global batch.
Gradients are averaged over all processes: by DDP, which keeps the whole model and AdamW state on
every process, or by FSDP2 (fully_shard on units of blocks and on the rest), which shards weights,
gradients and optimizer state; its checkpoints are its shards (trainer/shards.py), DDP's whole tensors.

Context parallelism, zigzag: the T tokens of a window are cut into 2N chunks and rank r of the N
keeps chunks r and 2N-1-r, so every rank has the same causal attention work
(kernels/ring_attention.py explains the ring and why this layout balances it). The model sees its
shard and the shard's global positions (RoPE, the learned table); its attention is the ring over
the registry's kernels.
"""

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method  # torch documents it here
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.adamw import adamw

from configs.validate import launch_env
from kernels.ring_attention import ring_attention
from model.attention import Attention


@dataclass(frozen=True)
class ContextParallel:
    group: dist.ProcessGroup
    rank: int  # in the group
    size: int
    mesh: DeviceMesh | None = None  # the group's, for torch's context_parallel
    method: str = "ring"  # the attention's registry entry: "ring" (ours) or "torch"

    @classmethod
    def of(cls, group: dist.ProcessGroup, mesh: DeviceMesh | None = None, method: str = "ring") -> "ContextParallel":
        return cls(group, dist.get_rank(group), dist.get_world_size(group), mesh, method)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of x along dim (the sequence), in order: (..., T / N, ...)."""
        if x.size(dim) % (2 * self.size):
            raise ValueError(f"context parallelism over {self.size} ranks needs a sequence length divisible by "
                             f"{2 * self.size} (two equal chunks per rank), got {x.size(dim)}")
        chunks = x.chunk(2 * self.size, dim)
        return torch.cat((chunks[self.rank], chunks[2 * self.size - 1 - self.rank]), dim)

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(seq_len / N,) int64: the global positions of this rank's tokens."""
        return self.shard(torch.arange(seq_len, device=device), dim=0)


def fsdp_units(blocks: list[nn.Module], min_params: int) -> list[list[nn.Module]]:
    """The blocks in runs of consecutive blocks of at least min_params parameters each; the last run
    takes what is left (and may hold fewer)."""
    units: list[list[nn.Module]] = [[]]
    size = 0
    for block in blocks:
        if size >= min_params:
            units.append([])
            size = 0
        units[-1].append(block)
        size += sum(p.numel() for p in block.parameters())
    return units


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (FSDP's parameters, gradients and AdamW state); t itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.AdamW):
    """AdamW over FSDP's parameters that steps their local shards.

    Each element's update reads that element alone, so stepping every shard is stepping the whole
    tensor, as AdamW over the DTensors does; what that costs is DTensor's dispatch of the fused step
    over every parameter, gradient and moment (host time a small model's step does not cover). The
    first step, which makes the state, is AdamW's own: the state (and the checkpoints) are AdamW's.
    Fused only (the kernel it calls), without amsgrad, capturable or differentiable."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for key, want in (("fused", True), ("amsgrad", False), ("capturable", False), ("differentiable", False)):
            if any(bool(group[key]) != want for group in self.param_groups):
                raise ValueError(f"ShardedAdamW steps with fused AdamW's kernel alone: {key} must be {want}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        stepped = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        if not all(self.state.get(p) for params in stepped for p in params):
            return super().step()
        for group, params in zip(self.param_groups, stepped):
            state = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adamw([local(p) for p in params], [local(p.grad) for p in params], [local(s["exp_avg"]) for s in state],
                  [local(s["exp_avg_sq"]) for s in state], [], [local(s["step"]) for s in state], fused=True,
                  grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=group["maximize"])
        return None


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's shard (rank order): the inverse of ContextParallel.shard."""
    n = len(shards)
    halves = [h for s in shards for h in s.chunk(2, dim)]  # rank r's chunks r and 2n-1-r
    order = [halves[2 * r] for r in range(n)] + [halves[2 * r + 1] for r in reversed(range(n))]
    return torch.cat(order, dim)


@dataclass
class Parallel:
    rank: int
    world: int
    local_rank: int  # on this node: which process prepares the node's data
    device: torch.device
    dp: int  # data-parallel processes: world / cp
    dp_rank: int  # this process's row of the grid: which slice of the global batch it draws
    cp: ContextParallel | None  # None: each process holds whole sequences
    sharded: bool  # FSDP2 (parallel.dp=fsdp under torchrun): state dicts are collective

    @classmethod
    def start(cls, device: torch.device, cp: int = 1, fsdp: bool = False, cp_method: str | None = None,
              cp_rotate: str | None = None) -> "Parallel":
        """One process alone, or this process's place among torchrun's (process group, device, grid);
        cp_method: how the attention splits a sequence (its registry entry's context_parallel),
        cp_rotate: how torch's ring passes K/V (allgather or alltoall; None: torch's default)."""
        if "RANK" not in os.environ:
            return cls(0, 1, 0, device, 1, 0, None, False)
        rank, world, local_rank = (launch_env()[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if device.type == "cuda":
            device = torch.device(f"cuda:{local_rank}")
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
        if cp == 1:
            return cls(rank, world, local_rank, device, world, rank, None, fsdp)
        mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
        if cp_rotate is not None:
            set_rotate_method(cp_rotate)
        return cls(rank, world, local_rank, device, world // cp, mesh.get_local_rank("dp"),
                   ContextParallel.of(mesh.get_group("cp"), mesh["cp"], cp_method), fsdp)

    @property
    def master(self) -> bool:  # rank 0 alone writes: run dir, metrics, W&B, checkpoints, progress bar
        return self.rank == 0

    # ------------------------------------------------------------------ the model

    def attention(self, attention: Attention, head_groups: int = 1) -> Attention:
        """The attention the model calls: under our context parallelism the ring over it, its heads in
        head_groups passes (one op no more: selective activation checkpointing recomputes it);
        torch's patches SDPA in place."""
        if self.cp is None or self.cp.method != "ring":
            return attention
        ring = functools.partial(ring_attention, group=self.cp.group, backend=attention.backend,
                                 head_groups=head_groups)
        return dataclasses.replace(attention, fn=ring, saved_ops=())

    def shard(self, model: nn.Module, param_dtype: torch.dtype | None = None,
              reshard_after_forward: bool = True, unit_params: int = 1) -> list[int]:
        """FSDP2 in place (before the optimizer is made: it holds the shards): the blocks in units of
        consecutive blocks, then the rest (embedding, tied head, final norm); a unit's weights are
        gathered for its forward and backward, its gradients reduce-scattered (averaged over all
        processes, as DDP does).

        param_dtype: what the blocks' weights are gathered in (None: fp32, as stored). Under
        autocast each matmul casts its weights to that dtype anyway: a block computes what it does
        under DDP but for its LayerNorm gains, which arrive rounded (the losses differ by that).
        Shards, optimizer state and checkpoints stay fp32; gradients are reduced, and accumulated,
        in fp32. Inputs are not cast, so the residual stream stays fp32 as under autocast; the rest
        (embedding, tied head, final norm) stays fp32: the embedding starts that stream.
        reshard_after_forward: False keeps every unit's gathered weights to its backward (one
        all-gather per step, not two, for the memory of the gathered model); the last unit keeps
        them either way: its backward comes at once.
        unit_params: each unit holds consecutive blocks of at least this many parameters (the last
        what is left; 1: a block per unit). A unit's hooks cost host time every step whatever its
        size: fewer, larger units for a model whose blocks are small against that.
        Returns each unit's number of blocks (none unless sharded)."""
        if not self.sharded:
            return []
        mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        units = fsdp_units(list(model.blocks), unit_params)
        for i, unit in enumerate(units):
            fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard_after_forward and i < len(units) - 1)
        fully_shard(model, mesh=mesh)
        # all-gathers one unit ahead, issued before the current unit's compute (not when the host
        # reaches the next unit, which a host slower than the GPU reaches late); a unit's first
        # block stands for it
        firsts = [unit[0] for unit in units]
        for i, first in enumerate(firsts):
            first.set_modules_to_forward_prefetch(firsts[i + 1:i + 2])
            first.set_modules_to_backward_prefetch(firsts[i - 1:i] if i else [])
        model.set_modules_to_forward_prefetch(firsts[:1])
        return [len(unit) for unit in units]

    def wrap(self, model: nn.Module, compile: bool, mode: str = "default") -> nn.Module:
        """What the loop calls: compiled (in torch.compile's `mode`) and/or in DDP. The ring
        communicates, so a compiled model runs the attention blocks eagerly; a graph break inside
        them (strided q, k, v views crossing it) fails in torch's AOT view replay, one around them
        does not."""
        if compile and self.cp is not None:
            for block in model.blocks:
                block.attn.forward = torch.compiler.disable(block.attn.forward)
        if compile:
            model = torch.compile(model, mode=str(mode))
        if self.world > 1 and not self.sharded:
            # gradients live in the all-reduce buckets: no copy in and out of them after backward
            model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                        gradient_as_bucket_view=True)
        return model

    @contextlib.contextmanager
    def split(self, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor | None]]:
        """(x, y, positions) of this rank's part of a batch of windows: its shard of each sequence and
        the shard's global positions under context parallelism, else the windows (positions None).
        A forward and its backward run inside: torch's context parallelism dispatches SDPA, and its
        backward, to its ring only there."""
        if self.cp is None:
            yield x, y, None
        elif self.cp.method == "ring":
            yield self.cp.shard(x), self.cp.shard(y), self.cp.positions(x.size(1), x.device)
        else:
            pos = torch.arange(x.size(1), device=x.device)
            shards = [x, y, pos]  # sharded in place, zigzag: torch's causal load balancing
            with context_parallel(self.cp.mesh, buffers=shards, buffer_seq_dims=[1, 1, 0],
                                  no_restore_buffers=set(shards)):
                yield x, y, pos

    # ------------------------------------------------------------------ a step

    def sync_gradients(self, model: nn.Module, raw_model: nn.Module, now: bool) -> None:
        """Whether this micro-step's backward reduces gradients over the processes (the last of an
        accumulation only)."""
        if self.sharded:
            raw_model.set_requires_gradient_sync(now)
        elif self.world > 1:
            model.require_backward_grad_sync = now

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The gradients' norm over the whole model, and the gradients scaled to at most max_norm."""
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        # sharded: the norm from each process's shards, their squares summed over the processes
        # (FSDP's mesh is every process: the default group), on the local tensors; the scaling is
        # torch's over the DTensors (one foreach op: 0.99x the tokens/s of scaling the local
        # shards, GPT-2 small on one H200, within the runs' spread)
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.device)
        squares = torch.nn.utils.get_total_norm([local(p.grad) for p in params], foreach=True).square()
        if self.world > 1:
            dist.all_reduce(squares)
        norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """t averaged over the processes, in place (each computed it on its own slice)."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        return t

    def after_forward_only(self, raw_model: nn.Module) -> None:
        """A forward without backward (evaluation) leaves the weights of FSDP's root and last unit
        gathered: reshard them."""
        if self.sharded:
            for module in raw_model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, raw_model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model, optimizer) state: sharded, each process's shards (DTensors, for trainer/shards.py;
        every process must call it), else whole tensors."""
        if self.sharded:
            return get_model_state_dict(raw_model), get_optimizer_state_dict(raw_model, optimizer)
        return raw_model.state_dict(), optimizer.state_dict()

    def load_state_dict(self, raw_model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optimizer_state: dict, load_weights) -> None:
        """The inverse of state_dict, on every process; a sharded run also takes whole tensors (a
        checkpoint exported to one file, or written before shards), keeping its part of each.
        load_weights(model, state) loads an unsharded one."""
        if self.sharded:
            whole = any(not isinstance(t, DTensor) for t in model_state.values())
            options = StateDictOptions(full_state_dict=whole)
            set_model_state_dict(raw_model, model_state, options=options)
            set_optimizer_state_dict(raw_model, optimizer, optimizer_state, options=options)
        else:
            load_weights(raw_model, model_state)
            optimizer.load_state_dict(optimizer_state)

    # ------------------------------------------------------------------ agreement and the end

    def all_agree(self, ok: bool) -> bool:
        """True on every rank only if ok is True on every rank."""
        if self.world == 1:
            return ok
        flag = torch.tensor(int(ok), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def broadcast(self, obj):
        """Rank 0's obj, on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every process's obj, in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world == 1:
            return
        if dist.get_backend() == "gloo":
            # gloo's worker threads free a finished collective's tensors under the GIL; a process group
            # destroyed before that (its destructor joins them with the GIL held) hangs: let them finish
            time.sleep(0.1)
        dist.destroy_process_group()
