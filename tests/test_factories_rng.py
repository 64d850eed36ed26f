"""Factory functions on neuron and the per-device random generator."""

import pytest
import torch

from conftest import assert_same

pytestmark = pytest.mark.usefixtures("strict_fallback")


@pytest.mark.parametrize("make", [
    lambda d: torch.zeros(2, 3, device=d),
    lambda d: torch.ones(4, dtype=torch.int64, device=d),
    lambda d: torch.full((2, 2), 7.5, device=d),
    lambda d: torch.full((3,), True, device=d),
    lambda d: torch.arange(10, device=d),
    lambda d: torch.arange(1.0, 4.0, 0.5, device=d),
    lambda d: torch.arange(0, 1, 0.1, device=d),
    lambda d: torch.linspace(-1, 1, 7, device=d),
    lambda d: torch.linspace(0, 10, 5, dtype=torch.int64, device=d),
    lambda d: torch.eye(3, device=d),
    lambda d: torch.eye(2, 4, dtype=torch.bfloat16, device=d),
    lambda d: torch.zeros_like(torch.empty(2, 5, device=d)),
    lambda d: torch.ones_like(torch.empty(3, device=d), dtype=torch.float16),
    lambda d: torch.full_like(torch.empty(2, 2, device=d), -3),
    lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
    lambda d: torch.empty(2, 3, device=d).fill_(2).add_(1),
])
def test_factories_match_cpu(make):
    n, c = make("neuron"), make("cpu")
    assert n.dtype == c.dtype and n.shape == c.shape
    assert_same(n, c)


def test_empty_and_empty_like_shapes():
    e = torch.empty(2, 3, 4, device="neuron", memory_format=torch.channels_last if False else torch.contiguous_format)
    assert e.shape == (2, 3, 4) and e.is_contiguous()
    cl = torch.empty(2, 3, 4, 5, device="neuron", memory_format=torch.channels_last)
    assert cl.stride() == torch.empty(2, 3, 4, 5, memory_format=torch.channels_last).stride()
    assert torch.empty_like(cl).stride() == cl.stride()


RANDOM = {
    "rand": lambda: torch.rand(1000, device="neuron"),
    "randn": lambda: torch.randn(1000, device="neuron"),
    "randint": lambda: torch.randint(3, 9, (1000,), device="neuron"),
    "randperm": lambda: torch.randperm(50, device="neuron"),
    "dropout": lambda: torch.nn.functional.dropout(torch.ones(1000, device="neuron"), 0.3),
    "bernoulli": lambda: torch.bernoulli(torch.full((1000,), 0.25, device="neuron")),
    "normal_": lambda: torch.empty(1000, device="neuron").normal_(2.0, 0.5),
    "uniform_": lambda: torch.empty(1000, device="neuron").uniform_(-2, 3),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_reproducible_under_seed_and_successive_calls_differ(name):
    torch.manual_seed(1234)
    a, b = RANDOM[name]().cpu(), RANDOM[name]().cpu()
    torch.manual_seed(1234)
    a2, b2 = RANDOM[name]().cpu(), RANDOM[name]().cpu()
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b)


def test_random_distributions():
    torch.manual_seed(0)
    u = torch.rand(20000, device="neuron").cpu()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    z = torch.randn(20000, device="neuron").cpu()
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.03
    r = torch.randint(3, 9, (20000,), device="neuron").cpu()
    assert r.dtype == torch.int64 and r.min() == 3 and r.max() == 8
    p = torch.randperm(100, device="neuron").cpu()
    assert sorted(p.tolist()) == list(range(100))
    d = torch.nn.functional.dropout(torch.ones(20000, device="neuron"), 0.3).cpu()
    assert set(d.unique().tolist()) <= {0.0, torch.tensor(1 / 0.7).item()} and abs((d == 0).float().mean() - 0.3) < 0.02
    n = torch.empty(20000, device="neuron").normal_(2.0, 0.5).cpu()
    assert abs(n.mean() - 2) < 0.02 and abs(n.std() - 0.5) < 0.02


def test_rng_state_round_trip():
    torch.neuron.manual_seed(7)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.rand(5, device="neuron").cpu()
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.rand(5, device="neuron").cpu(), a)
    assert torch.neuron.initial_seed() == 7
    torch.neuron.seed()
    assert torch.neuron.initial_seed() != 7
