"""Settings and on-disk caches: unusable folders are a warning (the caches are optional), invalid
values name their setting and variable whether they come from the environment or an assignment,
and the platform cannot silently change under a running runtime."""

import warnings

import pytest
import torch

import torchneuron
from torchneuron.config import Config


@pytest.fixture
def blocker(tmp_path):
    """A regular file: any folder below it can never be created."""
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def _compile_and_run(scale):
    f = torch.compile(lambda x: x * scale + 1, backend="neuron")
    x = torch.arange(4.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x.to("neuron")).cpu()
    torch.testing.assert_close(out, x * scale + 1)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("setting, variable, scale", [("cache_dir", "TORCHNEURON_CACHE_DIR", 3.0),
                                                      ("dump_dir", "TORCHNEURON_DUMP_DIR", 7.0)])
def test_unusable_cache_or_dump_folder_warns_and_compiles(blocker, setting, variable, scale):
    old = getattr(torchneuron.config, setting)
    setattr(torchneuron.config, setting, str(blocker / "sub"))
    try:
        torch._dynamo.reset()
        messages = _compile_and_run(scale)   # a graph this process has not compiled yet
        assert any(f"{blocker / 'sub'}' cannot be used" in m and variable in m for m in messages), messages
        torch._dynamo.reset()
        # Warned once per folder, not at every compile.
        assert not any("cannot be used" in m for m in _compile_and_run(scale + 2))
    finally:
        setattr(torchneuron.config, setting, old)
        torch._dynamo.reset()


def test_invalid_environment_values_name_the_variable():
    with pytest.raises(ValueError, match=r"TORCHNEURON_ADAPTIVE_MAX_OPS='abc' is not an integer"):
        Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": "abc"})
    with pytest.raises(ValueError, match=r"TORCHNEURON_ADAPTIVE_MAX_OPS.*at least 1"):
        Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": "0"})
    with pytest.raises(ValueError, match=r"TORCHNEURON_FLOAT64.*one of"):
        Config.from_env({"TORCHNEURON_FLOAT64": "double"})
    cfg = Config.from_env({"TORCHNEURON_ADAPTIVE_MAX_OPS": " 64 ", "TORCHNEURON_FALLBACK": " Error",
                           "TORCHNEURON_PLATFORM": "CPU"})
    assert (cfg.adaptive_max_ops, cfg.fallback, cfg.platform) == (64, "error", "cpu")


@pytest.mark.parametrize("name, value, error, message", [
    ("adaptive_max_ops", "abc", TypeError, "must be an integer"),
    ("adaptive_max_ops", 0, ValueError, "must be at least 1"),
    ("adaptive_max_ops", True, TypeError, "must be an integer"),
    ("cache_dir", 5, TypeError, "must be a string"),
    ("dump_dir", None, TypeError, "must be a string"),
    ("float64", "double", ValueError, "must be one of"),
    ("platform", "", ValueError, "must name a PJRT platform"),
    ("fallbak", "error", AttributeError, "did you mean 'fallback'"),
], ids=["int-text", "int-zero", "int-bool", "str-int", "str-none", "choice", "platform", "typo"])
def test_run_time_assignments_are_validated(name, value, error, message):
    before = dict(vars(torchneuron.config))
    with pytest.raises(error, match=message):
        setattr(torchneuron.config, name, value)
    assert dict(vars(torchneuron.config)) == before
    if name in before:
        assert f"TORCHNEURON_{name.upper()}" in str(_raised(name, value))


def _raised(name, value):
    try:
        setattr(torchneuron.config, name, value)
    except Exception as err:   # noqa: BLE001
        return err


def test_assignments_are_normalised_like_the_environment(monkeypatch):
    monkeypatch.setattr(torchneuron.config, "fallback", " Silent ")
    assert torchneuron.config.fallback == "silent"


def test_platform_cannot_change_under_a_running_runtime():
    (torch.ones(2, device="neuron") + 1).cpu()
    current = torchneuron.config.platform
    with pytest.raises(RuntimeError, match=r"cannot change to 'tpu'.*already runs on 'cpu'.*TORCHNEURON_PLATFORM=tpu"):
        torchneuron.config.platform = "tpu"
    assert torchneuron.config.platform == current
    assert "platform" not in torchneuron.config.non_defaults()
    torchneuron.config.platform = current.upper()   # the same platform: accepted
    assert (torch.ones(2, device="neuron") * 3).cpu().tolist() == [3.0, 3.0]
