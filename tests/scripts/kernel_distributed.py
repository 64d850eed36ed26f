"""Worker for tests/test_kernels.py: a model whose RMSNorm is a torchneuron.kernel, trained with DDP
and then with FSDP2 (the norm's weight sharded across ranks) on neuron tensors.

    python kernel_distributed.py <out_dir>      (with torchrun's environment: RANK, WORLD_SIZE, ...)

Rank 0 writes <out_dir>/result.json: per-step losses (averaged over ranks), final parameters and
how often the kernel ran on neuron. The test compares them with one CPU process on the full batch.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import kernel_rms_norm  # noqa: E402

import torchneuron  # noqa: E402

STEPS = 3
LR = 0.1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = kernel_rms_norm.RMSNorm(32)
        self.fc2 = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)).relu())


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(model, rank, world, device, reduce):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        if world > 1:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(reduce(loss.detach()))
    return losses


def reference():
    """One CPU process, the full batch: what both distributed runs must reproduce."""
    torch.manual_seed(0)
    model = Net()
    losses = train(model, 0, 1, "cpu", lambda t: t.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def main(out: Path):
    dist.init_process_group(timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    def average(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        return t.item()

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Net().to("neuron"))
    ddp_losses = train(ddp, rank, world, "neuron", average)
    ddp_params = {k.removeprefix("module."): v.detach().cpu() for k, v in ddp.state_dict().items()}

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("neuron", (world,))
    torch.manual_seed(0)
    model = Net().to("neuron")
    fully_shard(model.norm, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = tuple(model.norm.weight.to_local().shape)
    fsdp_losses = train(model, rank, world, "neuron", average)
    fsdp_params = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    calls = torchneuron.metrics()["custom_kernel_calls"]
    if rank == 0:
        torch.save({"ddp": (ddp_losses, ddp_params), "fsdp": (fsdp_losses, fsdp_params),
                    "sharded_norm_weight": sharded, "calls": dict(calls)}, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    print(json.dumps({"ok": True}))
