"""A small regression model that runs entirely on neuron: the report should find nothing."""

import torch

import torchneuron

torch.manual_seed(0)
device = "neuron"
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True) * 0.5
x, y = x.to(device), y.to(device)

for _ in range(6):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    torchneuron.track("loss", loss)
    torchneuron.step(samples=x.shape[0])
print("final loss", loss.item())
