"""The optimizer and its learning-rate schedule, and the update that never takes a non-finite step.

AdamW (fused: one kernel, on the CPU and CUDA) decays matmul weights and embeddings, never biases
or LayerNorm gains. Under FSDP, ShardedAdamW (trainer/parallel.py) steps each process's shards.
An update whose gradient is not finite is skipped on the device, without a host sync: the fused
step reads found_inf, and the loop learns of it at its next sync (check_finite), which stops the
run as diverged.
"""

import math

import torch
from omegaconf import DictConfig

from trainer.parallel import ShardedAdamW


class Diverged(RuntimeError):
    """The loss or the gradient norm became NaN or inf."""


def lr_at(step: int, cfg: DictConfig) -> float:
    """Linear warmup to optim.lr, then cosine decay to optim.lr * min_lr_ratio at max_steps."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.max_steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: DictConfig, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters, weight decay on those of two or more dims;
    sharded (FSDP), the same AdamW stepping each process's shards."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    adamw = ShardedAdamW if sharded else torch.optim.AdamW
    return adamw(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_norm: torch.Tensor,
           loss_sum: torch.Tensor) -> torch.Tensor:
    """The optimizer step, skipped on the device (no host sync) where a gradient is not finite, and
    the gradients dropped; returns whether this step diverged, on the device."""
    if scaler.is_enabled():
        # fp16: an overflow under the loss scale is the scaler's to skip, halving the scale (the fused
        # AdamW reads its found_inf), and no divergence; a loss that is not finite still is one
        scaler.step(optimizer)
        scaler.update()
        bad = ~torch.isfinite(loss_sum)
    else:
        bad = ~torch.isfinite(grad_norm)
        optimizer.found_inf = bad.float()  # the fused AdamW skips the whole update
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return bad


def check_finite(first_bad_step: torch.Tensor, step: int, fp16: bool, lr: float, loss: float | None = None) -> None:
    """Raises Diverged if a step diverged (first_bad_step, on the device: 0 for none), or `loss` is
    not finite."""
    bad_step = int(first_bad_step.item())
    if bad_step or (loss is not None and not math.isfinite(loss)):
        what = (f"the {'loss' if fp16 else 'gradient norm'} at step {bad_step}" if bad_step
                else f"the loss at step {step}")
        raise Diverged(f"training diverged: {what} is not finite; that update was skipped and the run stopped "
                       f"(optim.lr={lr})")
