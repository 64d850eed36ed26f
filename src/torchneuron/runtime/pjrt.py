"""The PJRT client behind the neuron device: platform choice and JAX set-up."""

from __future__ import annotations

import functools

import jax

from ..config import config

# int64 stays int64 and float64 can be kept when asked: JAX needs x64 mode for both.
jax.config.update("jax_enable_x64", True)

# Which package provides each PJRT platform, for the error a user sees when it is missing.
_PLUGINS = {
    "cpu": "jax[cpu] (bundled with jaxlib)",
    "cuda": "jax[cuda12] (pip install 'jax[cuda12]==0.10.2')",
    "gpu": "jax[cuda12] (pip install 'jax[cuda12]==0.10.2')",
    "tpu": "jax[tpu] (libtpu)",
    "neuron": "the AWS Neuron PJRT plugin (libneuronxla / jax-neuronx)",
}


@functools.cache
def devices() -> tuple:
    """PJRT devices of the configured platform, in index order."""
    platform = config.platform
    try:
        found = jax.devices(platform)
    except RuntimeError as err:
        plugin = _PLUGINS.get(platform, f"a PJRT plugin for {platform!r}")
        raise RuntimeError(
            f"torchneuron: TORCHNEURON_PLATFORM={platform!r} needs {plugin}, which JAX could not "
            f"load ({err}). Install it, or set TORCHNEURON_PLATFORM=cpu."
        ) from err
    return tuple(found)


def device(index: int):
    devs = devices()
    if not 0 <= index < len(devs):
        raise RuntimeError(
            f"torchneuron: invalid device index neuron:{index}; this process has {len(devs)} "
            f"neuron device(s) on PJRT platform {config.platform!r} (valid: 0..{len(devs) - 1})."
        )
    return devs[index]


def platform_version() -> str:
    dev = devices()[0]
    client = getattr(dev, "client", None)
    return getattr(client, "platform_version", "") or ""
