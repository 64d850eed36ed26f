"""All torchneuron settings in one place.

Each field can be overridden by an environment variable ``TORCHNEURON_<FIELD>`` (upper case),
read when torchneuron is imported; code may also assign ``torchneuron.config.<field>``. Both
are validated the same way (type, choices, range) and errors name the setting and its variable.
The settings the PJRT client starts with (``START_SETTINGS``) are read again when the device first
starts, so a program may also set their variables after ``import torch``.
``docs/configuration.md`` documents every setting.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field

_CHOICES = {
    "fallback": ("warn", "silent", "error"),
    "float64": ("downcast", "error", "keep"),
    "eager_mode": ("plain", "adaptive"),
    "compile_fallback": ("error", "eager"),
    "device_checks": ("deferred", "sync", "off"),
    "shapes": ("static", "bucketed"),
    "cuda": ("", "neuron"),
    "collectives": ("auto", "host", "shared"),
}


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchneuron")


# Integer settings and their smallest value.
_MINIMUM = {"adaptive_max_ops": 1, "adaptive_segment_ops": 1, "adaptive_compile_after": 1,
            "cpu_intra_op_threads": 1}
# Integer settings that also accept "auto" (the value is chosen where the setting is applied).
_AUTO = {"cpu_intra_op_threads"}
# Real-valued settings and their smallest value.
_FLOAT_MINIMUM = {"adaptive_compile_budget": 0.0}
# Settings that are on or off.
_BOOL_FIELDS = {"cpu_async_dispatch", "cpu_retain_freed_memory", "adaptive_overlap", "adaptive_verify_fusion"}
# Choices compared without case or surrounding blanks.
_NORMALISED = set(_CHOICES) | {"platform", "visible_device"}
# Settings that are on, off or "auto" (left to the PJRT plugin's own default).
_AUTO_BOOL = {"gpu_preallocate"}
# Real-valued settings in (0, 1], or "auto".
_FRACTIONS = {"gpu_memory_fraction"}
# What the PJRT client is created with: read again, from their variables, when the device starts
# (torchneuron is imported during `import torch`, often before the program sets its environment).
START_SETTINGS = ("platform", "visible_device", "gpu_preallocate", "gpu_memory_fraction", "cpu_retain_freed_memory")
# Live settings the program assigned in code: their variables no longer apply at device start.
_ASSIGNED: set = set()

# Settings whose change must take effect at once (eager_mode switches the kernels' recorder).
_OBSERVERS: dict = {}
# Settings that may refuse a change (platform, once the runtime runs on one).
_GUARDS: dict = {}


def observe(name: str, callback) -> None:
    _OBSERVERS[name] = callback
    callback(getattr(config, name))


def guard(name: str, check) -> None:
    """``check(old, new)`` runs before ``name`` changes and raises to refuse the change."""
    _GUARDS[name] = check


def _variable(name: str) -> str:
    return f"TORCHNEURON_{name.upper()}"


@dataclass
class Config:
    # PJRT platform the neuron device runs on: cpu, cuda, tpu or neuron (a PJRT plugin). Read when
    # the device first starts; JAX then initialises only this platform (and cpu, for host kernels).
    platform: str = "cpu"
    # Which devices of the platform this process sees: "all"; "local_rank" (only the device
    # LOCAL_RANK names, as torchrun sets it: one device per rank); a device index; or "auto":
    # "local_rank" on cuda/rocm/gpu/neuron when LOCAL_RANK is set and the user has not restricted
    # the devices already, else "all". Read when the device first starts.
    visible_device: str = "auto"
    # GPU platforms: the allocator reserves its memory pool when the client starts (True), grows it
    # on demand (False), or "auto": the plugin's default (XLA_PYTHON_CLIENT_PREALLOCATE).
    gpu_preallocate: bool | str = "auto"
    # GPU platforms: share of each device's memory the allocator may use, in (0, 1], or "auto": the
    # plugin's default (XLA_PYTHON_CLIENT_MEM_FRACTION).
    gpu_memory_fraction: float | str = "auto"
    # Ops with neither a lowering nor a decomposition: warn once per op and run on CPU,
    # run on CPU silently, or raise.
    fallback: str = "warn"
    # float64 tensors: run as float32 with one warning per op, raise, or keep float64.
    float64: str = "downcast"
    # Eager execution mode: one executable per op, or adaptive fusion of pending ops.
    eager_mode: str = "plain"
    # Largest number of ops an adaptive-eager region records before it is cut (a safety net: regions
    # are cut at backward passes, optimizer steps and host reads).
    adaptive_max_ops: int = 4096
    # Most ops compiled into one fused adaptive-eager executable; longer regions are split.
    adaptive_segment_ops: int = 256
    # How many times a region must occur before its fused executable is compiled (in the background).
    adaptive_compile_after: int = 2
    # Largest share of the time adaptive mode is on that background region compiles may take
    # (1 or more: no limit). Compiles wait until the program has run long enough to afford them.
    adaptive_compile_budget: float = 0.1
    # Run a region's fused executable on a worker thread while the program records the next region
    # (its results are taken at the next cut or host read); False runs it at the cut.
    adaptive_overlap: bool = False
    # When a region's fused executable is compiled, also run its ops one by one on the same inputs
    # and compare; a fused group that differs is bisected to the smallest differing group of ops,
    # which then runs op by op (docs/adaptive.md). Costs one op-by-op run per compile.
    adaptive_verify_fusion: bool = False
    # torch.compile: an op without a lowering fails the compile, or the graph runs eagerly.
    compile_fallback: str = "error"
    # PyTorch's checks that depend on tensor values (index bounds, integer division by zero): read
    # at the next synchronisation point ("deferred"), right after each checked op ("sync"), or not
    # compiled at all ("off").
    device_checks: str = "deferred"
    # torch.compile graphs Dynamo traced with symbolic shapes (dynamic=True, mark_dynamic, automatic
    # dynamic): compiled once per concrete shape ("static"), or once per shape bucket with the pad
    # masked ("bucketed", docs/shapes.md).
    shapes: str = "static"
    # The buckets of config.shapes="bucketed": "pow2" (powers of two from 16), "pow2:<min>", or
    # increasing sizes "64,128,256" (a size above the largest is an error naming the dim).
    shape_buckets: str = "pow2"
    # Persistent compilation cache for torch.compile executables ("" disables it).
    cache_dir: str = field(default_factory=_default_cache_dir)
    # When set, each compiled graph's FX code and StableHLO text are written here.
    dump_dir: str = ""
    # CPU platform: hand each execution to XLA's thread pool (True) or run it on the calling thread
    # (False, about half the CPU time of a small eager op). Read when the CPU client starts.
    cpu_async_dispatch: bool = False
    # CPU platform: threads in XLA's intra-op pool (the one a large matmul or convolution splits
    # across), or "auto": XLA's own choice (one per core, or the NPROC the user set). Read when the
    # CPU client starts.
    cpu_intra_op_threads: int | str = "auto"
    # CPU platform: device memory is the process heap; keep what it frees (as a GPU's caching
    # allocator does) instead of page-faulting a training step's large buffers in again every step
    # (runtime/host_memory.py). Process-wide; torch.neuron.empty_cache() gives the memory back.
    # Read when the device starts.
    cpu_retain_freed_memory: bool = True
    # When set, a neuron allocation that fails with torch.OutOfMemoryError first writes
    # torch.neuron.memory._snapshot() to this path (a pickle PyTorch's memory visualizer reads).
    oom_snapshot: str = ""
    # How the neuron process group moves collectives on neuron tensors: "host" (copies in host
    # memory, run by gloo), "shared" (tensors sharing the device buffers through DLPack, run by NCCL
    # on the CUDA platform and by gloo elsewhere), or "auto": "shared" on CUDA when torch has NCCL,
    # else "host". Read when a process group is created.
    collectives: str = "auto"
    # "neuron": a CUDA script runs unchanged on neuron (torchneuron.transfer_cuda() at import):
    # "cuda" devices, .cuda(), torch.cuda.*, autocast("cuda") and GradScaler("cuda") map to neuron.
    cuda: str = ""

    def __setattr__(self, name, value):
        value = _validated(name, value)
        # Guards and observers act for the live settings only, not a Config built to read or compare.
        live = self is globals().get("config")
        check = _GUARDS.get(name) if live else None
        if check is not None and name in self.__dict__ and value != self.__dict__[name]:
            check(self.__dict__[name], value)
        super().__setattr__(name, value)
        if live:
            _ASSIGNED.add(name)
        observer = _OBSERVERS.get(name) if live else None
        if observer is not None:
            observer(value)

    def non_defaults(self) -> dict:
        """Settings that differ from their defaults (for reports and version manifests)."""
        base = Config.__new__(Config)
        for f in dataclasses.fields(Config):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(base, f.name, default)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Config)
                if getattr(self, f.name) != getattr(base, f.name)}

    @classmethod
    def from_env(cls, environ=os.environ) -> Config:
        cfg = cls()
        for f in dataclasses.fields(cls):
            raw = environ.get(_variable(f.name))
            if raw is not None:
                setattr(cfg, f.name, _parsed(f, raw))
        return cfg


def _parsed(f, raw: str):
    """The value the variable of setting ``f`` holds (still to be validated)."""
    name, text = f.name, raw.strip().lower()
    if (name in _AUTO or name in _AUTO_BOOL or name in _FRACTIONS) and text == "auto":
        return "auto"
    if name in _MINIMUM or name in _FLOAT_MINIMUM or name in _FRACTIONS:
        kind, what = (int, _INTEGER.get(name, "an integer")) if name in _MINIMUM else (float, "a number")
        if name in _FRACTIONS:
            what = "a number in (0, 1] or 'auto'"
        try:
            return kind(raw.strip())
        except ValueError:
            raise ValueError(f"torchneuron: {_variable(name)}={raw!r} is not {what} "
                             f"(config.{name}; default {f.default})") from None
    if name in _BOOL_FIELDS or name in _AUTO_BOOL:
        value = _BOOLS.get(text)
        if value is None:
            also = ", or auto" if name in _AUTO_BOOL else ""
            raise ValueError(f"torchneuron: {_variable(name)}={raw!r} must be one of 1/0, "
                             f"true/false, yes/no, on/off{also} (config.{name}; default {f.default})")
        return value
    return raw


def read_start_settings(environ=os.environ) -> None:
    """Apply the variables of ``START_SETTINGS`` as they are now (the device is starting), except
    for settings the program assigned in code, which win."""
    for name in START_SETTINGS:
        raw = environ.get(_variable(name))
        if raw is not None and name not in _ASSIGNED:
            # Not setattr: that would count as an assignment in code.
            config.__dict__[name] = _validated(name, _parsed(_FIELDS[name], raw))


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_INTEGER = {name: "an integer or 'auto'" for name in _AUTO}


def _validated(name: str, value):
    """``value`` as setting ``name`` holds it, or an error naming the setting and its variable."""
    f = _FIELDS.get(name)
    if f is None:
        close = difflib.get_close_matches(name, _FIELDS, n=1)
        raise AttributeError(f"torchneuron: config has no setting {name!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + f"; settings: {', '.join(_FIELDS)}")
    where = f"config.{name} (environment variable {_variable(name)})"
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise TypeError(f"torchneuron: {where} must be True or False, got {value!r}")
        return value
    if name in _FLOAT_MINIMUM:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"torchneuron: {where} must be a number, got {value!r}")
        if not value >= _FLOAT_MINIMUM[name]:
            raise ValueError(f"torchneuron: {where} must be at least {_FLOAT_MINIMUM[name]}, got {value}")
        return float(value)
    if (name in _AUTO or name in _AUTO_BOOL or name in _FRACTIONS) and isinstance(value, str) \
            and value.strip().lower() == "auto":
        return "auto"
    if name in _AUTO_BOOL:
        if not isinstance(value, bool):
            raise TypeError(f"torchneuron: {where} must be True, False or 'auto', got {value!r}")
        return value
    if name in _FRACTIONS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"torchneuron: {where} must be a number in (0, 1] or 'auto', got {value!r}")
        if not 0 < value <= 1:
            raise ValueError(f"torchneuron: {where} must be in (0, 1] (a share of each device's memory) "
                             f"or 'auto', got {value}")
        return float(value)
    if name in _MINIMUM:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"torchneuron: {where} must be {_INTEGER.get(name, 'an integer')}, got {value!r}")
        if value < _MINIMUM[name]:
            raise ValueError(f"torchneuron: {where} must be at least {_MINIMUM[name]}, got {value}")
        return value
    if name == "visible_device" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)   # a device index
    if not isinstance(value, str):
        raise TypeError(f"torchneuron: {where} must be a string, got {value!r}")
    if name in _NORMALISED:
        value = value.strip().lower()
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"torchneuron: {where} must be one of {_CHOICES[name]}, got {value!r}")
    if name == "shape_buckets":
        value = value.strip().lower().replace(" ", "")
        ok = value == "pow2" or (value.startswith("pow2:") and value[5:].isdigit() and int(value[5:]) > 0)
        if not ok:
            parts = value.split(",")
            ok = all(p.isdigit() and int(p) > 0 for p in parts) and \
                [int(p) for p in parts] == sorted({int(p) for p in parts})
        if not ok:
            raise ValueError(f"torchneuron: {where} must be 'pow2', 'pow2:<min>' or increasing positive "
                             f"sizes like '64,128,256', got {value!r}")
    if name == "visible_device" and value not in ("auto", "all", "local_rank") and not value.isdigit():
        raise ValueError(f"torchneuron: {where} must be 'auto', 'all', 'local_rank' or a device index "
                         f"like '0', got {value!r}")
    if name == "platform" and not value:
        raise ValueError(f"torchneuron: {where} must name a PJRT platform, e.g. 'cpu'")
    return value


config = Config.from_env()
