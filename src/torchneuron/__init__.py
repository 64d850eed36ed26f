"""torchneuron: a native PyTorch device backend (``neuron``) compiled through JAX, StableHLO and PJRT.

``import torch`` loads it through the ``torch.backends`` entry point; ``import torchneuron`` works
too and is idempotent.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Only torch-free modules at import time: `import torchneuron` runs `import torch`, which loads this
# package again through its torch.backends entry point. Everything else is imported inside the
# functions below, once torch is whole.
from .config import config
from .metrics import metrics

_registered = False
_autoloaded = False   # registered through the torch.backends entry point: the package is installed


def register() -> None:
    """Make ``neuron`` a PyTorch device (safe to call more than once)."""
    global _registered
    if _registered:
        return
    # Imported here, once torch is whole (see the top of this module).
    import torch
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from . import distributed, integrations, profiler
    from .config import observe
    from .eager import adaptive, registration
    from .runtime import autocast, dynamo_skip, guard, modules, pinned, printing, rng, serialization
    from .runtime import device as device_module

    class _Hooks(torch._C._acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return device_module.is_available()

        def has_primary_context(self, dev_id) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    class _Guard(torch._C._acc.DeviceGuard):
        def type_(self):
            return guard.device_type()   # keeps an error a backward op raised (runtime/guard.py)

    if torch._C._get_privateuse1_backend_name() != "neuron":
        _setup_privateuseone_for_python_backend(
            "neuron", backend_module=device_module, hook=_Hooks(), device_guard=_Guard())
    guard.install()            # autograd reports errors the guard kept
    registration.register_all()
    # `import torch.neuron.memory` / `from torch.neuron.memory import ...`, as with torch.cuda.memory.
    import sys
    sys.modules.setdefault("torch.neuron.memory", device_module.memory)
    observe("eager_mode", adaptive.apply_mode)
    observe("device_checks", adaptive.device_checks_changed)
    observe("shapes", _shapes_changed)
    printing.install()
    rng.install()              # torch.Generator(device="neuron")
    modules.install()
    autocast.install()
    # The `neuron` c10d backend: a registry entry only (torch.distributed is already imported).
    distributed.register()
    device_module.install_storage_resize()   # FSDP2 frees parameters with storage.resize_(0)
    device_module.install_accelerator_functions()   # torch.accelerator.synchronize, memory_*
    serialization.install()
    pinned.install()           # Tensor.pin_memory() with neuron as the accelerator
    profiler.install_hooks()   # neuron ranges in torch.profiler traces
    integrations.install()     # transformers/accelerate device probes, DataLoader pinning
    dynamo_skip.install()      # Dynamo never traces torchneuron's frames, whatever the backend
    _registered = True
    if not _autoloaded:
        _register_dynamo_backend_of_a_source_tree()
    if config.cuda:            # TORCHNEURON_CUDA=neuron: CUDA scripts run unchanged on neuron
        transfer_cuda(config.cuda)


def _shapes_changed(value) -> None:
    import sys
    if value == "bucketed" or "torchneuron.compile.eager_buckets" in sys.modules:
        from .compile import eager_buckets  # loaded only once bucketed shapes are asked for
        eager_buckets.apply_setting(value)


def _autoload() -> None:
    """Entry point for ``torch.backends``: runs during ``import torch``."""
    global _autoloaded
    _autoloaded = True
    register()


def _register_dynamo_backend_of_a_source_tree() -> None:
    """Run from a source tree without installing it (``PYTHONPATH=src``, as on a machine that allows
    no installs), no entry point tells Dynamo of ``backend="neuron"``: register it directly (this
    imports Dynamo, ~1 s). An installed package is found through its entry point, as before."""
    from importlib.metadata import entry_points  # only when torch did not autoload the package
    if any(ep.name == "neuron" for ep in entry_points(group="torch_dynamo_backends")):
        return
    from torch._dynamo.backends.registry import register_backend  # imports Dynamo: see above

    from .compile import neuron_backend
    register_backend(neuron_backend, "neuron")


def warmup(fn, example_inputs, buckets, *, dim: int = 1, grad: bool = False) -> dict:
    """Compile ``fn``'s shape buckets ahead of traffic (``config.shapes="bucketed"``): see
    ``torchneuron/shape_warmup.py``."""
    from . import shape_warmup  # not at the top: only serving code calls it
    return shape_warmup.warmup(fn, example_inputs, buckets, dim=dim, grad=grad)


def locate_drift(model, inputs, baseline: str = "cpu", **options):
    """Name the first module, and the first ATen op inside it, whose neuron result drifts from CPU
    beyond ``rtol``/``atol``: see ``torchneuron/report/drift.py``."""
    from .report import drift  # not at the top: only debugging sessions call it
    return drift.locate_drift(model, inputs, baseline, **options)


def set_eager_mode(mode: str) -> None:
    """Switch eager execution between ``"plain"`` (one executable per op) and ``"adaptive"``."""
    from .eager import adaptive  # not at the top: see there
    adaptive.set_eager_mode(mode)


def eager_mode(mode: str):
    """Context manager: run a block in the given eager mode."""
    from .eager import adaptive  # not at the top: see there
    return adaptive.eager_mode(mode)


def transfer_cuda(target: str = "neuron", *, warn: bool = True):
    """Run code written for CUDA on neuron unchanged: ``"cuda"``/``"cuda:N"`` devices, ``.cuda()``,
    ``torch.cuda.*`` (devices, synchronize, streams and events, memory statistics, RNG),
    ``torch.autocast("cuda")``, ``GradScaler("cuda")`` and ``pin_memory`` map onto neuron, with one
    warning naming what was mapped. Returns the mapping (``.uninstall()`` undoes it)."""
    from .integrations import cuda  # not at the top: see there
    return cuda.transfer_cuda(target, warn=warn)


def kernel(name: str, fn=None, /, *, mutates_args=(), backward=None, tags=()):
    """Register a JAX function (jnp/lax code or a Pallas kernel) as the PyTorch custom op ``name``
    ("namespace::op"), shaped like ``torch.library.custom_op``. See docs/kernels.md."""
    from .kernels import kernel as _kernel  # not at the top: only torch-free modules there (see there)
    return _kernel(name, fn, mutates_args=mutates_args, backward=backward, tags=tags)


def __getattr__(name):
    # Heavier parts load on first use.
    if name in ("pad_to_multiple", "bucket_length"):
        from .compile import shapes  # heavier parts load on first use
        return getattr(shapes, name)
    if name == "export":
        # torchneuron.export.save / load: torch.export programs as neuron artifacts.
        from .compile import export  # heavier parts load on first use
        value = globals()[name] = export
        return value
    if name in ("step", "track", "check"):
        # Migration-readiness report: mark steps, track values, or collect a report in-process.
        from . import report  # heavier parts load on first use
        value = globals()[name] = getattr(report, name)
        return value
    raise AttributeError(f"module 'torchneuron' has no attribute {name!r}")


register()

__all__ = ["config", "metrics", "register", "kernel", "transfer_cuda", "locate_drift", "step", "track", "check", "__version__"]
