"""A training script written for CUDA, with a CPU path when CUDA is absent (tests/test_cuda_transfer.py
runs it as it is on CPU and with TORCHNEURON_CUDA=neuron, and compares the results)."""

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
if cuda:
    torch.cuda.manual_seed_all(0)
    torch.cuda.set_device(0)
    assert torch.cuda.device_count() >= 1 and torch.cuda.current_device() == 0

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
model = model.cuda() if cuda else model
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, pin_memory=cuda)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.cuda.amp.GradScaler() if cuda else torch.amp.GradScaler("cpu")
losses = []
info = {}
if cuda:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.Stream()
    start.record()
for _epoch in range(2):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
with torch.autocast(device, dtype=torch.bfloat16):
    amp_out = model(torch.ones(4, 8, device=device))
info["amp_dtype"] = str(amp_out.dtype)
info["amp_out"] = amp_out.float().cpu().tolist()
info["param_device"] = next(model.parameters()).device.type
if cuda:
    with torch.cuda.stream(stream):
        z = torch.zeros(3, device="cuda:0")
    end.record()
    torch.cuda.synchronize()
    info["elapsed_ms_positive"] = start.elapsed_time(end) > 0
    info["allocated"] = torch.cuda.memory_allocated() > 0
    info["peak_ge"] = torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    info["stats"] = torch.cuda.memory_stats()["allocated_bytes.all.current"] == torch.cuda.memory_allocated()
    info["summary"] = "Allocated memory" in torch.cuda.memory.memory_summary()
    info["rng_state"] = torch.cuda.get_rng_state().numel() > 0
    info["pinned"] = torch.ones(2).pin_memory().is_pinned()
    info["zeros_device"] = z.device.type
json.dump({"losses": losses, "info": info}, sys.stdout)
