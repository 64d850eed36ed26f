"""All torchneuron settings in one place.

Each field can be overridden by an environment variable ``TORCHNEURON_<FIELD>`` (upper case),
read once when torchneuron is imported; code may also assign ``torchneuron.config.<field>``.
``docs/configuration.md`` documents every setting.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

_CHOICES = {
    "fallback": ("warn", "silent", "error"),
    "float64": ("downcast", "error", "keep"),
    "eager_mode": ("plain", "adaptive"),
    "compile_fallback": ("error", "eager"),
}


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchneuron")


# Settings whose change must take effect at once (eager_mode switches the kernels' recorder).
_OBSERVERS: dict = {}


def observe(name: str, callback) -> None:
    _OBSERVERS[name] = callback
    callback(getattr(config, name))


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
    # torch.compile: an op without a lowering fails the compile, or the graph runs eagerly.
    compile_fallback: str = "error"
    # Persistent compilation cache for torch.compile executables ("" disables it).
    cache_dir: str = field(default_factory=_default_cache_dir)
    # When set, each compiled graph's FX code and StableHLO text are written here.
    dump_dir: str = ""
    # CPU platform: hand each execution to XLA's thread pool (True) or run it on the calling thread
    # (False, about half the CPU time of a small eager op). Read when the CPU client starts.
    cpu_async_dispatch: bool = False

    def __setattr__(self, name, value):
        if name in _CHOICES and value not in _CHOICES[name]:
            raise ValueError(
                f"torchneuron: config.{name} must be one of {_CHOICES[name]}, got {value!r} "
                f"(environment variable TORCHNEURON_{name.upper()})"
            )
        super().__setattr__(name, value)
        observer = _OBSERVERS.get(name)
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
            raw = environ.get(f"TORCHNEURON_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("int", int):
                value = int(raw)
            elif f.type in ("float", float):
                value = float(raw)
            elif f.type in ("bool", bool):
                value = _parse_bool(f.name, raw)
            elif f.name in _CHOICES or f.name == "platform":
                value = raw.strip().lower()
            else:
                value = raw
            setattr(cfg, f.name, value)
        return cfg


_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _parse_bool(name: str, raw: str) -> bool:
    value = _BOOLS.get(raw.strip().lower())
    if value is None:
        raise ValueError(f"torchneuron: TORCHNEURON_{name.upper()} must be one of 1/0, true/false, yes/no, "
                         f"on/off, got {raw!r}")
    return value


config = Config.from_env()
