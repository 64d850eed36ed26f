"""fork() and interrupts: a child forked after the runtime started gets CUDA's clear error instead
of hanging, DataLoader fork workers on CPU data keep working, and Ctrl-C leaves the process usable."""

import _thread
import multiprocessing
import subprocess
import sys
import textwrap
import threading

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
    ("allocating", lambda x: torch.ones(3).to("neuron")),
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


def _interrupt_after(seconds):
    timer = threading.Timer(seconds, _thread.interrupt_main)
    timer.start()
    return timer


def test_keyboard_interrupt_during_ops_leaves_the_process_usable():
    x = torch.ones(64, 64, device="neuron")
    (x * 1.0001).relu().cpu()   # lazy imports done: an interrupt inside an import is Python's matter
    timer = _interrupt_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        while True:
            x = (x * 1.0001).relu()
    timer.join()
    assert torch.isfinite(x.cpu()).all()
    assert (torch.ones(3, device="neuron") + 2).cpu().tolist() == [3.0, 3.0, 3.0]


def test_keyboard_interrupt_during_compiles_leaves_the_process_usable():
    torch.arange(1.0, device="neuron").cumsum(0).cpu()
    timer = _interrupt_after(0.5)
    n = 1
    with pytest.raises(KeyboardInterrupt):
        while True:   # every new length compiles a new executable
            n += 1
            torch.arange(float(n), device="neuron").cumsum(0)
    timer.join()
    for m in (n, n + 1000):   # the interrupted shape, and a fresh one
        assert torch.arange(float(m), device="neuron").cumsum(0).cpu()[-1].item() == m * (m - 1) / 2
