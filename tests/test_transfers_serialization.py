"""Host <-> device transfers and torch.save/torch.load round trips."""

import io

import numpy as np
import pytest
import torch

import torchneuron

from conftest import assert_same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int16,
                                   torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_round_trip_every_dtype(dtype):
    c = (torch.randn(5, 7) * 10).to(dtype)
    n = c.to("neuron")
    assert n.dtype == dtype and n.device == torch.device("neuron:0")
    assert torch.equal(n.cpu(), c)


def test_to_variants_and_copy_both_directions():
    c = torch.randn(4, 3)
    n = c.to("neuron", non_blocking=True)
    assert torch.equal(n.to(torch.float16).cpu(), c.to(torch.float16))
    assert torch.equal(n.to("cpu", torch.int32), c.to(torch.int32))
    dst = torch.empty(4, 3, device="neuron")
    dst.copy_(c, non_blocking=True)
    assert torch.equal(dst.cpu(), c)
    host = torch.empty(4, 3, dtype=torch.float64)
    host.copy_(n)
    assert torch.equal(host, c.double())
    # broadcasting copy into a strided view
    big = torch.zeros(4, 6, device="neuron")
    big[:, ::2].copy_(torch.arange(3.0))
    ref = torch.zeros(4, 6)
    ref[:, ::2].copy_(torch.arange(3.0))
    assert_same(big, ref)


def test_transfers_are_counted():
    torchneuron.metrics.reset()
    c = torch.randn(10, 10)
    n = c.to("neuron")
    n.cpu()
    m = torchneuron.metrics()
    assert (m["h2d_copies"], m["h2d_bytes"]) == (1, 400)
    assert (m["d2h_copies"], m["d2h_bytes"]) == (1, 400)


def test_item_tolist_numpy_print():
    n = torch.tensor([[1.5, 2.0], [3.0, 4.0]], device="neuron")
    assert n[0, 0].item() == 1.5
    assert n.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert torch.tensor(3, device="neuron").item() == 3
    with pytest.raises(TypeError, match="can't convert neuron:0 device type tensor to numpy"):
        n.numpy()
    np.testing.assert_array_equal(n.cpu().numpy(), [[1.5, 2.0], [3.0, 4.0]])
    text = repr(n)
    assert "device='neuron:0'" in text and "1.5000" in text
    assert "grad_fn" in repr(n.requires_grad_() * 2)


def test_save_load_tensors_modules_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("neuron")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4, device="neuron")).sum().backward()
    opt.step()
    t = torch.arange(6.0, device="neuron").view(2, 3).t()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "t": t}, path)

    on_cpu = torch.load(path, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu" and torch.equal(on_cpu["t"], t.cpu())
    for k, v in model.state_dict().items():
        assert torch.equal(on_cpu["model"][k], v.cpu())

    on_neuron = torch.load(path, map_location="neuron")
    assert on_neuron["t"].device == torch.device("neuron:0")
    assert torch.equal(on_neuron["t"].cpu(), t.cpu())
    restored = torch.optim.Adam(model.parameters(), lr=0.01)
    restored.load_state_dict(on_neuron["opt"])
    for state in restored.state.values():
        assert state["exp_avg"].device.type == "neuron"

    # without map_location the tensors come back on neuron
    again = torch.load(io.BytesIO(path.read_bytes()))
    assert again["t"].device.type == "neuron" and torch.equal(again["t"].cpu(), t.cpu())


def test_module_to_keeps_tied_parameters_tied():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head}).to("neuron")
    assert model["emb"].weight is model["head"].weight
    assert len(list(model.parameters())) == 1
    with torch.no_grad():
        model["emb"].weight.mul_(0)
    assert model["head"].weight.abs().sum().item() == 0


def test_item_in_a_loop_reads_every_element_and_sees_every_write():
    # .item() per element (for v in t, x[i].item(), all(mask)): each read is of the right element
    # of the buffer the storage holds now.
    x = torch.arange(100, device="neuron")
    assert [x[i].item() for i in range(100)] == list(range(100))
    assert all(torch.arange(1, 50, device="neuron") > 0)
    x.add_(1)                       # a write gives the storage a new buffer: no stale reads
    assert [x[i].item() for i in (5, 6, 7)] == [6, 7, 8]
    x[7] = 100
    assert x[7].item() == 100 and x[8].item() == 9
    y = x.view(10, 10)[:, 3]        # strided views and other dtypes read the right element
    assert [v.item() for v in y] == [10 * i + 4 for i in range(10)]
    h = torch.tensor([1.5, -2.25], dtype=torch.float16, device="neuron")
    assert [h[0].item(), h[1].item(), h[0].item()] == [1.5, -2.25, 1.5]
    b = torch.tensor([True, False, True], device="neuron")
    assert [bool(v) for v in b] == [True, False, True]


def test_copying_elements_of_a_view_to_the_host_reuses_one_reader():
    # TestNNDeviceType.test_upsamplingNearest3d_correctness copies 1331 elements x[0, 0, i, j, k]
    # one by one into a CPU tensor: the host reader compiled one executable per storage offset
    # (~100 ms per element); the offset is a runtime input now.
    from torchneuron.runtime import transfers
    x = torch.arange(6 * 7 * 8, dtype=torch.float32).reshape(6, 7, 8)
    n = x.to("neuron")
    out = torch.zeros(6, 7, 2)
    before = transfers._reader.cache_info().currsize
    for i in range(6):
        for j in range(7):
            out[i, j, 0] = n[i, j, 3]       # a 0-d view at 42 different offsets
            out[i, j, 1] = n[i, j, ::4][1]  # and one reached through a strided view
    assert transfers._reader.cache_info().currsize - before <= 1
    torch.testing.assert_close(out, torch.stack([x[:, :, 3], x[:, :, 4]], dim=-1))


def test_element_reads_share_one_host_copy_of_the_buffer():
    from torchneuron.metrics import metrics
    x = torch.arange(10.0, device="neuron")
    before = metrics.d2h_copies
    assert [x[i].item() for i in range(10)] == [float(i) for i in range(10)]
    assert metrics.d2h_copies - before <= 2     # one device read, then one copy of the buffer


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(6, 5)[:, 1:4], id="non-contiguous view"),
    pytest.param(lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), id="channels_last"),
    pytest.param(lambda: torch.tensor(3.5), id="0-dim"),
    pytest.param(lambda: torch.randn(3, 4, dtype=torch.complex64).conj(), id="conjugate bit"),
    pytest.param(lambda: torch.randn(3, 4).expand(2, 3, 4), id="expanded"),
    pytest.param(lambda: torch.empty(0, 4), id="empty"),
])
def test_upload_keeps_values_layout_rules_and_the_host_tensor_independent(make):
    # A plain upload takes a direct path (one transfer wrapped as the new tensor); every other
    # layout takes PyTorch's composite copy: both must give what CPU's .to() gives.
    c = make()
    torchneuron.metrics.reset()
    n = c.to("neuron")
    assert torchneuron.metrics()["h2d_copies"] == (1 if c.numel() else 0)
    ref = c.to("cpu", copy=True)
    assert n.shape == ref.shape and n.stride() == ref.stride() and n.dtype == ref.dtype
    assert torch.equal(n.cpu().resolve_conj(), ref.resolve_conj())
    if c.numel() and c.is_contiguous() and not c.is_conj():
        c.add_(1)   # a later write to the host tensor stays on the host
        assert torch.equal(n.cpu().resolve_conj(), ref.resolve_conj())


def test_upload_with_a_dtype_or_an_unsupported_dtype():
    c = torch.arange(12).reshape(3, 4)
    assert_same(c.to("neuron", torch.float32), c.float())
    with pytest.raises(TypeError, match="not supported on the neuron device"):
        torch.zeros(3, dtype=torch.float8_e4m3fn).to("neuron")
    with pytest.raises(RuntimeError, match="neuron"):
        c.to("neuron:7")
