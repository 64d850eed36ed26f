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


# Writes through overlapping memory past the CPU replay's size limit (64 MiB) were refused only by
# replaying the call on CPU, which made no replay and let them run: ATen's overlap rules now decide
# from the views' strides and spans where the replay gives no verdict.
def test_overlapping_copy_past_the_replay_limit_raises_cpus_error():
    from torchneuron.eager import oracle

    def case(d):
        x = torch.arange(17_000_000.0, device=d)
        assert x.untyped_storage().nbytes() > oracle.REPLAY_LIMIT_BYTES
        x[1:].copy_(x[:-1])
        return x

    with pytest.raises(RuntimeError) as cpu:
        case("cpu")
    with pytest.raises(RuntimeError) as neuron:
        case("neuron").cpu()
    assert str(neuron.value).splitlines()[0] == str(cpu.value).splitlines()[0]


_STRUCTURAL = [
    ("copy_-partial", lambda d: (lambda x: x[1:].copy_(x[:-1]))(torch.arange(5.0, device=d))),
    ("copy_-same-view", lambda d: (lambda x: x.copy_(x))(torch.arange(5.0, device=d))),
    ("copy_-transposed-same-bytes", lambda d: (lambda x: x.copy_(x.t()))(torch.arange(9.0, device=d).view(3, 3))),
    ("add_-partial", lambda d: (lambda x: x[1:].add_(x[:-1]))(torch.arange(5.0, device=d))),
    ("add_-same-view", lambda d: (lambda x: x.add_(x))(torch.arange(5.0, device=d))),
    ("add_-disjoint", lambda d: (lambda x: x[:2].add_(x[3:]))(torch.arange(5.0, device=d))),
    ("add_-interleaved", lambda d: (lambda x: x[::2].add_(x[1::2]))(torch.arange(6.0, device=d))),
    ("expand-add_", lambda d: torch.ones(1, 3, device=d).expand(2, 3).add_(1)),
    ("expand-copy_", lambda d: torch.ones(1, 3, device=d).expand(2, 3).copy_(torch.ones(2, 3, device=d))),
    ("expand-fill_", lambda d: torch.ones(1, 3, device=d).expand(2, 3).fill_(2)),
    ("expand-zero_", lambda d: torch.ones(1, 3, device=d).expand(2, 3).zero_()),
    ("out-expand", lambda d: torch.mul(torch.ones(2, 3, device=d), 2, out=torch.ones(1, 3, device=d).expand(2, 3))),
    ("neg-out-partial", lambda d: (lambda x: torch.neg(x[:5], out=x[1:6]))(torch.arange(10.0, device=d))),
    ("index_fill_-own-index", lambda d: (lambda i: i.index_fill_(0, i, 0))(torch.tensor([0, 1, 2], device=d))),
    ("scatter_-own-index", lambda d: (lambda i: i.scatter_(0, i, 1))(torch.tensor([0, 1, 2], device=d))),
    ("index_put_-values-view", lambda d: (lambda x: x.index_put_((torch.tensor([0, 1], device=d),), x[1:3]))(
        torch.arange(4.0, device=d))),
    ("inv-out-expand", lambda d: torch.linalg.inv(torch.eye(3, device=d) + 0.1,
                                                  out=torch.ones(1, 3, device=d).expand(3, 3))),
    ("inv-out-partial", lambda d: (lambda x: torch.linalg.inv(x[:3, :3], out=x[1:, 1:]))(torch.eye(4, device=d) + 0.1)),
]


def outcome(fn, d):
    """("ok", result on CPU) or (the first line of the RuntimeError, None)."""
    try:
        out = fn(d)
        if d == "neuron":
            torch.neuron.synchronize()
        return "ok", out.cpu() if isinstance(out, torch.Tensor) else None
    except RuntimeError as err:
        return str(err).splitlines()[0], None


@pytest.mark.parametrize("fn", [f for _, f in _STRUCTURAL], ids=[n for n, _ in _STRUCTURAL])
def test_overlap_rules_from_strides_agree_with_cpu(fn, monkeypatch):
    """With no CPU replay possible (a limit of 0 bytes), ATen's rules applied to the views give
    CPU's verdict."""
    from torchneuron.eager import oracle

    expected = outcome(fn, "cpu")
    monkeypatch.setattr(oracle, "REPLAY_LIMIT_BYTES", 0)
    got = outcome(fn, "neuron")
    assert got[0] == expected[0]
    if expected[1] is not None:
        torch.testing.assert_close(got[1], expected[1])


def test_out_overlap_is_checked_per_call_not_per_dtypes():
    """An out= op's CPU check ran once per (out, result) dtypes: a later call with the same dtypes
    writing a view that overlaps its input ran silently."""
    def calls(d):
        x = torch.arange(10.0, device=d)
        outcome = []
        for out in (torch.empty(5, device=d), x[1:6], x[5:]):
            try:
                torch.neg(x[:5], out=out)
                outcome.append("ok")
            except RuntimeError as err:
                outcome.append(str(err).splitlines()[0])
        return outcome, x.cpu()

    got, expected = calls("neuron"), calls("cpu")
    assert got[0] == expected[0] and got[0][1].startswith("unsupported operation")
    torch.testing.assert_close(got[1], expected[1])


# Index tensors the meta kernels let through: a float index (CPU: IndexError for index/index_put,
# each op's own error for index_fill, put...) gave a RuntimeError ("compiling ... failed") in
# adaptive eager, or ran (x[f] = t); a boolean mask of the wrong shape ran in both modes.
_INDEX_CASES = [
    ("getitem-float", lambda d, x: x[torch.tensor([0.0, 1.0], device=d)]),
    ("setitem-float", lambda d, x: x.__setitem__(torch.tensor([0.0, 1.0], device=d), torch.ones(4, device=d))),
    ("index_put_-float-accumulate", lambda d, x: x.index_put_((torch.tensor([0.0], device=d),),
                                                                torch.tensor(1.0, device=d), accumulate=True)),
    ("index_put_-float-cpu-index", lambda d, x: x.index_put_((torch.tensor([0.0]),), torch.tensor(1.0, device=d))),
    ("index_fill-float", lambda d, x: x.index_fill(0, torch.tensor([0.0], device=d), 1.0)),
    ("index_add-float", lambda d, x: x.index_add(0, torch.tensor([0.0], device=d), torch.ones(1, 4, device=d))),
    ("index_copy-float", lambda d, x: x.index_copy(0, torch.tensor([0.0], device=d), torch.ones(1, 4, device=d))),
    ("put-float", lambda d, x: x.put(torch.tensor([0.0], device=d), torch.ones(1, device=d))),
    ("getitem-mask-shape", lambda d, x: x[torch.tensor([True, False], device=d)]),
    ("getitem-mask-shape-dim1", lambda d, x: x[:, torch.ones(3, dtype=torch.bool, device=d)]),
    ("setitem-mask-shape", lambda d, x: x.__setitem__(torch.tensor([True, False], device=d), 1.0)),
    ("getitem-cpu-mask-shape", lambda d, x: x[torch.tensor([True, False])]),
]


@pytest.mark.parametrize("mode", ["plain", "adaptive"])
@pytest.mark.parametrize("fn", [f for _, f in _INDEX_CASES], ids=[n for n, _ in _INDEX_CASES])
def test_bad_index_tensors_raise_cpus_error(fn, mode):
    import torchneuron
    with pytest.raises(Exception) as cpu:
        fn("cpu", torch.arange(12.0).view(3, 4))
    with pytest.raises(type(cpu.value)) as neuron, torchneuron.eager_mode(mode):
        out = fn("neuron", torch.arange(12.0, device="neuron").view(3, 4))
        torch.neuron.synchronize()
        if isinstance(out, torch.Tensor):
            out.cpu()
    assert type(neuron.value) is type(cpu.value)
    assert str(neuron.value).splitlines()[0] == str(cpu.value).splitlines()[0]
