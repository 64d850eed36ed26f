"""torch.compile(backend="neuron") fed a different sequence length every step: each step recompiles.

The report must call this "recompiles every step", and nothing else.
"""

import torch

import torchneuron

torch.manual_seed(0)
device = "neuron"
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
compiled = torch.compile(model, backend="neuron", dynamic=False)

with torch.no_grad():
    for length in (3, 5, 7, 9, 11, 13):
        tokens = torch.randn(length, 8).to(device)     # a new shape every step
        out = compiled(tokens)
        torchneuron.track("out_mean", out.mean())
        torchneuron.step(samples=length)
print("done", out.shape)
