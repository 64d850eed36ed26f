"""NeuronWork on its own (no process group): what a dropped work does with its collective's error."""

import gc
import warnings

import pytest
import torch

from torchneuron.distributed import backend


class _GlooWork:
    """A stand-in for the gloo work a collective launches: completes when its future does."""

    def __init__(self):
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut

    def is_completed(self):
        return self.fut.done()

    def wait(self):
        self.fut.wait()


def _work(name="all_reduce"):
    gloo = _GlooWork()

    def complete(err):
        if err is not None:
            raise backend.CollectiveError(f"torchneuron: {name} of [float32[4]] (neuron:0) failed on rank 0 "
                                          f"of 2: {err}")
        return [torch.ones(1)]

    return gloo, backend.NeuronWork([backend._Completion(gloo, complete, name)])


def test_a_dropped_work_whose_collective_fails_later_warns_naming_it():
    gloo, work = _work()
    del work
    gc.collect()
    with pytest.warns(backend.CollectiveWarning, match=r"all_reduce failed, and its Work was dropped.*peer closed"):
        gloo.fut.set_exception(RuntimeError("peer closed the connection"))


def test_a_dropped_work_whose_collective_already_failed_warns():
    gloo, work = _work("broadcast")
    gloo.fut.set_exception(RuntimeError("Timed out"))
    assert work.is_completed()
    work._observed = False          # is_completed() alone does not report the error
    with pytest.warns(backend.CollectiveWarning, match="broadcast failed"):
        del work
        gc.collect()


@pytest.mark.parametrize("look", ["wait", "exception"])
def test_a_work_whose_error_was_seen_does_not_warn(look):
    gloo, work = _work()
    gloo.fut.set_exception(RuntimeError("peer closed"))
    if look == "wait":
        with pytest.raises(backend.CollectiveError):
            work.wait()
    else:
        assert isinstance(work.exception(), backend.CollectiveError)
    with warnings.catch_warnings():
        warnings.simplefilter("error", backend.CollectiveWarning)
        del work
        gc.collect()


def test_a_dropped_work_that_succeeds_still_lands_its_results_and_does_not_warn():
    gloo, work = _work()
    completion = work._completions[0]
    del work
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", backend.CollectiveWarning)
        gloo.fut.set_result(None)
    assert completion.done and completion.error is None and completion.value is not None
