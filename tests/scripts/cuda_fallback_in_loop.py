"""A training script written for CUDA (no torchneuron in it) that calls torch.histc every step.

histc has no neuron lowering and no decomposition, so under `--device-map cuda=neuron` it runs on
CPU inside the hot loop: the one problem the report must find. Steps are detected from
optimizer.step(); the loop is longer than the step budget the test gives.
"""

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 8).to(device)
y = torch.randn(32, 1, device=device)

for step in range(1000):
    opt.zero_grad()
    hidden = model[1](model[0](x))
    activation_histogram = torch.histc(hidden, bins=10, min=-1, max=1)   # logged every step
    loss = torch.nn.functional.mse_loss(model[2](hidden), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
print("histogram", activation_histogram.sum().item())
