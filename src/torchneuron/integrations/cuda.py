"""Run a script written for CUDA on neuron, unchanged: ``torchneuron.transfer_cuda()``,
``TORCHNEURON_CUDA=neuron`` and ``torchneuron check --device-map cuda=neuron``.

A ``DeviceMap`` rewrites device arguments where tensors are created or moved (factories,
``Tensor.to``/``.cuda()``/``new_*``, ``Module.cuda``/``to_empty``, ``torch.load(map_location=)``,
``set_default_device``, autocast and GradScaler) and points ``torch.cuda``'s functions (devices,
synchronize, streams and events, memory statistics, RNG) at the target device's module. Ordinary
ops are untouched, so mapping costs nothing per op. What stays CUDA's: ``torch.device("cuda")``
objects themselves (a mapped tensor reports ``device.type == "neuron"``; ``Tensor.is_cuda`` is True
for it), CUDA-only libraries (``torch.cuda.nvtx``, NCCL) and ``torch.backends.cudnn`` switches
(accepted, without effect).

The readiness report's CPU baseline run uses the same mechanism with ``neuron=cpu`` (and ``cuda=cpu``).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch

# Factories and other torch functions that take ``device=``.
_FACTORIES = (
    "tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm",
    "arange", "range", "linspace", "logspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "empty_strided", "tril_indices", "triu_indices", "scalar_tensor",
    "normal", "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window",
    "sparse_coo_tensor", "complex", "polar", "empty_permuted",
)
_TENSOR_NEW = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")

# torch.cuda functions answered by the target device's module (torch.neuron) when it has them.
_CUDA_FUNCS = (
    "device_count", "current_device", "set_device", "synchronize", "manual_seed", "manual_seed_all", "seed",
    "seed_all", "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "memory_stats", "empty_cache", "get_device_name", "get_device_properties",
    "memory_summary", "mem_get_info", "reset_accumulated_memory_stats", "reset_max_memory_allocated",
    "memory_snapshot", "is_initialized", "is_bf16_supported", "device", "Stream", "Event", "stream",
    "current_stream", "default_stream", "set_stream", "default_generators",
)
# torch.cuda.memory functions answered by torch.neuron.memory.
_CUDA_MEMORY_FUNCS = (
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
    "memory_summary", "mem_get_info", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "empty_cache", "memory_snapshot", "_record_memory_history", "_snapshot",
    "_dump_snapshot",
)
# What a mapping of cuda onto a device does, for its one warning.
MAPPED = ('"cuda"/"cuda:N" devices', ".cuda()", "torch.cuda.* (devices, synchronize, streams and events, "
          "memory statistics, RNG)", 'torch.autocast("cuda")', 'GradScaler("cuda")', "pin_memory")


def parse(specs) -> dict[str, str]:
    """["cuda=neuron", ...] -> {"cuda": "neuron"}."""
    mapping = {}
    for spec in specs or ():
        for part in spec.split(","):
            src, sep, dst = part.partition("=")
            if not sep or not src.strip() or not dst.strip():
                raise ValueError(f"--device-map expects SRC=DST (e.g. cuda=neuron), got {part!r}")
            mapping[src.strip()] = dst.strip()
    return mapping


def compose(mapping: dict[str, str], then: dict[str, str]) -> dict[str, str]:
    """Apply ``mapping`` then ``then``: {cuda: neuron} + {neuron: cpu} -> {cuda: cpu, neuron: cpu}."""
    out = {src: then.get(dst, dst) for src, dst in mapping.items()}
    for src, dst in then.items():
        out.setdefault(src, dst)
    return out


class DeviceMap:
    def __init__(self, mapping: dict[str, str]):
        self.mapping = dict(mapping)
        self._undo: list = []
        self.rewrites = 0

    # -- mapping one device argument ----------------------------------------------------------
    def device(self, dev):
        if isinstance(dev, str | torch.device):
            d = torch.device(dev)
            target = self.mapping.get(d.type)
            if target is not None:
                self.rewrites += 1
                if target == "cpu" or d.index is None:
                    return torch.device(target)
                return torch.device(target, d.index)
        return dev

    def _kw(self, kwargs, key="device"):
        if key in kwargs and kwargs[key] is not None:
            kwargs[key] = self.device(kwargs[key])
        return kwargs

    # -- installation ---------------------------------------------------------------------------
    def _patch(self, owner, name, value):
        missing = object()
        old = owner.__dict__.get(name, missing) if isinstance(owner, type) else getattr(owner, name, missing)
        self._undo.append((owner, name, old, missing))
        setattr(owner, name, value)

    def install(self) -> DeviceMap:
        _settle_dynamo()
        dm = self
        for name in _FACTORIES:
            fn = getattr(torch, name, None)
            if fn is not None:
                self._patch(torch, name, self._wrap_kw(fn))
        for name in _TENSOR_NEW:
            self._patch(torch.Tensor, name, self._wrap_kw(getattr(torch.Tensor, name)))

        tensor_to = torch.Tensor.to

        @functools.wraps(tensor_to)
        def to(self, *args, **kwargs):
            if args:
                args = (dm.device(args[0]),) + args[1:]
            return tensor_to(self, *args, **dm._kw(kwargs))
        self._patch(torch.Tensor, "to", to)

        def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
            target = dm.device("cuda" if device is None else
                               f"cuda:{device}" if isinstance(device, int) else device)
            return tensor_to(self, target, non_blocking=non_blocking, memory_format=memory_format)
        if "cuda" in self.mapping:
            self._patch(torch.Tensor, "cuda", tensor_cuda)
            self._patch(torch.Tensor, "is_cuda", property(
                lambda t: t.device.type in ("cuda", self.mapping["cuda"])))

            def module_cuda(module, device=None):
                return module.to(tensor_cuda(torch.empty(0), device).device)
            self._patch(torch.nn.Module, "cuda", module_cuda)
            self._map_cuda_module(torch)

        module_to_empty = torch.nn.Module.to_empty

        def to_empty(module, *, device, recurse=True):
            return module_to_empty(module, device=dm.device(device), recurse=recurse)
        self._patch(torch.nn.Module, "to_empty", to_empty)

        load = torch.load

        @functools.wraps(load)
        def torch_load(*args, **kwargs):
            loc = kwargs.get("map_location")
            if isinstance(loc, str | torch.device):
                kwargs["map_location"] = dm.device(loc)
            elif isinstance(loc, dict):
                kwargs["map_location"] = {k: str(dm.device(v)) for k, v in loc.items()}
            return load(*args, **kwargs)
        self._patch(torch, "load", torch_load)

        set_default_device = torch.set_default_device
        self._patch(torch, "set_default_device", lambda device: set_default_device(dm.device(device)))

        autocast_init = torch.amp.autocast_mode.autocast.__init__

        def autocast(ac, device_type, *args, **kwargs):
            target = self.mapping.get(device_type, device_type)
            autocast_init(ac, target, *args, **kwargs)
        self._patch(torch.amp.autocast_mode.autocast, "__init__", autocast)

        scaler_init = torch.amp.GradScaler.__init__

        def grad_scaler(gs, device="cuda", *args, **kwargs):
            scaler_init(gs, self.mapping.get(device, device), *args, **kwargs)
        self._patch(torch.amp.GradScaler, "__init__", grad_scaler)
        return self

    def _wrap_kw(self, fn):
        dm = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **dm._kw(kwargs))
        return wrapper

    def _map_cuda_module(self, torch) -> None:
        target = self.mapping["cuda"]
        cuda = torch.cuda
        if target == "cpu":
            # The script keeps its CUDA code path; device-side calls become host no-ops.
            funcs = {
                "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
                "synchronize": lambda device=None: None, "empty_cache": lambda: None,
                "set_device": lambda device: None, "manual_seed": lambda seed: None,
                "manual_seed_all": lambda seed: None, "is_bf16_supported": lambda *a, **k: True,
                "get_device_name": lambda device=None: "cpu (baseline for cuda)",
            }
            for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
                funcs[name] = lambda device=None: 0
            funcs["reset_peak_memory_stats"] = lambda device=None: None
            funcs["Event"] = _Event
            funcs["stream"] = lambda stream=None: contextlib.nullcontext()
            funcs["current_stream"] = lambda device=None: _Stream()
            funcs["Stream"] = _Stream
        else:
            module = getattr(torch, target)
            funcs = {name: getattr(module, name) for name in _CUDA_FUNCS if hasattr(module, name)}
            funcs["is_available"] = module.is_available
            funcs["is_bf16_supported"] = lambda *a, **k: True
            funcs["init"] = lambda: None
            funcs.setdefault("Event", _Event)
            funcs.setdefault("Stream", _Stream)
            funcs.setdefault("stream", lambda stream=None: contextlib.nullcontext())
            funcs.setdefault("current_stream", lambda device=None: _Stream())
            memory = getattr(module, "memory", None)
            if memory is not None:
                for name in _CUDA_MEMORY_FUNCS:
                    if hasattr(memory, name):
                        self._patch(cuda.memory, name, getattr(memory, name))
        for name, fn in funcs.items():
            self._patch(cuda, name, fn)

    def uninstall(self) -> None:
        while self._undo:
            owner, name, old, missing = self._undo.pop()
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def _settle_dynamo() -> None:
    """Dynamo resolves its table of torch functions by name once, the first time anything asks
    for it (which can be any op's first run). Resolved while the factories are wrapped, the table
    would hold the wrappers, and once they are removed Dynamo refuses ``torch.arange`` and the
    others as unknown builtins in every later ``torch.compile``: resolve it before wrapping."""
    try:
        from torch._dynamo import trace_rules  # only here: torch._dynamo is heavy and often unused
    except ImportError:
        return
    trace_rules.get_torch_obj_rule_map()


_active: DeviceMap | None = None


def transfer_cuda(target: str = "neuron", *, warn: bool = True) -> DeviceMap:
    """Map CUDA onto ``target`` for the rest of the process (``torchneuron.transfer_cuda()``):
    what a CUDA script asks of ``"cuda"`` runs on neuron. Calling it again returns the installed
    mapping; ``.uninstall()`` on it restores PyTorch's CUDA functions."""
    global _active
    if _active is not None and _active._undo:
        return _active
    _active = DeviceMap({"cuda": target}).install()
    if warn:
        warnings.warn(f"torchneuron: CUDA is mapped onto {target}: {', '.join(MAPPED)} run on "
                      f"{target}; tensors report device type {target!r}.", stacklevel=2)
    return _active


def _sync():
    if hasattr(torch, "neuron"):
        torch.neuron.synchronize()


class _Event:
    """``torch.cuda.Event`` for timing: records a host timestamp after synchronising."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        _sync()
        self.t = time.perf_counter()

    def synchronize(self):
        _sync()

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        _sync()

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
