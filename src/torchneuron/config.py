"""All torchneuron settings in one place.

Each field can be overridden by an environment variable ``TORCHNEURON_<FIELD>`` (upper case),
read once when torchneuron is imported; code may also assign ``torchneuron.config.<field>``. Both
are validated the same way (type, choices, range) and errors name the setting and its variable.
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
_BOOL_FIELDS = {"cpu_async_dispatch", "adaptive_overlap"}
# Choices compared without case or surrounding blanks.
_NORMALISED = set(_CHOICES) | {"platform"}

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
    # PJRT platform the neuron device runs on: cpu, cuda, tpu or neuron (a PJRT plugin).
    platform: str = "cpu"
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
    # When set, a neuron allocation that fails with torch.OutOfMemoryError first writes
    # torch.neuron.memory._snapshot() to this path (a pickle PyTorch's memory visualizer reads).
    oom_snapshot: str = ""
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
            if raw is None:
                continue
            value = raw
            if f.name in _AUTO and raw.strip().lower() == "auto":
                value = "auto"
            elif f.name in _MINIMUM or f.name in _FLOAT_MINIMUM:
                kind, what = (int, _INTEGER.get(f.name, "an integer")) if f.name in _MINIMUM else (float, "a number")
                try:
                    value = kind(raw.strip())
                except ValueError:
                    raise ValueError(f"torchneuron: {_variable(f.name)}={raw!r} is not {what} "
                                     f"(config.{f.name}; default {f.default})") from None
            elif f.name in _BOOL_FIELDS:
                value = _BOOLS.get(raw.strip().lower())
                if value is None:
                    raise ValueError(f"torchneuron: {_variable(f.name)}={raw!r} must be one of 1/0, "
                                     f"true/false, yes/no, on/off (config.{f.name}; default {f.default})")
            setattr(cfg, f.name, value)
        return cfg


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
    if name in _AUTO and isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if name in _MINIMUM:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"torchneuron: {where} must be {_INTEGER.get(name, 'an integer')}, got {value!r}")
        if value < _MINIMUM[name]:
            raise ValueError(f"torchneuron: {where} must be at least {_MINIMUM[name]}, got {value}")
        return value
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
    if name == "platform" and not value:
        raise ValueError(f"torchneuron: {where} must name a PJRT platform, e.g. 'cpu'")
    return value


config = Config.from_env()
