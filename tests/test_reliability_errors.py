"""Error types and texts are CPU's: where a meta kernel raises another type or text than the CPU
kernel (Python references), or checks nothing (reductions over no elements, writes through
overlapping memory), neuron raises what CPU raises, plus the op and its inputs."""

import pytest
import torch

_CASES = [
    ("clamp", lambda d: torch.clamp(torch.ones(3, device=d))),
    ("clamp_", lambda d: torch.ones(3, device=d).clamp_()),
    ("clamp-none", lambda d: torch.clamp(torch.ones(3, device=d), None, None)),
    ("add-alpha", lambda d: torch.add(torch.ones(3, dtype=torch.int64, device=d),
                                      torch.ones(3, dtype=torch.int64, device=d), alpha=1.1)),
    ("add_-alpha", lambda d: torch.ones(3, dtype=torch.int64, device=d).add_(
        torch.ones(3, dtype=torch.int64, device=d), alpha=1.1)),
    ("sub-alpha", lambda d: torch.sub(torch.ones(3, dtype=torch.int64, device=d),
                                      torch.ones(3, dtype=torch.int64, device=d), alpha=1.1)),
    ("addcdiv-int", lambda d: torch.addcdiv(*[torch.ones(3, dtype=torch.int64, device=d)] * 3)),
    ("max-empty", lambda d: torch.empty(0, device=d).max()),
    ("min-empty", lambda d: torch.empty(0, device=d).min()),
    ("amax-empty", lambda d: torch.empty(0, device=d).amax()),
    ("max-dim-empty", lambda d: torch.empty(0, 3, device=d).max(0)),
    ("argmax-empty", lambda d: torch.empty(0, device=d).argmax()),
    ("expand-add_", lambda d: torch.ones(1, 3, device=d).expand(2, 3).add_(1)),
    ("expand-mul_", lambda d: torch.ones(3, 1, device=d).expand(3, 3).mul_(torch.ones(3, 3, device=d))),
    ("copy_-overlap", lambda d: (lambda x: x[1:].copy_(x[:-1]))(torch.arange(5.0, device=d))),
    ("copy_-expand", lambda d: torch.ones(1, 3, device=d).expand(2, 3).copy_(torch.ones(2, 3, device=d))),
    ("add_-partial-overlap", lambda d: (lambda x: x[1:].add_(x[:-1]))(torch.arange(5.0, device=d))),
    ("out-expand", lambda d: torch.mul(torch.ones(2, 3, device=d), 2,
                                       out=torch.ones(1, 3, device=d).expand(2, 3))),
]


@pytest.mark.parametrize("fn", [f for _, f in _CASES], ids=[n for n, _ in _CASES])
def test_errors_have_cpu_types_and_texts(fn):
    with pytest.raises(Exception) as cpu:
        fn("cpu")
    with pytest.raises(type(cpu.value)) as neuron:
        out = fn("neuron")
        if isinstance(out, torch.Tensor):
            out.cpu()
    assert type(neuron.value) is type(cpu.value)
    assert str(neuron.value).splitlines()[0] == str(cpu.value).splitlines()[0]
    assert "[torchneuron] in aten::" in str(neuron.value)


@pytest.mark.parametrize("fn", [
    lambda d: (lambda x: x.add_(x))(torch.arange(5.0, device=d)),                   # the very same view
    lambda d: (lambda x: x[:2].add_(x[3:]))(torch.arange(5.0, device=d)),           # disjoint views
    lambda d: torch.ones(1, 3, device=d).expand(2, 3).fill_(2),                     # fill_ allows it
    lambda d: torch.ones(1, 3, device=d).expand(2, 3).zero_(),
    lambda d: torch.ones(2, 3, device=d).max(1)[0],
], ids=["same-view", "disjoint", "fill_", "zero_", "max-dim"])
def test_what_cpu_accepts_still_runs(fn):
    torch.testing.assert_close(fn("neuron").cpu(), fn("cpu"))
