"""Views alias their base exactly like a real device; in-place writes through views reach it."""

import pytest
import torch

from conftest import assert_same

pytestmark = pytest.mark.usefixtures("strict_fallback", "both_eager_modes")


def pair(*shape, dtype=torch.float32):
    c = torch.arange(int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape)
    return c, c.to("neuron")


VIEWS = {
    "view": lambda x: x.view(4, 6),
    "reshape": lambda x: x.reshape(2, 2, 6),
    "t": lambda x: x.t(),
    "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.reshape(2, 3, 4).permute(2, 0, 1),
    "step_slice": lambda x: x[1:4:2, ::3],
    "narrow": lambda x: x.narrow(1, 2, 3),
    "select": lambda x: x.select(0, 2),
    "expand": lambda x: x[:1].expand(5, 6),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "squeeze": lambda x: x[:1].squeeze(0),
    "diagonal": lambda x: x.diagonal(),
    "unfold": lambda x: x.unfold(1, 2, 2),
    "as_strided": lambda x: x.as_strided((3, 3), (7, 2), 1),
    "view_dtype": lambda x: x.view(torch.int32),
    "split": lambda x: x.split(2)[1],
    "chunk": lambda x: x.chunk(3, dim=1)[2],
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_metadata_and_values(name):
    c, n = pair(4, 6)
    fn = VIEWS[name]
    cv, nv = fn(c), fn(n)
    assert nv.shape == cv.shape
    assert nv.stride() == cv.stride()
    assert nv.storage_offset() == cv.storage_offset()
    # _base follows PyTorch: set for views of n, None where CPU has none (view(dtype)).
    assert (nv._base is None) == (cv._base is None)
    assert nv._base is None or nv._base is n
    assert nv.untyped_storage().data_ptr() == n.untyped_storage().data_ptr()
    assert_same(nv, cv)
    # Non-contiguous inputs work as operands.
    assert_same(nv * 2 if nv.dtype.is_floating_point else nv + 1, cv * 2 if cv.dtype.is_floating_point else cv + 1)


INPLACE = {
    "column_add": lambda x: x[:, 1].add_(1),
    "t_mul": lambda x: x.t().mul_(2),
    "strided_assign": lambda x: x[1:3, ::2].fill_(5),
    "setitem_scalar": lambda x: x.__setitem__((slice(1, 3), slice(None, None, 2)), 5),
    "mask_assign": lambda x: x.__setitem__(x > 10, 0),
    "index_add_assign": lambda x: x.__setitem__(torch.tensor([0, 2]).to(x.device),
                                                x[torch.tensor([0, 2]).to(x.device)] + 100),
    "diagonal_fill": lambda x: x.diagonal().fill_(0),
    "permuted_sub": lambda x: x.view(2, 3, 4).permute(2, 1, 0).sub_(3),
    "copy_into_view": lambda x: x[2].copy_(torch.arange(6.0)),
    "view_dtype_write": lambda x: x.view(torch.int32)[0].fill_(0),
}


@pytest.mark.parametrize("name", sorted(INPLACE))
def test_inplace_through_view_reaches_base(name):
    c, n = pair(4, 6)
    INPLACE[name](c)
    INPLACE[name](n)
    assert_same(n, c)


def test_index_put_accumulate():
    c, n = pair(5, 3)
    idx = torch.tensor([0, 2, 0])
    y = torch.ones(3, 3)
    c[idx] += y
    n[idx.to("neuron")] += y.to("neuron")
    assert_same(n, c)
    c.index_put_((idx,), y, accumulate=True)
    n.index_put_((idx.to("neuron"),), y.to("neuron"), accumulate=True)
    assert_same(n, c)


def test_out_variants():
    a, na = pair(3, 4)
    out_c = torch.empty(3, 4)
    out_n = torch.empty(3, 4, device="neuron")
    r = torch.add(a, a, out=out_n.to("cpu") if False else out_c)
    rn = torch.add(na, na, out=out_n)
    assert rn is out_n and r is out_c
    assert_same(out_n, out_c)
    # out= into a view of a bigger tensor
    big_c, big_n = torch.zeros(3, 8), torch.zeros(3, 8, device="neuron")
    torch.mul(a, 2, out=big_c[:, ::2])
    torch.mul(na, 2, out=big_n[:, ::2])
    assert_same(big_n, big_c)
    # empty out gets resized, like PyTorch
    e = torch.empty(0, device="neuron")
    torch.sum(na, dim=0, out=e)
    assert_same(e, a.sum(0))


def test_chained_views_and_autograd_through_views():
    c = torch.randn(4, 6, requires_grad=True)
    n = c.detach().to("neuron").requires_grad_()
    (c.t()[1:, ::2] * 3).sum().backward()
    (n.t()[1:, ::2] * 3).sum().backward()
    assert_same(n.grad, c.grad)


def test_inplace_on_leaf_view_updates_all_aliases():
    _, n = pair(2, 3)
    v1 = n[0]
    v2 = n.view(6)
    v1.zero_()
    assert v2.cpu()[:3].tolist() == [0.0, 0.0, 0.0]
    assert n.cpu()[1].tolist() == [3.0, 4.0, 5.0]


def test_in_place_list_op_with_an_empty_tensor_among_views():
    """Mutated tensors without elements have nothing to write, and must not shift the others."""
    base = torch.arange(12.0).reshape(3, 4)
    n = base.to("neuron")
    cpu_list = [base[0], torch.empty(0), base[2, 1:]]
    neuron_list = [n[0], torch.empty(0, device="neuron"), n[2, 1:]]
    torch._foreach_add_(cpu_list, 1.5)
    torch._foreach_add_(neuron_list, 1.5)
    torch._foreach_mul_(cpu_list, [2.0, 3.0, 4.0])
    torch._foreach_mul_(neuron_list, [2.0, 3.0, 4.0])
    torch.testing.assert_close(n.cpu(), base)
