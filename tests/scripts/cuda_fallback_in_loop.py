"""A training script written for CUDA (no torchneuron in it) that calls its own extension op
every step.

The op (like a team's custom kernel) has an implementation for CPU only, so under
`--device-map cuda=neuron` it runs on CPU inside the hot loop: the one problem the report must
find. Steps are detected from optimizer.step(); the loop is longer than the step budget the test
gives.
"""

import torch


@torch.library.custom_op("mylab::activation_histogram", mutates_args=(), device_types="cpu")
def activation_histogram(x: torch.Tensor) -> torch.Tensor:
    return torch.histc(x, bins=10, min=-1, max=1)


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(32, 8).to(device)
y = torch.randn(32, 1, device=device)

for _step in range(1000):
    opt.zero_grad()
    hidden = model[1](model[0](x))
    histogram = activation_histogram(hidden.detach())   # logged every step
    loss = torch.nn.functional.mse_loss(model[2](hidden), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
print("histogram", histogram.sum().item())
