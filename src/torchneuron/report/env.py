"""The version manifest stamped on every report: enough to answer "what produced this" later."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

# Environment variables that change what runs or how it is compiled.
_ENV_PREFIXES = ("TORCHNEURON_", "XLA_", "JAX_", "PJRT_", "NEURON_", "TORCH_", "PYTORCH_", "OMP_NUM_THREADS", "NPROC",
                 "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_revision(path: str) -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        rev = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return {"revision": rev, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"revision": None, "dirty": None}


def _container() -> str | None:
    for var in ("CONTAINER_IMAGE", "IMAGE_NAME", "DOCKER_IMAGE"):
        if os.environ.get(var):
            return os.environ[var]
    if os.path.exists("/.dockerenv"):
        return "docker (image name not exposed)"
    return None


def manifest() -> dict:
    """Versions and settings of this process (imports torch and jax)."""
    # Only here: analysis imports this module (KEY_FIELDS) and must not load torch, jax or the runtime.
    import jax
    import jaxlib
    import numpy
    import torch

    import torchneuron
    from torchneuron.config import config

    info = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "container": _container(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": numpy.__version__,
        "torchneuron": torchneuron.__version__,
        "torchneuron_path": os.path.dirname(os.path.abspath(torchneuron.__file__)),
        "settings": {k: _jsonable(v) for k, v in config.non_defaults().items()},
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }
    info.update({"torchneuron_" + k: v for k, v in _git_revision(info["torchneuron_path"]).items()})
    try:
        from torchneuron.runtime import pjrt  # see the top of manifest()
        devs = pjrt.devices()
        info["pjrt_platform"] = devs[0].platform if devs else config.platform
        info["pjrt_version"] = pjrt.platform_version()
        info["device_kind"] = devs[0].device_kind if devs else None
        info["device_count"] = len(devs)
    except RuntimeError as err:
        info["pjrt_platform"] = config.platform
        info["pjrt_error"] = str(err)
        info["device_count"] = 0
    return info


def _jsonable(v):
    return v if isinstance(v, str | int | float | bool | type(None)) else repr(v)


# The fields a reader compares first when two reports disagree.
KEY_FIELDS = ("torchneuron", "torchneuron_revision", "torch", "jax", "jaxlib", "pjrt_platform", "pjrt_version",
              "device_kind", "device_count", "python", "os", "cpu", "container")
