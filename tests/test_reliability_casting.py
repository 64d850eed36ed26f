"""In-place ops and ``out=`` apply PyTorch's casting and device rules: a result that cannot be cast
to the written tensor's dtype is an error (never a silent truncation), out= tensors on another
device are refused as on CUDA, and index_put_/index_add_ want matching dtypes."""

import pytest
import torch

from conftest import assert_same


def _i(d):
    return torch.tensor([1, 2, 3], device=d)


def _f(d):
    return torch.tensor([1.5, 2.5, 3.5], device=d)


def _setitem(t, index, value):
    t[index] = value
    return t


def _same_error_or_result(fn):
    """fn(device) on CPU and on neuron: the same error (type and first line), or the same values."""
    try:
        expected = fn("cpu")
    except Exception as err:   # noqa: BLE001
        with pytest.raises(type(err)) as got:
            out = fn("neuron")
            if isinstance(out, torch.Tensor):
                out.cpu()
        assert str(got.value).splitlines()[0] == str(err).splitlines()[0]
        return
    assert_same(fn("neuron"), expected)


@pytest.mark.parametrize("fn", [
    lambda d: _i(d).mul_(1.5),
    lambda d: _i(d).add_(1 + 1j),
    lambda d: _i(d).add_(_f(d)),
    lambda d: _i(d).add_(torch.tensor(1.5, device=d)),
    lambda d: _i(d).add_(torch.tensor(1.5)),           # a 0-d CPU operand
    lambda d: _i(d).div_(2),
    lambda d: _i(d).pow_(0.5),
    lambda d: torch.tensor([True], device=d).add_(1),
    lambda d: _i(d).sub_(1.0),
    lambda d: _f(d).mul_(_i(d)),                        # float self: allowed
    lambda d: _i(d).mul_(2),                            # int scalar: allowed
    lambda d: _i(d).float().add_(1.5).long(),
], ids=["mul-float", "add-complex", "add-float-tensor", "add-0d", "add-cpu-0d", "div", "pow", "bool-add",
        "sub-float", "float-self", "int-scalar", "allowed-chain"])
def test_in_place_results_are_cast_like_cpu(fn):
    _same_error_or_result(fn)


@pytest.mark.parametrize("fn", [
    lambda d: torch.neg(_i(d), out=torch.empty(3, device=d)),
    lambda d: torch.neg(_f(d), out=torch.empty(3, dtype=torch.int64, device=d)),
    lambda d: torch.ceil(_f(d), out=torch.empty(3, dtype=torch.int64, device=d)),
    lambda d: torch.add(_f(d), _f(d), out=torch.empty(3, dtype=torch.int64, device=d)),
    lambda d: torch.add(_i(d), _i(d), out=torch.empty(3, dtype=torch.bool, device=d)),
    lambda d: torch.add(_i(d), _i(d), out=torch.empty(3, device=d)),       # int -> float: allowed
    lambda d: torch.sum(_f(d), 0, out=torch.empty((), dtype=torch.int64, device=d)),
    lambda d: torch.mm(_f(d).reshape(3, 1), _f(d).reshape(1, 3), out=torch.empty(3, 3, dtype=torch.int64, device=d)),
    lambda d: torch.where(_i(d) > 1, _f(d), _f(d), out=torch.empty(3, dtype=torch.int64, device=d)),
    lambda d: torch.div(_i(d), 2, out=torch.empty(3, dtype=torch.int64, device=d)),
], ids=["neg-int-to-float", "neg-float-to-int", "ceil", "add-float-to-int", "add-int-to-bool", "add-int-to-float",
        "sum", "mm", "where", "true-div"])
def test_out_dtypes_are_checked_like_cpu(fn):
    _same_error_or_result(fn)


@pytest.mark.parametrize("fn", [
    lambda x: torch.ceil(x, out=torch.empty(3)),
    lambda x: torch.neg(x, out=torch.empty(3)),
    lambda x: torch.add(x, x, out=torch.empty(3)),
    lambda x: torch.nonzero(x, out=torch.empty(0, 1, dtype=torch.int64)),
    lambda x: torch.sum(x, 0, out=torch.empty(())),
], ids=["ceil", "neg", "add", "nonzero", "sum-0d"])
def test_out_tensor_on_another_device_is_refused_like_cuda(fn):
    x = _f("neuron")
    with pytest.raises(RuntimeError, match="on the same device|to be on"):
        fn(x)


@pytest.mark.parametrize("fn", [
    lambda d: _f(d).index_put_((torch.tensor([0], device=d),), torch.tensor([5], device=d)),
    lambda d: _i(d).index_put_((torch.tensor([0], device=d),), torch.tensor([5.5], device=d)),
    lambda d: _setitem(_f(d), torch.tensor([0], device=d), torch.tensor([5], device=d)),
    lambda d: _i(d).index_add_(0, torch.tensor([0], device=d), torch.tensor([1.5], device=d)),
    lambda d: _f(d).index_put_((torch.tensor([0], device=d),), torch.tensor(5, device=d)),   # 0-d source
    lambda d: _setitem(_f(d), torch.tensor([0], device=d), 5),                              # Python scalar
], ids=["index_put-int-into-float", "index_put-float-into-int", "setitem", "index_add", "index_put-0d",
        "setitem-scalar"])
def test_index_put_and_index_add_want_matching_dtypes_like_cpu(fn):
    _same_error_or_result(fn)


@pytest.mark.parametrize("value", [0.5, 1.5, 2.7, 2])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_addcmul_converts_its_scalar_first_like_cpu(dtype, value):
    # ATen converts `value` to the tensors' integer type before computing: int(1.5) == 1.
    t = torch.tensor([1, 2, 3], dtype=dtype)
    n = t.to("neuron")
    assert_same(torch.addcmul(n, n, n, value=value), torch.addcmul(t, t, t, value=value))
