"""A neuron training script that builds one float64 tensor (a scale factor kept in double precision).

float64 runs as float32 on the device; the report must flag that, and nothing else.
"""

import torch

import torchneuron

torch.manual_seed(0)
device = "neuron"
model = torch.nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4).to(device)
y = torch.randn(16, 1).to(device)
scale = torch.tensor([0.5], dtype=torch.float64).to(device)

for _ in range(4):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    torchneuron.track("loss", loss)
    torchneuron.step()
print("scale", scale.item(), "loss", loss.item())
