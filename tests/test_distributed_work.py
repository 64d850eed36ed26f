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


def test_the_transport_follows_the_setting_and_the_platform(monkeypatch):
    from torchneuron.distributed import staging
    assert staging.transport("auto", "cpu")[1] == "gloo"
    assert isinstance(staging.transport("auto", "cpu")[0], staging.HostStaging)
    assert not isinstance(staging.transport("auto", "cpu")[0], staging.SharedStaging)
    shared, engine = staging.transport("shared", "cpu")
    assert isinstance(shared, staging.SharedStaging) and engine == "gloo" and not shared.cuda
    # CUDA platform without torch CUDA (a CPU torch on a GPU machine): host staging over gloo.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert staging.transport("auto", "cuda")[1] == "gloo"
    # With torch CUDA and NCCL, "auto" shares the buffers and runs NCCL; without NCCL "shared" says why.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    stage, engine = staging.transport("auto", "cuda")
    assert isinstance(stage, staging.SharedStaging) and stage.cuda and engine == "nccl"
    assert staging.transport("host", "cuda")[1] == "gloo"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    with pytest.raises(RuntimeError, match="TORCHNEURON_COLLECTIVES=host"):
        staging.transport("shared", "cuda")


def test_shared_staging_copies_views_and_adopts_results_without_host_copies():
    import torchneuron
    from torchneuron.distributed import staging
    stage = staging.SharedStaging(cuda=False)
    base = torch.arange(24.0).reshape(4, 6)
    x = base.to("neuron")
    before = torchneuron.metrics()
    engine = stage.to_engine(x[1:3, ::2])           # a strided view: its values, in a private tensor
    torch.testing.assert_close(engine, base[1:3, ::2])
    engine.mul_(10)                                 # the engine may write its copy
    untouched = x.clone()                           # (a device-side copy: no host copy to count)
    stage.to_device(x[1:3, ::2], engine)            # results land in the view only
    after = torchneuron.metrics()
    torch.testing.assert_close(untouched.cpu(), base)   # the engine's write did not reach the buffer
    expected = base.clone()
    expected[1:3, ::2] *= 10
    torch.testing.assert_close(x.cpu(), expected)
    assert after["d2h_copies"] == before["d2h_copies"] and after["h2d_copies"] == before["h2d_copies"]
    whole = torch.ones(5, device="neuron")
    stage.to_device(whole, torch.full((5,), 3.0))   # the whole storage: the result becomes its buffer
    torch.testing.assert_close(whole.cpu(), torch.full((5,), 3.0))
    assert stage.to_engine(torch.empty(0, device="neuron")).shape == (0,)
