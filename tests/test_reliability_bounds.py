"""Indexing: CPU index tensors and masks work on neuron tensors as on CUDA, and indices out of
range raise as on CPU instead of returning clamped values or silently doing nothing."""

import numpy as np
import pytest
import torch

import torchneuron

from conftest import assert_same


def _both(fn, base):
    """``fn`` on a CPU copy and on a neuron copy of ``base``: (cpu result, neuron result)."""
    return fn(base.clone()), fn(base.clone().to("neuron"))


_BASE = torch.arange(24.0).reshape(4, 6)


@pytest.mark.parametrize("fn", [
    lambda x: x[torch.tensor([0, 2])],
    lambda x: x[torch.tensor([True, False, True, True])],
    lambda x: x[torch.tensor([[True] * 6, [False] * 6, [True, False] * 3, [False] * 6])],
    lambda x: x[torch.tensor(True)],
    lambda x: x[torch.tensor([3, 1]), torch.tensor([5, 0])],
    lambda x: x[:, torch.tensor([4, 4, 1])],
    lambda x: x[torch.tensor([0, 1]).to(x.device), torch.tensor([1, 2])],   # one on each device
], ids=["int", "mask", "mask-2d", "mask-0d", "two-ints", "second-dim", "mixed"])
def test_cpu_index_tensors_and_masks_read_like_cuda(fn):
    cpu, neuron = _both(fn, _BASE)
    assert_same(neuron, cpu)


def _assign(index, value):
    def fn(x):
        x[index] = value if not isinstance(value, torch.Tensor) or value.dim() == 0 else value.to(x.device)
        return x
    return fn


@pytest.mark.parametrize("fn", [
    _assign(torch.tensor([True, False, True, False]), -1.0),
    _assign(torch.tensor([[True, False] * 3] * 4), torch.tensor(7.0)),
    _assign(torch.tensor([0, 3]), 5.0),
    _assign((torch.tensor([0, 1]), torch.tensor([2, 3])), torch.tensor([8.0, 9.0])),
    _assign(torch.tensor([False, True, False, True]), torch.arange(12.0).reshape(2, 6)),
    lambda x: x.index_put_((torch.tensor([1, 1]),), torch.ones(6).to(x.device), accumulate=True),
], ids=["mask-scalar", "mask-2d-tensor", "int-scalar", "two-ints-values", "mask-values", "accumulate"])
def test_cpu_index_tensors_and_masks_write_like_cuda(fn):
    cpu, neuron = _both(fn, _BASE)
    assert_same(neuron, cpu)


def test_cpu_mask_is_read_on_the_host_without_a_device_round_trip():
    x = _BASE.to("neuron")
    mask = _BASE[:, 0] > 5
    torchneuron.metrics.reset()
    assert_same(x[mask], _BASE[mask])
    assert torchneuron.metrics()["d2h_copies"] == 1   # the result only, not the mask


def test_cpu_values_with_elements_are_refused_like_cuda():
    # CUDA moves only a 0-d value tensor to the device; any other CPU value is a device mismatch.
    x = _BASE.to("neuron")
    with pytest.raises(RuntimeError, match="found at least two devices"):
        x[torch.tensor([0])] = torch.ones(6)


# -- out-of-range indices: raised like CPU, at the next synchronisation point --------------------
_X = torch.arange(12.0).reshape(3, 4)
_I = torch.tensor


_OUT_OF_RANGE = [
    ("getitem", lambda x: x[_I([0, 5]).to(x.device)]),
    ("getitem-negative", lambda x: x[_I([-4]).to(x.device)]),
    ("getitem-second-index", lambda x: x[_I([0]).to(x.device), _I([9]).to(x.device)]),
    ("getitem-cpu-index", lambda x: x[_I([3])]),
    ("index_select", lambda x: x.index_select(0, _I([3]).to(x.device))),
    ("index_select-negative", lambda x: x.index_select(0, _I([-1]).to(x.device))),
    ("gather", lambda x: x.gather(1, _I([[4]]).to(x.device))),
    ("gather-negative", lambda x: x.gather(1, _I([[-1]]).to(x.device))),
    ("embedding", lambda x: torch.nn.functional.embedding(_I([1, 3]).to(x.device), x)),
    ("index_put_", lambda x: x.index_put_((_I([3]).to(x.device),), _I(1.0).to(x.device))),
    ("index_put_-accumulate", lambda x: x.index_put_((_I([-4]).to(x.device),), _I(1.0).to(x.device), True)),
    ("setitem", lambda x: x.__setitem__(_I([7]).to(x.device), 1.0)),
    ("scatter_", lambda x: x.scatter_(0, _I([[3]]).to(x.device), 1.0)),
    ("scatter_add_", lambda x: x.scatter_add_(0, _I([[-1]]).to(x.device), torch.ones(1, 1, device=x.device))),
    ("take", lambda x: x.take(_I([12]).to(x.device))),
    ("put_", lambda x: x.put_(_I([-13]).to(x.device), _I([1.0]).to(x.device))),
    ("index_add_", lambda x: x.index_add_(0, _I([3]).to(x.device), torch.ones(1, 4, device=x.device))),
    ("index_copy_", lambda x: x.index_copy_(0, _I([-1]).to(x.device), torch.ones(1, 4, device=x.device))),
    ("index_fill_", lambda x: x.index_fill_(0, _I([3]).to(x.device), 1.0)),
    ("embedding_bag", lambda x: torch.nn.functional.embedding_bag(_I([1, 5]).to(x.device), x, _I([0]).to(x.device))),
    ("nll_loss", lambda x: torch.nn.functional.nll_loss(x, _I([0, -100, 4]).to(x.device))),
    ("cross_entropy", lambda x: torch.nn.functional.cross_entropy(x, _I([0, 1, -1]).to(x.device))),
]


def _cpu_error(fn):
    with pytest.raises(Exception) as err:
        fn(_X.clone())
    return err.value


@pytest.mark.parametrize("fn", [f for _, f in _OUT_OF_RANGE], ids=[n for n, _ in _OUT_OF_RANGE])
def test_out_of_range_indices_raise_like_cpu_at_the_next_sync(fn):
    expected = _cpu_error(fn)
    x = _X.clone().to("neuron")
    result = fn(x)                     # dispatched: eager mode stays asynchronous
    with pytest.raises(type(expected)) as err:
        (result if isinstance(result, torch.Tensor) else x).cpu()
    message = str(err.value)
    assert message.splitlines()[0] == str(expected).splitlines()[0]
    assert "test_reliability_bounds.py:" in message and "[torchneuron] raised by aten::" in message
    # Reported once; the device goes on working.
    assert (x[:1] * 0 + 2).cpu().tolist() == [[2.0] * 4]


def test_in_range_and_negative_indices_still_work():
    x = _X.to("neuron")
    assert_same(x[_I([-3, 2, -1]).to("neuron")], _X[_I([-3, 2, -1])])
    assert_same(x.take(_I([-12, 11]).to("neuron")), _X.take(_I([-12, 11])))
    assert_same(x.index_fill(1, _I([-4]).to("neuron"), 0.5), _X.index_fill(1, _I([-4]), 0.5))


def test_the_error_surfaces_at_item_print_and_synchronize():
    x = _X.to("neuron")
    for sync in (lambda y: y.sum().item(), lambda y: repr(y), lambda y: torch.neuron.synchronize()):
        y = x.index_select(0, _I([5]).to("neuron"))
        with pytest.raises(IndexError, match="index out of range in self"):
            sync(y)


def test_sync_mode_raises_at_the_op_itself(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "device_checks", "sync")
    x = _X.to("neuron")
    with pytest.raises(RuntimeError, match=r"index 4 is out of bounds for dimension 1 with size 4") as err:
        x.gather(1, _I([[4]]).to("neuron"))
    assert "aten::gather" in str(err.value)


def test_off_mode_compiles_no_checks(monkeypatch):
    from torchneuron.runtime import deferred
    monkeypatch.setattr(torchneuron.config, "device_checks", "off")
    x = _X.to("neuron")
    x.gather(1, _I([[4]]).to("neuron")).cpu()   # unchecked: no error, nothing pending
    assert deferred.pending() == 0


def test_out_of_range_index_in_a_compiled_graph():
    def f(x, i):
        return torch.nn.functional.embedding(i, x) * 2

    torch._dynamo.reset()
    g = torch.compile(f, backend="neuron")
    x = _X.to("neuron")
    assert_same(g(x, _I([2, 0]).to("neuron")), f(_X, _I([2, 0])))
    with pytest.raises(IndexError, match="index out of range in self") as err:
        g(x, _I([2, 3]).to("neuron")).cpu()
    assert "embedding" in str(err.value)


def test_out_of_range_index_in_adaptive_eager():
    x = _X.to("neuron")
    with torchneuron.eager_mode("adaptive"):
        y = (x * 2).gather(1, _I([[1], [7], [0]]).to("neuron")) + 1
        with pytest.raises(RuntimeError, match="index 7 is out of bounds for dimension 1 with size 4"):
            y.cpu()


# -- integer division by zero ---------------------------------------------------------------------
_A = torch.tensor([7, -7, 3])
_Z = torch.tensor([2, 0, 1])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("fn", [
    lambda a, b: a // b,
    lambda a, b: a % b,
    lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    lambda a, b: torch.div(a, b, rounding_mode="floor"),
    lambda a, b: torch.fmod(a, b),
    lambda a, b: a // 0,
    lambda a, b: torch.remainder(a, 0),
    lambda a, b: a.clone().floor_divide_(b),
], ids=["floordiv", "remainder", "trunc", "floor", "fmod", "floordiv-scalar", "remainder-scalar", "in-place"])
def test_integer_division_by_zero_raises_like_cpu(fn, dtype):
    a, b = _A.abs().to(dtype), _Z.to(dtype)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        fn(a, b)
    out = fn(a.to("neuron"), b.to("neuron"))
    with pytest.raises(ZeroDivisionError) as err:   # also a RuntimeError, like CPU's
        out.cpu()
    assert isinstance(err.value, RuntimeError) and str(err.value).startswith("ZeroDivisionError")


def test_integer_division_without_zero_and_float_division_by_zero_are_unchanged():
    a, b = _A.to("neuron"), (_Z + 1).to("neuron")
    assert_same(a // b, _A // (_Z + 1))
    assert_same(a % b, _A % (_Z + 1))
    f = _A.float().to("neuron")
    assert_same(f // _Z.float().to("neuron"), _A.float() // _Z.float(), equal_nan=True)   # inf/nan, no error
    assert_same(f % 0, _A.float() % 0, equal_nan=True)


_PERSISTED_RUN = """
import sys, torch, torchneuron
x = torch.arange(6.0, device="neuron")
x[torch.tensor([1, 2], device="neuron")].cpu()      # in range: compiles, or loads, the executable
try:
    x[torch.tensor([1, 9], device="neuron")].cpu()
    print("RESULT no error")
except IndexError as err:
    print("RESULT", err.args[0].splitlines()[0])
print("LOADED", torchneuron.metrics()["eager_cache_loads"])
"""


def test_an_executable_loaded_by_another_process_keeps_its_checks(tmp_path):
    import os
    import subprocess
    import sys

    def run(**env):
        proc = subprocess.run([sys.executable, "-c", _PERSISTED_RUN], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path), **env))
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
        assert "RESULT" in lines, proc.stderr[-3000:]
        return lines["RESULT"], int(lines["LOADED"])

    assert run() == ("index 9 is out of bounds for dimension 0 with size 6", 0)
    result, loaded = run()
    assert loaded > 0 and result == "index 9 is out of bounds for dimension 0 with size 6"
    # An executable compiled without checks is another entry, never loaded where checks are on.
    assert run(TORCHNEURON_DEVICE_CHECKS="off") == ("no error", 0)


def test_masked_scatter_with_too_small_a_source_raises_like_cpu(monkeypatch):
    # The mask selects 3 elements, the source has 2: neuron read past the source silently.
    dest = torch.arange(1.0, 11.0)
    mask = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    with pytest.raises(RuntimeError) as expected:
        dest.clone().masked_scatter_(mask, torch.zeros(2))
    d = dest.to("neuron")
    d.masked_scatter_(mask.to("neuron"), torch.zeros(2, device="neuron"))
    with pytest.raises(RuntimeError) as err:
        d.cpu()
    assert str(err.value).splitlines()[0] == str(expected.value)
    monkeypatch.setattr(torchneuron.config, "device_checks", "sync")
    with pytest.raises(RuntimeError, match="Number of elements of source < number of ones in mask"):
        dest.to("neuron").masked_scatter_(mask.to("neuron"), torch.zeros(2, device="neuron"))
    ok = dest.to("neuron").masked_scatter_(mask.to("neuron"), torch.arange(3.0, device="neuron"))
    assert ok.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 0.0, 6.0, 1.0, 8.0, 2.0, 10.0]


def test_pending_checks_start_every_copy_before_reading_one(monkeypatch):
    """At a synchronisation point the outcomes of all checked ops are copied to the host together:
    the program waits for the device once, not once per op (each read is a sync on a GPU)."""
    from torchneuron.runtime import deferred

    events = []
    real = np.asarray

    class Outcome:   # stands for a device array: records when its copy starts and when it is read
        def __init__(self, k, outcome):
            self.k, self.outcome = k, outcome

        def copy_to_host_async(self):
            events.append(("copy", self.k))

        def __array__(self, dtype=None, copy=None):
            events.append(("read", self.k))
            return real(self.outcome)

    x = _X.to("neuron")
    for k in range(3):
        x.index_select(0, _I([k]).to("neuron"))
    taken = list(deferred._pending)
    deferred.clear()
    for k, (outcome, checks, site) in enumerate(taken):
        deferred.defer(Outcome(k, outcome), checks, site)
    deferred.raise_pending()
    assert events == [("copy", 0), ("copy", 1), ("copy", 2), ("read", 0), ("read", 1), ("read", 2)]
