"""The executable cache: same shapes compile nothing new, new scalars compile nothing, new shapes one."""

import torch

import torchneuron


def compiled():
    return torchneuron.metrics()["executables_compiled"]


def test_same_shapes_hit_the_cache():
    a = torch.randn(5, 7, device="neuron")
    b = torch.randn(5, 7, device="neuron")
    torch.add(a, b)
    before = compiled()
    hits = torchneuron.metrics()["cache_hits"]
    for _ in range(10):
        torch.add(a, b)
    assert compiled() == before
    assert torchneuron.metrics()["cache_hits"] == hits + 10


def test_new_scalar_value_compiles_nothing():
    p = torch.randn(4, 4, device="neuron")
    g = torch.randn(4, 4, device="neuron")
    p.add_(g, alpha=-0.1)
    before = compiled()
    for lr in (0.01, 0.02, 1e-5, 3.0):
        p.add_(g, alpha=-lr)
        p.mul_(1 - lr)
        p.clamp_(min=-lr)
    assert compiled() == before + 2  # mul_.Scalar and clamp_ once each, never per value


def test_new_shape_compiles_exactly_one():
    small, wide = torch.randn(3, 3, device="neuron"), torch.randn(6, 2, device="neuron")
    torch.relu(small)
    before = compiled()
    torch.relu(wide)
    assert compiled() == before + 1
    torch.relu(wide)
    assert compiled() == before + 1


def test_optimizer_learning_rate_schedule_compiles_nothing_new():
    model = torch.nn.Linear(8, 4).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(2, 8, device="neuron")

    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()

    step()
    step()
    before = compiled()
    for _ in range(4):
        step()
    assert compiled() == before
