"""Impossible sizes are errors, as on CPU, never an aborted interpreter; the storage-handle space
and the memory counters stay consistent whatever happens."""

import gc
import re
import sys
import threading

import pytest
import torch

from torchneuron.runtime import memory


def _cpu_error(fn):
    with pytest.raises(RuntimeError) as err:
        fn("cpu")
    return str(err.value)


@pytest.mark.parametrize("fn", [
    lambda d: torch.empty(2**31, 2**31, device=d),
    lambda d: torch.zeros(2**61, device=d),
    lambda d: torch.empty(2**62, 2, dtype=torch.uint8, device=d),
    lambda d: torch.empty_strided((2, 3), (-1, 1), device=d),
    lambda d: torch.empty_strided((2, 3), (0, -1), device=d),
    lambda d: torch.empty(2, device=d).new_empty((2**62, 4)),
    lambda d: torch.empty(2, device=d).new_empty_strided((2, 3), (-1, 1)),
    lambda d: torch.empty(2, device=d).resize_(2**61),
], ids=["empty-2d", "zeros", "uint8", "negative-stride", "negative-stride-2", "new_empty",
        "new_empty_strided", "resize_"])
def test_overflowing_sizes_raise_like_cpu(fn):
    expected = _cpu_error(fn)
    head = re.escape(expected.split(" and strides")[0])
    with pytest.raises(RuntimeError, match=head):
        fn("neuron")
    # The device is still usable afterwards.
    assert (torch.ones(3, device="neuron") + 1).cpu().tolist() == [2.0, 2.0, 2.0]


def test_stride_overflow_and_negative_dimension_like_cpu():
    for fn in (lambda d: torch.empty(0, 2**62, 2**62, device=d),
               lambda d: torch.empty_strided((-1, 2), (2, 1), device=d)):
        expected = _cpu_error(fn)
        with pytest.raises(RuntimeError, match=re.escape(expected)):
            fn("neuron")


def test_a_negative_stride_over_one_element_is_accepted_like_cpu():
    cpu = torch.empty_strided((1, 3), (-1, 1))
    t = torch.empty_strided((1, 3), (-1, 1), device="neuron")
    assert t.stride() == cpu.stride() and t.untyped_storage().nbytes() == cpu.untyped_storage().nbytes()


def test_larger_than_the_device_is_out_of_memory_like_cuda():
    with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate .* on neuron:0"):
        torch.empty(2**50, dtype=torch.uint8, device="neuron")
    with pytest.raises(torch.OutOfMemoryError):
        torch.zeros(2**40, device="neuron")
    assert (torch.ones(2, device="neuron") * 3).cpu().tolist() == [3.0, 3.0]


def test_handle_space_is_reused_once_used_up():
    a = memory.allocator
    keep = [torch.full((10,), float(i), device="neuron") for i in range(3)]
    saved = a._next, a._end
    try:
        # The cursor at the very end of the space: the next handles come from freed gaps.
        a._next = a._end = (1 << 64) - 64
        fresh = [torch.full((100,), float(i), device="neuron") for i in range(20)]
        ranges = sorted((t.data_ptr(), t.untyped_storage().nbytes()) for t in fresh + keep)
        for (p0, n0), (p1, _) in zip(ranges, ranges[1:]):
            assert p0 + n0 < p1, "a storage's range must end before the next handle (data_ptr() invariant)"
        assert all(p + n <= (1 << 63) for p, n in ranges)
        assert [float(t[0]) for t in fresh] == [float(i) for i in range(20)]
        assert [float(t[0]) for t in keep] == [0.0, 1.0, 2.0]
    finally:
        if a._next < saved[0]:
            a._next, a._end = saved


def test_free_updates_counters_under_the_allocator_lock():
    a = memory.allocator
    x = torch.empty(1000, device="neuron")
    gc.collect()
    before = torch.neuron.memory_allocated()
    box = [x]
    del x
    freer = threading.Thread(target=box.clear)
    with a._lock:   # an allocation in progress elsewhere
        freer.start()
        freer.join(0.5)
        assert a.allocated[0] == before, "a free changed the counters mid-allocation"
    freer.join()
    assert torch.neuron.memory_allocated() == before - 4000


def test_threads_allocating_and_freeing_keep_exact_counters():
    x0 = torch.ones(7, device="neuron")
    gc.collect()
    before = torch.neuron.memory_allocated()
    frees = memory.allocator.num_frees

    def work():
        for _ in range(150):
            y = x0 + 1
            z = torch.empty(5, device="neuron")
            del y, z

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    gc.collect()
    assert torch.neuron.memory_allocated() == before
    assert memory.allocator.num_frees - frees >= 4 * 150 * 2


@pytest.mark.parametrize("size", [(2**62, 4), (2**31, 2**31, 4)])
def test_resize_beyond_int64_elements_raises_like_cpu(size):
    expected = _cpu_error(lambda d: torch.empty(2, device=d).resize_(*size))
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        torch.empty(2, device="neuron").resize_(*size)
