"""What the PJRT client must be told before it starts: which platforms JAX initialises, which devices
this process sees, and how the GPU allocator reserves memory.

JAX reads all of it once, when its first backend starts: ``jax_platforms`` (else it starts every
plugin it finds, and on a CUDA machine a CPU run would still reserve 75% of every GPU), the
``jax_<gpu>_visible_devices`` options, and the ``XLA_PYTHON_CLIENT_*`` variables that the CUDA
plugin turns into allocator options. ``prepare`` applies them right before the device starts.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import jax
from jax._src import xla_bridge

from ..config import config, read_start_settings
from . import host_memory

# Platforms whose PJRT client can be restricted to some devices, and how: a JAX option, or a
# variable the plugin's runtime reads.
_VISIBILITY_OPTIONS = {"cuda": "jax_cuda_visible_devices", "gpu": "jax_cuda_visible_devices",
                       "rocm": "jax_rocm_visible_devices"}
_VISIBILITY_VARIABLES = {"neuron": "NEURON_RT_VISIBLE_CORES"}
# Variables by which a user (or a launcher) has already restricted a platform's devices.
_USER_RESTRICTIONS = {"cuda": ("CUDA_VISIBLE_DEVICES",), "gpu": ("CUDA_VISIBLE_DEVICES",),
                      "rocm": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
                      "neuron": ("NEURON_RT_VISIBLE_CORES",)}
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEMORY_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# jaxlib refuses both fraction variables at once: the newer name, when the user set it, takes ours.
_MEMORY_FRACTION_NEWER = "XLA_CLIENT_MEM_FRACTION"


def jax_platforms(platform: str) -> str:
    """The ``jax_platforms`` value for ``platform``: it first (JAX's default device, where uncommitted
    arrays land), then cpu, which host-side custom kernels run on."""
    # "gpu" is JAX's alias for cuda, rocm and oneapi, and a listed platform that fails is fatal.
    first = "cuda" if platform == "gpu" else platform
    return first if first == "cpu" else f"{first},cpu"


def visible_device(setting: str, platform: str, environ=os.environ) -> int | None:
    """The one device index this process should see under ``config.visible_device``, or None (all)."""
    if setting == "all":
        return None
    if setting.isdigit():
        index = int(setting)
    else:
        rank = environ.get("LOCAL_RANK")
        if setting == "auto":
            restricted = any(environ.get(v) for v in _USER_RESTRICTIONS.get(platform, ()))
            if rank is None or restricted or platform not in (*_VISIBILITY_OPTIONS, *_VISIBILITY_VARIABLES):
                return None
        elif rank is None:
            raise RuntimeError(
                "torchneuron: config.visible_device='local_rank' (TORCHNEURON_VISIBLE_DEVICE) needs the "
                "LOCAL_RANK variable, which torchrun sets; run under torchrun, or set "
                "TORCHNEURON_VISIBLE_DEVICE=all or a device index")
        try:
            index = int(rank)
        except ValueError:
            raise RuntimeError(f"torchneuron: LOCAL_RANK={rank!r} is not a device index "
                               f"(config.visible_device={setting!r})") from None
    if platform not in _VISIBILITY_OPTIONS and platform not in _VISIBILITY_VARIABLES:
        raise RuntimeError(
            f"torchneuron: config.visible_device={setting!r} (TORCHNEURON_VISIBLE_DEVICE) cannot restrict "
            f"the devices of PJRT platform {platform!r}; set TORCHNEURON_VISIBLE_DEVICE=all and choose "
            f"the device with torch.device('neuron', index)")
    return index


def allocator_environment(preallocate, fraction, environ=os.environ) -> dict[str, str]:
    """The ``XLA_PYTHON_CLIENT_*`` variables the GPU settings ask for ("auto": none)."""
    found = {}
    if preallocate != "auto":
        found[PREALLOCATE] = "true" if preallocate else "false"
    if fraction != "auto":
        name = _MEMORY_FRACTION_NEWER if environ.get(_MEMORY_FRACTION_NEWER) else MEMORY_FRACTION
        found[name] = repr(float(fraction))
    return found


def _option_exists(name: str) -> bool:
    return name in getattr(jax.config, "values", {})


@contextlib.contextmanager
def prepare():
    """Around the device's start: reads the start settings, tells JAX what to initialise, and yields
    the platform. On failure JAX's options are restored, so the program can still use JAX."""
    read_start_settings()
    platform = config.platform
    host_memory.follow(platform == "cpu" and config.cpu_retain_freed_memory)
    if xla_bridge.backends_are_initialized():
        # The program used JAX first: its backends, devices and allocator are already set.
        if config.gpu_preallocate != "auto" or config.gpu_memory_fraction != "auto":
            warnings.warn(
                "torchneuron: config.gpu_preallocate / gpu_memory_fraction have no effect in this process: "
                "JAX started its backends before the neuron device; set them (TORCHNEURON_GPU_*) before "
                "the program first uses JAX", stacklevel=4)
        yield platform
        return
    options, variables = {}, allocator_environment(config.gpu_preallocate, config.gpu_memory_fraction)
    if not jax.config.jax_platforms:   # the user's JAX_PLATFORMS, when set, is theirs to keep
        options["jax_platforms"] = jax_platforms(platform)
    index = visible_device(config.visible_device, platform)
    if index is not None:
        option = _VISIBILITY_OPTIONS.get(platform)
        if option is not None and _option_exists(option):
            options[option] = str(index)
        elif platform in _VISIBILITY_VARIABLES:
            variables[_VISIBILITY_VARIABLES[platform]] = str(index)
        else:
            raise RuntimeError(
                f"torchneuron: this JAX ({jax.__version__}) has no option {option!r} to restrict the "
                f"{platform} devices (config.visible_device={config.visible_device!r}); set "
                "TORCHNEURON_VISIBLE_DEVICE=all and restrict them with CUDA_VISIBLE_DEVICES")
    before_options = {name: jax.config.values[name] for name in options}
    before_variables = {name: os.environ.get(name) for name in variables}
    for name, value in options.items():
        jax.config.update(name, value)
    os.environ.update(variables)
    ok = False
    try:
        yield platform
        ok = True
    finally:
        # The plugin read the variables as it started: children of this process see the user's own.
        for name, value in before_variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not ok:
            for name, value in before_options.items():
                jax.config.update(name, value)


# At import, before the threads that would get heaps of their own (see runtime/host_memory.py);
# ``prepare`` applies the setting again as the device starts.
host_memory.follow(config.platform == "cpu" and config.cpu_retain_freed_memory)
