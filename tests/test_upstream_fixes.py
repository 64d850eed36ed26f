"""Defects PyTorch's own upstream tests found on neuron (torchneuron.tools.upstream), each checked
against CPU PyTorch."""

import pytest
import torch


def _error(fn, device):
    try:
        fn(device)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


# TestCommon.test_dtypes_multinomial: neuron sampled from integer, bool and complex "probabilities"
# and returned zero or too-few samples where CPU raises.
@pytest.mark.parametrize("case", [
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.int64, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.uint8, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.bool, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, dtype=torch.complex64, device=d), 1),
    lambda d: torch.multinomial(torch.ones(3, device=d), 0),
    lambda d: torch.multinomial(torch.ones(3, device=d), 4),
    lambda d: torch.multinomial(torch.ones(2, 0, device=d), 1),
    lambda d: torch.multinomial(torch.ones(2, 2, 3, device=d), 1),
], ids=["int64", "uint8", "bool", "complex64", "zero-samples", "more-than-categories",
        "no-categories", "3-d"])
def test_multinomial_rejects_what_cpu_rejects(case):
    expected = _error(case, "cpu")
    assert expected is not None
    assert _error(case, "neuron") == expected


def test_multinomial_valid_arguments_still_sample():
    probs = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 0.0, 0.0]])
    out = torch.multinomial(probs.to("neuron"), 2).cpu()
    assert out.dtype == torch.int64 and out.shape == (2, 2)
    assert set(out[0].tolist()) == {1, 3}          # without replacement: both non-zero categories
    with_replacement = torch.multinomial(probs.to("neuron"), 5, replacement=True).cpu()
    assert with_replacement.shape == (2, 5) and (with_replacement[1] == 0).all()
    half = torch.multinomial(probs.to(torch.float16).to("neuron"), 1).cpu()
    assert half.dtype == torch.int64 and half[1].item() == 0


# TestCommon.test_dtypes_nn_functional_huber_loss: integer losses ran on neuron where ATen's
# floating-point kernels raise NotImplementedError.
@pytest.mark.parametrize("loss", [torch.nn.functional.huber_loss, torch.nn.functional.smooth_l1_loss])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_floating_only_losses_reject_integers_like_cpu(loss, dtype):
    a, b = torch.arange(6).reshape(2, 3).to(dtype), torch.full((2, 3), 2, dtype=dtype)
    with pytest.raises(NotImplementedError, match="not implemented for"):
        loss(a, b)
    with pytest.raises(NotImplementedError, match=r"not implemented for '(Long|Int|Byte)'"):
        loss(a.to("neuron"), b.to("neuron"))


@pytest.mark.parametrize("loss", [torch.nn.functional.huber_loss, torch.nn.functional.smooth_l1_loss])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floating_only_losses_still_match_cpu(loss, dtype):
    a = torch.arange(6.0).reshape(2, 3).to(dtype)
    b = torch.full((2, 3), 2.0, dtype=dtype)
    for reduction in ("mean", "none"):
        got = loss(a.to("neuron"), b.to("neuron"), reduction=reduction)
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu(), loss(a, b, reduction=reduction))
