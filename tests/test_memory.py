"""Real storages with exact lifetime: allocation statistics follow tensors as they live and die."""

import gc

import pytest
import torch


def test_allocated_rises_and_returns():
    gc.collect()
    before = torch.neuron.memory_allocated()
    x = torch.empty(1000, device="neuron")
    assert torch.neuron.memory_allocated() == before + 4000
    y = x[10:20]  # a view shares the storage: no new bytes
    assert torch.neuron.memory_allocated() == before + 4000
    del x
    assert torch.neuron.memory_allocated() == before + 4000  # the view keeps the storage alive
    del y
    assert torch.neuron.memory_allocated() == before


def test_peak_tracking_and_reset():
    gc.collect()
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    a = torch.ones(256, 256, device="neuron")
    b = a * 2
    peak = torch.neuron.max_memory_allocated()
    assert peak >= base + 2 * 256 * 256 * 4
    del a, b
    assert torch.neuron.max_memory_allocated() == peak
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()


def test_storage_metadata_like_a_real_device():
    x = torch.zeros(3, 5, device="neuron")
    st = x.untyped_storage()
    assert st.nbytes() == 60 and st.device == torch.device("neuron:0")
    assert x.data_ptr() == st.data_ptr()
    assert x[1].data_ptr() == st.data_ptr() + 20


def test_training_loop_does_not_leak():
    model = torch.nn.Linear(32, 32).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32, device="neuron")

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    gc.collect()
    settled = torch.neuron.memory_allocated()
    for _ in range(5):
        step()
    gc.collect()
    assert torch.neuron.memory_allocated() == settled


def test_reading_a_freed_storage_is_a_clear_error():
    import torchneuron.runtime.memory as mem

    x = torch.ones(4, device="neuron")
    rec_addr = x.untyped_storage().data_ptr()
    # The allocator forgets the storage, as if its device memory had been released.
    record = mem.allocator.records.pop(rec_addr)
    try:
        with pytest.raises(RuntimeError, match="freed"):
            (x + 1).cpu()
    finally:
        mem.allocator.records[rec_addr] = record


def test_an_error_raised_while_a_neuron_temporary_dies_keeps_its_type():
    # The failing op's only input is a temporary that dies while its error propagates. Freeing a
    # storage then must not run Python with the exception pending: that used to replace the
    # user's error with "SystemError: error return without exception set".
    import warnings
    x = torch.randn(3, 4, device="neuron")
    before = torch.neuron.memory_allocated()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # JAX's cast warning becomes the error being unwound
        with pytest.raises(RuntimeError, match="aten::_softmax"):
            (-x).softmax(1, dtype=torch.int32)
    gc.collect()
    assert torch.neuron.memory_allocated() == before


def test_large_never_written_storages_get_their_zeros_on_the_device(monkeypatch):
    """torch.empty(...) then a partial or whole write (FSDP2's to_empty() and reset_parameters()):
    the zeros of a large storage are made on its device, nothing of its size is uploaded."""
    from torchneuron.metrics import metrics
    from torchneuron.runtime import memory
    uploads = []
    put = memory.jax_put
    monkeypatch.setattr(memory, "jax_put", lambda a, d: (uploads.append(a.nbytes), put(a, d))[1])
    fills = metrics.extra["device_zero_fills"]
    n = memory.DEVICE_ZEROS_BYTES // 4 + 7          # float32 elements, just over the limit
    x = torch.empty(n, device="neuron")
    x[::3] = 1.5                                    # a partial write: the rest reads as zeros
    want = torch.zeros(n)
    want[::3] = 1.5
    assert torch.equal(x.cpu(), want)
    y = torch.empty(n, device="neuron").uniform_(2.0, 3.0)   # overwritten whole
    assert bool(((y >= 2.0) & (y < 3.0)).all())
    small = torch.empty(1000, device="neuron").fill_(4.0)    # small ones still share host zeros
    assert small.cpu().tolist() == [4.0] * 1000
    assert metrics.extra["device_zero_fills"] - fills == 2
    assert max(uploads, default=0) < memory.DEVICE_ZEROS_BYTES
