"""CPU index tensors on neuron tensors follow PyTorch's CUDA rule (ops/devices.py): advanced
indexing and index_put_ move CPU indices and masks to the device (a counted host->device copy);
the other index ops refuse them, 0-dim ones included, with an error naming the op and the way out.
CPU PyTorch is the oracle for the values."""

import pytest
import torch

import torchneuron

from conftest import assert_same

_X = torch.arange(24.0).reshape(4, 6)
_IDX = torch.tensor([2, 0, 2])
_MASK = torch.tensor([True, False, True, True])


def _ones(t, *shape):
    return torch.ones(*shape, device=t.device)


# -- accepted: what CUDA accepts ------------------------------------------------------------------
_ACCEPTED = {
    "x[idx]": lambda x: x[_IDX],
    "x[:, idx]": lambda x: x[:, _IDX],
    "x[idx, idx]": lambda x: x[_IDX, torch.tensor([5, 1, 0])],
    "x[mask]": lambda x: x[_MASK],
    "x[idx] = v": lambda x: x.__setitem__(_IDX, _ones(x, 6) * 7) or x,
    "x[mask] = scalar": lambda x: x.__setitem__(_MASK, -1.0) or x,
    "index_put_": lambda x: x.index_put_((_IDX,), _ones(x, 3, 6) * 3),
    "index_put_ accumulate": lambda x: x.index_put_((_IDX,), _ones(x, 3, 6), accumulate=True),
    "index_put_ cpu 0-d value": lambda x: x.index_put_((_IDX,), torch.tensor(5.0)),
    "index_put": lambda x: x.index_put((_IDX, torch.tensor([1, 1, 4])), _ones(x, 3), accumulate=True),
    "_index_put_impl_": lambda x: torch.ops.aten._index_put_impl_(x, (_IDX,), _ones(x, 3, 6), True),
    "aten.index 0-d index": lambda x: torch.ops.aten.index.Tensor(x, [torch.tensor(3)]),
    # index/index_put without bounds checks (what upsampling's decompositions emit): CUDA takes
    # their CPU indices through index/index_put; neuron refused them.
    "_unsafe_index": lambda x: torch.ops.aten._unsafe_index(x, [_IDX]),
    "_unsafe_index two": lambda x: torch.ops.aten._unsafe_index(x, [_IDX, torch.tensor([5, 1, 0])]),
    "_unsafe_index_put": lambda x: torch.ops.aten._unsafe_index_put(x, [_IDX], _ones(x, 3, 6) * 3, False),
    "_unsafe_index_put accumulate": lambda x: torch.ops.aten._unsafe_index_put(x, [_IDX], _ones(x, 3, 6), True),
}


@pytest.mark.parametrize("fn", list(_ACCEPTED.values()), ids=list(_ACCEPTED))
def test_ops_that_move_cpu_indices_give_cpu_values(fn):
    assert_same(fn(_X.to("neuron")), fn(_X.clone()))


@pytest.mark.parametrize("fn", [_ACCEPTED["x[idx]"], _ACCEPTED["index_put_ accumulate"],
                                _ACCEPTED["x[mask] = scalar"]], ids=["x[idx]", "index_put_", "mask"])
def test_a_moved_cpu_index_is_a_counted_host_to_device_copy(fn):
    x = _X.to("neuron")
    torchneuron.metrics.reset()
    fn(x)
    m = torchneuron.metrics()
    assert m["h2d_copies"] == 1   # the index (or mask): the migration report shows it
    assert m["h2d_bytes"] in (_IDX.nbytes, _MASK.nbytes)


def test_cpu_indices_under_adaptive_eager_replay_and_stay_in_one_region(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "adaptive_compile_budget", 1.0)
    ref = _X.clone()
    x = _X.to("neuron")
    with torchneuron.eager_mode("adaptive"):
        for _ in range(4):   # the region repeats: later steps replay it
            for t in (x, ref):
                y = t[_IDX]
                t.index_put_((_IDX,), y * 2, accumulate=True)
                t[_MASK] = t[_MASK] - 1
            torch.neuron.synchronize()
            assert_same(x, ref)
    m = torchneuron.metrics()
    assert m["region_replayed_ops"] > 0
    # Moving an index does not cut the region (a copy_ into a new storage used to flush it).
    assert m["flush_reasons"].get("host write", 0) == 0, m["flush_reasons"]


def test_cpu_indices_in_a_compiled_graph_give_cpu_values():
    def f(x, idx, mask):
        x = x * 2
        x[idx] = 0.0
        return x[mask] + x[idx].sum()

    compiled = torch.compile(f, backend="neuron")
    assert_same(compiled(_X.to("neuron"), _IDX, _MASK), f(_X.clone(), _IDX, _MASK))


def test_unsafe_index_refuses_a_mask_as_cpu_does():
    for x, mask_device in ((_X.clone(), "cpu"), (_X.to("neuron"), "cpu"), (_X.to("neuron"), "neuron")):
        with pytest.raises(RuntimeError, match="^_unsafe_index found unexpected index type Bool$"):
            torch.ops.aten._unsafe_index(x, [_MASK.to(mask_device)])


# -- refused: what CUDA refuses ---------------------------------------------------------------------
def _refused(idx, mask):
    """op -> call with a CPU index or mask of the given shape (CPU accepts every one of them)."""
    src = torch.ones(idx.numel(), 6)
    gather_idx = idx.reshape(-1, 1).expand(-1, 6).contiguous() if idx.dim() else idx
    return {
        "index_fill_": ("index", lambda x: x.index_fill_(0, idx, 1.0)),
        "index_fill": ("index", lambda x: x.index_fill(0, idx, torch.tensor(1.0))),
        "index_add_": ("index", lambda x: x.index_add_(0, idx, src.to(x.device), alpha=2)),
        "index_copy_": ("index", lambda x: x.index_copy_(0, idx, src.to(x.device))),
        "index_select": ("index", lambda x: x.index_select(0, idx)),
        "gather": ("index", lambda x: (x if idx.dim() else x.reshape(-1)).gather(0, gather_idx)),
        "scatter_": ("index", lambda x: (x if idx.dim() else x.reshape(-1)).scatter_(0, gather_idx, 9.0)),
        "scatter_add": ("index", lambda x: x.scatter_add(0, gather_idx, torch.ones_like(x[:len(gather_idx)]))
                        if idx.dim() else x.reshape(-1).scatter_add(0, idx, x.reshape(-1)[:1])),
        "masked_fill_": ("mask", lambda x: x.masked_fill_(mask, 1.0)),
        "masked_fill": ("mask", lambda x: x.masked_fill(mask, 1.0)),
        "take": ("index", lambda x: x.take(idx)),
        "put_": ("index", lambda x: x.put_(idx, torch.full(idx.shape, 5.0, device=x.device))),
    }


_REFUSED_1D = _refused(torch.tensor([2, 0]), _MASK.reshape(4, 1))
_REFUSED_0D = _refused(torch.tensor(1), torch.tensor(True))


@pytest.mark.parametrize("index_dim", [1, 0])
@pytest.mark.parametrize("op", list(_REFUSED_1D))
def test_index_ops_cuda_refuses_refuse_cpu_indices_naming_the_op_and_the_way_out(op, index_dim):
    arg, fn = (_REFUSED_1D if index_dim else _REFUSED_0D)[op]
    fn(_X.clone())   # CPU takes the call: the refusal is about the device only
    x = _X.to("neuron")
    with pytest.raises(RuntimeError) as info:
        fn(x)
    message = str(info.value)
    assert message.startswith("Expected all tensors to be on the same device, but found at least two "
                              "devices, neuron:0 and cpu!"), message
    assert f"argument {arg} in method aten::{op.rstrip('_')}" in message, message
    assert f"{arg}.to('neuron:0')" in message, message
    assert_same(x, _X)   # nothing was written


def test_the_refusal_holds_in_adaptive_eager_mode():
    x = _X.to("neuron")
    with torchneuron.eager_mode("adaptive"):
        for _ in range(3):
            y = x + 1
            with pytest.raises(RuntimeError, match=r"aten::index_fill_.*index.to\('neuron:0'\)"):
                y.index_fill_(0, torch.tensor([1]), 0.0)
            torch.neuron.synchronize()
    assert_same(y, _X + 1)


def test_other_device_mismatches_name_the_op_and_the_argument():
    with pytest.raises(RuntimeError, match=r"argument other in method aten::add.Tensor\)\n.*other.to\('neuron:0'\)"):
        torch.ones(3, device="neuron") + torch.ones(3)
    # A 0-dim CPU tensor is still a scalar operand where CUDA takes one.
    assert_same(torch.ones(3, device="neuron") * torch.tensor(2.0), torch.full((3,), 2.0))


def test_compiled_graphs_refuse_a_0d_cpu_index_as_eager_mode_does():
    # Dynamo's fake tensors refuse CPU index tensors with elements, but take 0-dim ones as CPU scalars.
    compiled = torch.compile(lambda x, i: x.index_select(0, i) * 2, backend="neuron")
    with pytest.raises(Exception, match=r"argument index in method aten::index_select\)\n.*index.to\('neuron:0'\)"):
        compiled(_X.to("neuron"), torch.tensor(1))
