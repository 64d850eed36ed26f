"""fork() and interrupts: a child forked after the runtime started gets CUDA's clear error instead
of hanging, DataLoader fork workers on CPU data keep working, and Ctrl-C leaves the process usable."""

import _thread
import gc
import multiprocessing
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

# JAX warns at every fork of a process whose runtime started: these tests fork on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")

FORK_ERROR = "Cannot re-initialize the neuron device in forked subprocess"


def _in_forked_child(fn):
    """Run ``fn`` in a forked child; return what it reported (its error text or its result)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target():
        try:
            child.send(("ok", fn()))
        except BaseException as err:   # noqa: BLE001 - report whatever the child met
            child.send((type(err).__name__, str(err)))

    proc = ctx.Process(target=target)
    proc.start()
    got = parent.recv() if parent.poll(60) else ("hang", "the child did not answer within 60 s")
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return got


@pytest.fixture
def started():
    """The runtime has started in this process (an op ran and was read back)."""
    x = torch.arange(4.0, device="neuron")
    assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0, 4.0]
    return x


@pytest.mark.parametrize("what, fn", [
    ("aten::add.Tensor", lambda x: x + 1),                          # a cached executable
    ("aten::cumsum", lambda x: torch.cumsum(x.reshape(2, 2), 0)),   # one that needs compiling
    ("reading", lambda x: x.tolist()),
    ("allocating", lambda x: torch.empty(3, device="neuron")),
    ("copying to a neuron device", lambda x: torch.ones(3).to("neuron")),   # one upload, no allocation first
    ("synchronize", lambda x: torch.neuron.synchronize()),
], ids=["cached-op", "new-op", "read", "empty", "upload", "synchronize"])
def test_forked_child_raises_like_cuda_instead_of_hanging(started, what, fn):
    kind, text = _in_forked_child(lambda: fn(started))
    assert kind == "RuntimeError", (kind, text)
    assert FORK_ERROR in text and what in text and "'spawn'" in text
    # The parent is unaffected.
    assert (started * 2).cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_forked_child_reports_its_state_and_keeps_cpu_working(started):
    kind, result = _in_forked_child(lambda: (
        torch.neuron._is_in_bad_fork(), torch.neuron.is_initialized(),
        (torch.ones(3) + 1).tolist(), torch.manual_seed(3).initial_seed()))
    assert kind == "ok", result
    assert result == (True, False, [2.0, 2.0, 2.0], 3)
    assert not torch.neuron._is_in_bad_fork() and torch.neuron.is_initialized()


class _NeuronItems(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((2,), float(i), device="neuron") * 2


class _CpuItems(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((2,), float(i)) + torch.rand(1) * 0


def test_dataloader_fork_worker_using_neuron_raises_in_the_main_process(started):
    loader = torch.utils.data.DataLoader(_NeuronItems(), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork", timeout=60)
    with pytest.raises(RuntimeError, match=FORK_ERROR):
        next(iter(loader))


def test_dataloader_fork_workers_on_cpu_data_work_after_the_runtime_started(started):
    loader = torch.utils.data.DataLoader(_CpuItems(), batch_size=3, num_workers=2,
                                         multiprocessing_context="fork", timeout=60)
    batches = [b.to("neuron") * 10 for b in loader]
    expected = [torch.full((3, 2), 0.0) + torch.arange(3.0).unsqueeze(1) + 3 * k for k in range(2)]
    for got, want in zip(batches, expected):
        torch.testing.assert_close(got.cpu(), want * 10)


def _run(code):
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=300)


def test_fork_before_the_runtime_started_and_a_normal_exit_after_it():
    # A child forked before any device work starts its own runtime; one forked after exits with
    # its own status (tearing the parent's PJRT client down in it used to crash it with SIGSEGV).
    proc = _run("""
        import os, sys, torch
        pid = os.fork()
        if pid == 0:
            print("early child", (torch.ones(2, device="neuron") + 1).cpu().tolist(), flush=True)
            os._exit(0)
        print("early status", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        x = torch.ones(3, device="neuron") + 1
        x.cpu()
        pid = os.fork()
        if pid == 0:
            del x
            sys.exit(3)
        print("late status", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print((x * 2).cpu().tolist())
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "early child [2.0, 2.0]" in out and "early status 0" in out, out
    assert "late status 3" in out and "[4.0, 4.0, 4.0]" in out, out


@pytest.fixture(autouse=True)
def _python_handles_sigint():
    """interrupt_main() does nothing while SIGINT is ignored or left to the OS: a test runner (or an
    earlier test's subprocess machinery) may have set that, so these tests install Python's own
    handler for their duration."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _Interrupter(threading.Thread):
    """Ctrl-C after ``seconds``, and again every ``seconds`` until joined: an interrupt that lands
    inside a Python callback called from JAX's C++ code is dropped there (Python's matter, not the
    backend's state), and the next one must still end the loop and leave the process usable."""

    def __init__(self, seconds):
        super().__init__(daemon=True)
        self.seconds, self.done = seconds, threading.Event()

    def run(self):
        while not self.done.wait(self.seconds):
            _thread.interrupt_main()

    def join(self, timeout=None):
        self.done.set()
        super().join(timeout)


def _interrupt_after(seconds):
    timer = _Interrupter(seconds)
    timer.start()
    return timer


def _until_interrupted(step, limit=120.0):
    """Run ``step`` until a KeyboardInterrupt ends the loop; a lost interrupt fails the test after
    ``limit`` seconds instead of hanging it."""
    deadline = time.monotonic() + limit
    with pytest.raises(KeyboardInterrupt):
        while time.monotonic() < deadline:
            step()
        pytest.fail(f"the interrupt was lost: the loop ran {limit:.0f} s")


def test_keyboard_interrupt_during_ops_leaves_the_process_usable():
    x = torch.ones(64, 64, device="neuron")
    (x * 1.0001).relu().cpu()   # lazy imports done: an interrupt inside an import is Python's matter
    box = [x]

    def step():
        box[0] = (box[0] * 1.0001).relu()

    timer = _interrupt_after(0.3)
    _until_interrupted(step)
    timer.join()
    assert torch.isfinite(box[0].cpu()).all()
    assert (torch.ones(3, device="neuron") + 2).cpu().tolist() == [3.0, 3.0, 3.0]


def test_keyboard_interrupt_during_compiles_leaves_the_process_usable():
    torch.arange(1.0, device="neuron").cumsum(0).cpu()
    n = [1]

    def step():   # every new length compiles a new executable
        n[0] += 1
        torch.arange(float(n[0]), device="neuron").cumsum(0)

    timer = _interrupt_after(0.5)
    _until_interrupted(step)
    timer.join()
    for m in (n[0], n[0] + 1000):   # the interrupted shape, and a fresh one
        assert torch.arange(float(m), device="neuron").cumsum(0).cpu()[-1].item() == m * (m - 1) / 2


class _Marker:
    pass


def test_keyboard_interrupt_while_tensors_are_freed_is_delivered_and_counted():
    # Ctrl-C while storages are being freed (a list of tensors cleared) used to be raised inside
    # the allocator's weakref callback, where Python prints and drops it: the program went on, and
    # the storage being freed stayed in the memory counters.
    gc.collect()
    before = torch.neuron.memory_allocated()
    tensors = [torch.ones(1, device="neuron") for _ in range(20000)]
    marker = _Marker()
    go = threading.Event()
    finalizer = weakref.ref(marker, lambda _: go.set())   # noqa: F841 - fires halfway through clear()
    tensors.insert(len(tensors) // 2, marker)
    del marker
    interrupter = threading.Thread(target=lambda: go.wait(60) and _thread.interrupt_main())
    interrupter.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)   # let the interrupter run while the frees go on
    try:
        with pytest.raises(KeyboardInterrupt):
            tensors.clear()
            for _ in range(200):      # a dropped interrupt ends this loop without raising
                time.sleep(0.01)
    finally:
        sys.setswitchinterval(old)
        interrupter.join()
    gc.collect()
    assert torch.neuron.memory_allocated() == before
    assert (torch.ones(2, device="neuron") + 1).cpu().tolist() == [2.0, 2.0]
