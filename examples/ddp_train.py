"""Data-parallel training on neuron devices with DistributedDataParallel.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--steps 20]

Nothing here is neuron-specific: the device comes from ``torch.accelerator`` and
``init_process_group()`` picks the ``neuron`` backend for neuron tensors (gloo for CPU ones). On
several machines, run the same script with torchrun's ``--nnodes``/``--rdzv-endpoint`` (see
docs/distributed.md).

Each rank trains on its slice of a global batch; DDP averages gradients, so every step equals one
single-process step on the full batch (tests/test_distributed.py checks exactly that).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

IN_FEATURES, HIDDEN, OUT_FEATURES = 32, 64, 8


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES),
    )


def make_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step: the same on every rank (a stand-in for a sharded data loader)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(batch_size, IN_FEATURES, generator=g)
    target = torch.sin(x[:, :OUT_FEATURES] * 2.0) + 0.1 * torch.randn(batch_size, OUT_FEATURES, generator=g)
    return x, target


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP training on neuron")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    # One process per device; on the CPU PJRT platform every process has its own neuron:0.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(torch.accelerator.current_accelerator().type,
                          local_rank % torch.accelerator.device_count())
    torch.accelerator.set_device_index(device.index)

    model = DistributedDataParallel(make_model().to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for step in range(args.steps):
        x, target = make_batch(step, args.batch_size)
        x, target = x.chunk(world)[rank].to(device), target.chunk(world)[rank].to(device)
        loss = torch.nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The mean of the ranks' losses is the full-batch loss (equal slices).
        logged = loss.detach()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        if rank == 0:
            # One write, newline included: the other ranks write to the same terminal.
            sys.stdout.write(f"step {step} loss {logged.item():.6f}\n")
            sys.stdout.flush()

    if rank == 0:
        import torchneuron
        m = torchneuron.metrics()
        print(f"collectives {dict(m['collectives'])} bytes {m['collective_bytes']} "
              f"seconds {m['collective_seconds']:.3f} cpu_fallbacks {m['fallback_count']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
