"""The PJRT client behind the neuron device: platform choice and JAX set-up."""

from __future__ import annotations

import functools
import os
import sys
import warnings

import jax
import numpy as np
from jax._src import xla_bridge

from ..config import config, guard, observe
from . import fork, startup

# int64 stays int64 and float64 can be kept when asked: JAX needs x64 mode for both.
jax.config.update("jax_enable_x64", True)

_async_dispatch_applied = None


def _apply_async_dispatch(value: bool) -> None:
    """Follow ``config.cpu_async_dispatch``: XLA's CPU client reads the switch when it starts, so a
    change after that takes effect only in a new process (said once, as a warning)."""
    global _async_dispatch_applied
    value = bool(value)
    if value == _async_dispatch_applied:
        return
    if _async_dispatch_applied is not None and xla_bridge.backends_are_initialized():
        warnings.warn(
            "torchneuron: config.cpu_async_dispatch changed after the CPU client started; it takes "
            "effect in a new process (set TORCHNEURON_CPU_ASYNC_DISPATCH before starting it)", stacklevel=3)
        return
    if _async_dispatch_applied is None and "cpu" in getattr(xla_bridge, "_backends", {}):
        # JAX started its CPU client before torchneuron was imported: the client keeps the switch
        # it started with, and setting it now would only make JAX's config misreport it.
        started = bool(jax.config.values.get("jax_cpu_enable_async_dispatch", True))
        _async_dispatch_applied = started
        if started != value:
            warnings.warn(
                f"torchneuron: config.cpu_async_dispatch={value} has no effect: JAX's CPU client was "
                f"started before torchneuron was imported and runs with async dispatch {started}. "
                "Import torchneuron (or set TORCHNEURON_CPU_ASYNC_DISPATCH) before any code that runs "
                "JAX computations, or call jax.config.update('jax_cpu_enable_async_dispatch', "
                f"{value}) before JAX's first computation.", stacklevel=3)
        return
    # Inline execution: on the CPU platform every eager op is a small computation, and handing it to
    # XLA's thread pool costs more CPU time than running it (measured in docs/performance.md).
    jax.config.update("jax_cpu_enable_async_dispatch", value)
    _async_dispatch_applied = value


observe("cpu_async_dispatch", _apply_async_dispatch)

# XLA's CPU client sizes its intra-op (Eigen) thread pool from NPROC when it starts, else one thread
# per core it may use. "auto" keeps that choice: a pool one core smaller made eager steps on 2 cores
# up to ~10% faster but the compiled GPT train step 0.74x as fast (docs/performance.md).
_NPROC = "NPROC"
_pool_started_with = None   # the setting the CPU client started with; _BEFORE_US: started by JAX first
_BEFORE_US = object()
_pool_warned = False


def intra_op_threads(setting) -> int | None:
    """Threads for XLA's CPU intra-op pool under ``setting`` (``config.cpu_intra_op_threads``);
    None leaves the choice to XLA (one per core, or the NPROC the user set)."""
    return None if setting == "auto" else setting


def describe_intra_op_pool() -> str:
    """The CPU intra-op pool size under the current setting, in words (benchmarks print it)."""
    setting = config.cpu_intra_op_threads
    threads = intra_op_threads(setting)
    if threads is not None:
        return str(threads)
    nproc = os.environ.get(_NPROC, "").strip()
    return f"NPROC={nproc} (set by the user)" if nproc else "XLA's choice (auto: one per core)"


def _start_cpu_client(factory):
    """``factory`` with NPROC set to the configured pool size while it runs, and restored (or removed)
    right after, so processes the program starts later see the user's environment."""
    @functools.wraps(factory)
    def start(*args, **kwargs):
        global _pool_started_with
        setting = config.cpu_intra_op_threads
        threads = intra_op_threads(setting)
        before = os.environ.get(_NPROC)
        if threads is not None:
            os.environ[_NPROC] = str(threads)
        try:
            client = factory(*args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(_NPROC, None)
            else:
                os.environ[_NPROC] = before
        _pool_started_with = setting
        return client
    return start


def _intra_op_threads_changed(value) -> None:
    """A setting the CPU client can no longer follow (it started already) is one warning."""
    global _pool_warned
    if _pool_warned or _pool_started_with is None or value == _pool_started_with:
        return
    if _pool_started_with is _BEFORE_US:
        if value == "auto":
            return
        why = (f"JAX created its CPU client before torchneuron was imported; import torch before using "
               f"JAX, or set NPROC={value} before the process starts")
    else:
        why = ("the CPU client started already (at the first neuron operation); set "
               "TORCHNEURON_CPU_INTRA_OP_THREADS before it starts, e.g. in a new process")
    _pool_warned = True
    warnings.warn(f"torchneuron: config.cpu_intra_op_threads={value!r} has no effect in this process: {why}",
                  stacklevel=3)


_cpu_registration = xla_bridge._backend_factories.get("cpu")
if _cpu_registration is not None:   # a jax without the CPU factory keeps XLA's own pool size
    _cpu_registration.factory = _start_cpu_client(_cpu_registration.factory)
if "cpu" in xla_bridge._backends:   # the program used JAX before torchneuron: its pool stays
    _pool_started_with = _BEFORE_US
observe("cpu_intra_op_threads", _intra_op_threads_changed)

# Which package provides each PJRT platform, for the error a user sees when it is missing.
_PLUGINS = {
    "cpu": "jax[cpu] (bundled with jaxlib)",
    "cuda": "jax[cuda12] or jax[cuda13] (pip install 'jax[cuda12]==0.10.2')",
    "gpu": "jax[cuda12] or jax[cuda13] (pip install 'jax[cuda12]==0.10.2')",
    "tpu": "jax[tpu] (libtpu)",
    "neuron": "the AWS Neuron PJRT plugin (libneuronxla / jax-neuronx)",
}


_started_on = None   # the platform the runtime runs on, once it started
_start_hooks: list = []   # called with the platform once the device started


def on_start(hook) -> None:
    """Call ``hook(platform)`` when the device starts (at once if it has started)."""
    _start_hooks.append(hook)
    if _started_on is not None:
        hook(_started_on)


@functools.cache
def devices() -> tuple:
    """PJRT devices of the configured platform, in index order. The first call starts the device:
    the platform and the client's settings are read then (``startup.prepare``), not at import."""
    global _started_on
    with startup.prepare() as platform:
        try:
            found = jax.devices(platform)
        except RuntimeError as err:
            plugin = _PLUGINS.get(platform, f"a PJRT plugin for {platform!r}")
            raise RuntimeError(
                f"torchneuron: TORCHNEURON_PLATFORM={platform!r} needs {plugin}, which JAX could not "
                f"load ({err}). Install it, or set TORCHNEURON_PLATFORM=cpu."
            ) from err
    _started_on = platform
    for hook in _start_hooks:
        hook(platform)
    return tuple(found)


def _refuse_platform_change(old: str, new: str) -> None:
    # Tensors, executables and caches of this process live on the first platform's devices.
    if _started_on is not None:
        raise RuntimeError(
            f"torchneuron: config.platform cannot change to {new!r}: the neuron runtime of this process "
            f"already runs on {_started_on!r} (its tensors and compiled executables live there). Set "
            f"TORCHNEURON_PLATFORM={new} before the first neuron operation, e.g. in a new process.")


guard("platform", _refuse_platform_change)


def device_count() -> int:
    """How many devices the configured platform has (0 when it cannot start)."""
    try:
        return len(devices())
    except RuntimeError:
        return 0


def device(index: int):
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"torchneuron: invalid device index neuron:{index}; this process has {len(devs)} "
            f"neuron device(s) on PJRT platform {config.platform!r} (valid: 0..{len(devs) - 1})."
        )
    return devs[index]


def memory_stats(index: int) -> dict:
    """PJRT's own memory statistics of a device (its allocator's ``bytes_in_use``, ``bytes_limit``,
    ``pool_bytes``...: GPU, TPU, Neuron), or {} where the platform keeps none (the CPU)."""
    try:
        return dict(device(index).memory_stats() or {})
    except Exception:  # noqa: BLE001 - platforms without memory statistics
        return {}


@functools.cache
def total_memory(index: int) -> int:
    """Bytes of memory of a device: what PJRT reports, else the host's (the CPU platform)."""
    total = int(memory_stats(index).get("bytes_limit", 0))
    return total or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def platform_version() -> str:
    dev = devices()[0]
    client = getattr(dev, "client", None)
    return getattr(client, "platform_version", "") or ""


try:   # jax.device_put spends ~100 us in Python per call; its core takes ~15 us (jax is pinned)
    from jax._src import core as _jax_core
    from jax._src.interpreters import pxla as _pxla
except ImportError:   # pragma: no cover - a jax without these internals takes the public path
    _pxla = None


@functools.lru_cache(maxsize=1024)
def _put_spec(shape: tuple, dtype: np.dtype, weak: bool, device_index: int):
    dev = device(device_index)
    return _jax_core.ShapedArray(shape, dtype, weak_type=weak), jax.sharding.SingleDeviceSharding(dev), dev


def put(host: np.ndarray, device_index: int, *, weak: bool = False, committed: bool = True):
    """``host`` as a device array, through the core of ``jax.device_put``.

    PJRT may adopt ``host``'s memory instead of copying it (the CPU platform does, for aligned
    buffers), so nobody may write ``host`` afterwards. ``weak`` makes a weakly typed array (what
    JAX makes of a Python scalar); ``committed=False`` leaves it free to join computations on any
    device, as ``jnp.asarray`` does.
    """
    if _pxla is not None:
        try:
            aval, sharding, dev = _put_spec(host.shape, host.dtype, weak, device_index)
            return _pxla.batched_device_put(aval, sharding, [host], [dev], committed=committed)
        except (AttributeError, TypeError):   # internals changed: the public path still works
            pass
    if weak:
        return jax.numpy.asarray(host.item())
    return jax.device_put(host, device(device_index) if committed else None, may_alias=True)


fork.forbid(sys.modules[__name__], "put", "copying to a neuron device")
