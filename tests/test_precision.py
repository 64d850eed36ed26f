"""PyTorch's float32 precision settings reach XLA: matmuls follow torch.set_float32_matmul_precision
(and the fp32_precision API), convolutions torch.backends.cudnn.allow_tf32; each setting is part
of the cache keys, so changing it compiles anew. XLA:CPU computes float32 under every setting, so
values stay CPU's here; the traced programs show the precision asked for."""

import contextlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
import torch

import torchneuron
from torchneuron.ops import precision
from torchneuron.ops.registry import LOWERINGS


@pytest.fixture
def matmul_setting():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def conv_tf32():
    # Through cudnn.flags(): PyTorch's own test utilities (the upstream files) forbid setting the
    # cudnn flags directly once imported (disable_global_flags), and restore them on exit.
    cudnn = torch.backends.cudnn
    with contextlib.ExitStack() as stack:
        def set_(on):
            stack.enter_context(cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                                            deterministic=cudnn.deterministic, allow_tf32=on))
        yield set_


def _stablehlo(name, *args):
    fn = LOWERINGS[name].fn
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text()   # a new function: a new trace


def _precisions(text) -> set:
    """The operand precisions of every dot and convolution in a StableHLO text."""
    found = set()
    for config in re.findall(r"precision(?:_config)? = \[([^\]]*)\]", text):
        found.update(re.findall(r"\b(DEFAULT|HIGHEST|HIGH)\b", config))
    return found


def test_matmul_lowerings_are_traced_with_the_matmul_setting(matmul_setting):
    a = jnp.ones((4, 4), jnp.float32)
    assert _precisions(_stablehlo("mm.default", a, a)) == {"HIGHEST"}   # PyTorch's default: float32
    matmul_setting("high")
    assert precision.matmul_precision() is jax.lax.Precision.HIGH
    assert _precisions(_stablehlo("mm.default", a, a)) == {"HIGH"}
    assert _precisions(_stablehlo("addmm.default", a, a, a)) == {"HIGH"}
    matmul_setting("medium")
    assert _precisions(_stablehlo("bmm.default", a[None], a[None])) == {"DEFAULT"}


def test_convolutions_follow_cudnn_allow_tf32(conv_tf32):
    x, w = jnp.ones((1, 2, 5, 5), jnp.float32), jnp.ones((3, 2, 3, 3), jnp.float32)

    def conv(x, w):
        return LOWERINGS["convolution.default"].fn(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    conv_tf32(True)    # PyTorch's default: TF32 convolutions where the platform has them
    assert _precisions(jax.jit(lambda *a: conv(*a)).lower(x, w).as_text()) == {"HIGH"}
    conv_tf32(False)
    assert _precisions(jax.jit(lambda *a: conv(*a)).lower(x, w).as_text()) == {"HIGHEST"}


def test_recurrent_networks_follow_cudnns_setting_and_recompile_when_it_changes(conv_tf32, monkeypatch):
    from torchneuron.ops.rnn import rnn_fused
    x = jnp.ones((5, 2, 3), jnp.float32)
    hx = [jnp.zeros((1, 2, 4), jnp.float32)] * 2
    params = [jnp.ones((16, 3), jnp.float32), jnp.ones((16, 4), jnp.float32)]

    def lowered_precisions():
        return _precisions(jax.jit(lambda x, hx, p: rnn_fused("lstm", x, hx, p, False, 1, 0.0, False, False, False,
                                                             key=jax.random.key(0))).lower(x, hx, params).as_text())
    conv_tf32(True)    # PyTorch's default: cuDNN's RNNs use TF32 where the platform has it
    assert lowered_precisions() == {"HIGH"}
    conv_tf32(False)
    assert lowered_precisions() == {"HIGHEST"}
    # Eager nn.LSTM: the setting is in its kernels' keys; values stay CPU's (XLA:CPU has no TF32).
    monkeypatch.setattr(torchneuron.config, "cache_dir", "")
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 4)
    inp = torch.randn(6, 2, 3)
    want = lstm(inp)[0]
    dev = torch.nn.LSTM(3, 4).to("neuron")
    dev.load_state_dict(lstm.state_dict())
    torch.testing.assert_close(dev(inp.to("neuron"))[0].detach().cpu(), want.detach())
    torchneuron.metrics.reset()
    conv_tf32(True)
    torch.testing.assert_close(dev(inp.to("neuron"))[0].detach().cpu(), want.detach())
    assert torchneuron.metrics()["eager_compiles"].get("new float32 precision setting", 0) >= 1


def test_factorizations_stay_float32_under_the_fast_matmul_setting(matmul_setting):
    matmul_setting("medium")
    a = jnp.eye(4, dtype=jnp.float32) * 2
    fn = LOWERINGS["linalg_cholesky_ex.default"].fn
    assert _precisions(jax.jit(lambda a: fn(a)).lower(a).as_text()) == {"HIGHEST"}


def test_eager_compiles_once_per_setting_and_matches_cpu(matmul_setting, monkeypatch):
    monkeypatch.setattr(torchneuron.config, "cache_dir", "")
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    na, nb = a.to("neuron"), b.to("neuron")
    torch.testing.assert_close((na @ nb).cpu(), a @ b)
    torchneuron.metrics.reset()
    torch.testing.assert_close((na @ nb).cpu(), a @ b)
    assert torchneuron.metrics()["executables_compiled"] == 0
    matmul_setting("high")
    torch.testing.assert_close((na @ nb).cpu(), a @ b)   # XLA:CPU has no TF32: the same values
    assert torchneuron.metrics()["eager_compiles"].get("new float32 precision setting", 0) == 1
    matmul_setting("highest")
    torchneuron.metrics.reset()
    torch.testing.assert_close((na @ nb).cpu(), a @ b)   # the first executable again
    assert torchneuron.metrics()["executables_compiled"] == 0
    torch.sin(na)                                           # ops that read no setting: keys unchanged
    before = torchneuron.metrics()["executables_compiled"]
    matmul_setting("high")
    torch.sin(na)
    assert torchneuron.metrics()["executables_compiled"] == before


def test_a_compiled_graph_recompiles_when_the_conv_setting_changes(conv_tf32, monkeypatch):
    # Dynamo guards on the matmul setting but not on cuDNN's: the graph's own key must.
    monkeypatch.setattr(torchneuron.config, "cache_dir", "")
    torch._dynamo.reset()
    conv = torch.nn.Conv2d(2, 3, 3)
    x = torch.randn(2, 2, 9, 11)
    want = conv(x)
    f = torch.compile(conv.to("neuron"), backend="neuron")
    xn = x.to("neuron")
    conv_tf32(True)
    torch.testing.assert_close(f(xn).detach().cpu(), want.detach())
    torchneuron.metrics.reset()
    conv_tf32(False)
    torch.testing.assert_close(f(xn).detach().cpu(), want.detach())
    assert torchneuron.metrics()["executables_compiled"] >= 1
    torchneuron.metrics.reset()
    conv_tf32(True)
    f(xn)
    assert torchneuron.metrics()["executables_compiled"] == 0   # each setting's graph is kept


def test_the_fp32_precision_api_is_read_too():
    # Setting the newer API makes torch refuse the legacy reading: a process of its own.
    code = textwrap.dedent("""
        import torch, jax
        from torchneuron.ops import precision
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert precision.matmul_precision() is jax.lax.Precision.HIGH, precision.matmul_precision()
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert precision.matmul_precision() is jax.lax.Precision.HIGHEST
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        assert precision.convolution_precision() is jax.lax.Precision.HIGHEST
        torch.backends.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "none"
        torch.backends.cudnn.fp32_precision = "none"
        assert precision.convolution_precision() is jax.lax.Precision.HIGH
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        assert precision.rnn_precision() is jax.lax.Precision.HIGHEST
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
        assert precision.rnn_precision() is jax.lax.Precision.HIGH
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
