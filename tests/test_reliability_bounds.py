"""Indexing: CPU index tensors and masks work on neuron tensors as on CUDA, and indices out of
range raise as on CPU instead of returning clamped values or silently doing nothing."""

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
