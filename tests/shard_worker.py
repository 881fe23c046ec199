"""One rank of the check that FSDP's host-time savings change nothing (tests/test_ddp.py runs it under
torchrun, on gloo): ShardedAdamW and Parallel.clip_grad_norm, which work on each process's local
shards, against torch's AdamW and clip_grad_norm_ over the DTensors, on two copies of one sharded
model that take the same steps on the same batches. Saves each step's gradient norms and the whole
weights after the steps, for both, to OUT/rank<r>.pt.
    torchrun --nproc_per_node=N tests/shard_worker.py OUT MAX_NORM UNIT_PARAMS
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from tests.helpers import TINY, compose
from trainer.optim import make_optimizer
from trainer.parallel import Parallel, ShardedAdamW
from trainer.run import build_model


def main(out: str, max_norm: float, unit_params: int) -> None:
    par = Parallel.start(torch.device("cpu"), fsdp=True)
    # 3 blocks of width 34: over 3 processes every block tensor but the fused q, k, v weight (102
    # rows) splits unevenly, so shards differ in size
    cfg = compose(TINY[:-1] + ["model.n_layer=3", "model.d_model=34", "model.n_head=2", "attn=naive", "device=cpu"])
    models, optimizers = [], []
    for sharded_adamw in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg, par)
        par.shard(model, None, True, unit_params)
        models.append(model)
        optimizers.append(make_optimizer(model, cfg, sharded=sharded_adamw))
    assert type(optimizers[1]) is ShardedAdamW
    norms = [[], []]
    gen = torch.Generator().manual_seed(1 + par.rank)
    for _ in range(3):
        x = torch.randint(cfg.model.vocab_size, (2, cfg.seq_len), generator=gen)
        y = torch.randint(cfg.model.vocab_size, (2, cfg.seq_len), generator=gen)
        for i, (model, optimizer) in enumerate(zip(models, optimizers)):
            model(x, y)[1].backward()
            if i == 0:  # torch's, over the DTensors
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).full_tensor()
            else:
                norm = par.clip_grad_norm(model, max_norm)
            norms[i].append(norm.detach().clone())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    weights = [{name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in model.named_parameters()} for model in models]
    if par.rank == 0:
        torch.save({"norms": norms, "weights": weights}, f"{out}/rank0.pt")
    par.close()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
