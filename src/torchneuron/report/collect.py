"""Collects what a readiness report needs while the user's program runs.

A :class:`Collector` attaches to the tracer (``torchneuron.profiler``) for call sites, failures and
fallback costs, marks steps (``torchneuron.step()`` or, failing that, ``optimizer.step()``), keeps
values the script tracks (``torchneuron.track``) and snapshots the metrics registry at each step.

Which ``optimizer.step()`` marks steps: the first optimizer (by order of first step) whose
parameters are on the checked device, so that a script that trains a CPU reference model before
the neuron one is measured on its neuron loop. With no such optimizer, the first one that stepped
(and the run says so). A caller can fix the optimizer by its index (``step_optimizer``): the CPU
baseline run of ``torchneuron check`` counts the optimizer the neuron run counted, since on CPU
every optimizer's parameters are on CPU.
``stop()`` returns the run as plain JSON-able data; analysis and rendering never import torch.
"""

from __future__ import annotations

import linecache
import math
import time
import traceback
import weakref
from collections import Counter

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map

from .. import profiler
from ..metrics import metrics
from ..runtime import sites
from .drift import locate_drift

RUN_SCHEMA = "torchneuron.run/1"

# How many elements of a tracked tensor are kept per step (a strided sample beyond that).
TRACK_LIMIT = 4096

_active: Collector | None = None


class BudgetReached(BaseException):
    """Stops the user's script when its step budget or time budget is used up.

    A BaseException so that the script's own ``except Exception`` blocks do not swallow it.
    """

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def active() -> Collector | None:
    return _active


def step(samples: int | None = None) -> None:
    """Mark the end of one training or inference step (a no-op unless a report is collecting).

    ``samples``: how many samples (or tokens) the step processed, for throughput.
    """
    col = _active
    if col is not None:
        col.mark_step("explicit", samples)


def track(name: str, value, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Record ``value`` (a number or tensor) under ``name`` for comparison with a baseline run.

    ``rtol``/``atol`` set this value's tolerance (defaults: the report's). A no-op, with no device
    read, unless a report is collecting.
    """
    col = _active
    if col is not None:
        col.track(name, value, rtol, atol)


_LIGHT_SCALARS = ("executables_compiled", "eager_cache_loads", "compile_seconds", "cache_hits",
                  "h2d_copies", "h2d_bytes",
                  "d2h_copies", "d2h_bytes", "graphs_compiled", "regions_flushed", "region_ops",
                  "region_replayed_ops", "region_cache_hits", "region_compiles", "region_compile_seconds")
_LIGHT_COUNTERS = ("fallbacks", "decompositions", "recompiles", "graph_breaks", "float64_downcasts",
                   "graph_fallbacks", "region_unfused")
# Counters reported for the whole run only (not per step).
_TOTAL_COUNTERS = ("op_calls", "custom_kernel_calls", "custom_kernel_compiles") + _LIGHT_COUNTERS


def _light_snapshot() -> dict:
    snap = {k: getattr(metrics, k) for k in _LIGHT_SCALARS}
    for k in _LIGHT_COUNTERS:
        snap[k] = dict(getattr(metrics, k))
    snap["op_calls"] = sum(metrics.op_calls.values())
    return snap


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = {op: n - (b or {}).get(op, 0) for op, n in v.items() if n - (b or {}).get(op, 0) > 0}
        else:
            out[k] = v - (b or 0)
    return out


def counter_delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def _site_key(site):
    return None if site is None else (site["file"], site["line"], site.get("via"))


class Collector:
    """Everything one run of a program contributes to a report.

    ``role`` is "neuron" for the run under test and "baseline" for the comparison run (which is not
    traced: nothing of it should touch the device).
    """

    def __init__(self, *, role: str = "neuron", max_steps: int | None = None, sync: bool = True,
                 rtol: float = 1e-3, atol: float = 1e-5, device: str = "neuron",
                 step_optimizer: int | None = None):
        self.role = role
        self.device = device                  # the checked device type (optimizers' parameters)
        self.step_optimizer = step_optimizer  # fixed index of the optimizer that marks steps
        self.optimizers: list[dict] = []      # by order of first step: steps, parameter devices
        self._optimizer_index = weakref.WeakKeyDictionary()   # ids are reused once one is freed
        self.max_steps = max_steps
        self.sync = sync
        self.rtol = rtol
        self.atol = atol
        self.native_seen: set[str] = set()
        self.sites: dict[tuple[str, str], dict | None] = {}
        self.float64_sites: dict[str, dict | None] = {}
        self.failures: dict[tuple[str, str], dict] = {}
        self.fallback_costs: dict[str, dict] = {}
        self.transfers: dict[tuple, dict] = {}
        self.compile_sites: dict[tuple, dict] = {}   # eager compiles after the first step, by site
        self.tracked: dict[str, dict] = {}
        self.boundaries: list[dict] = []
        self.explicit_seen = False
        self.persistent_cache = Counter()
        self.t_first_activity = None
        self.internal = False         # set while the collector itself reads tracked values
        self._hook = None
        self.started = False

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Collector:
        global _active
        if _active is not None:
            raise RuntimeError("torchneuron: a readiness report is already collecting in this process")

        self.wall_start = time.time()
        self.t_start = time.perf_counter()
        self.start_snapshot = _light_snapshot()
        self.start_counters = {k: dict(getattr(metrics, k)) for k in _TOTAL_COUNTERS}
        self.start_scalars = {k: getattr(metrics, k) for k in _LIGHT_SCALARS}
        # Adaptive eager's fused groups that failed or differed and now run op by op (the list
        # only grows, unless the script resets the metrics).
        self.start_isolated = len(getattr(metrics, "fusion_isolated", ()))
        self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        _listen_to_jax()
        if self.role == "neuron":
            profiler.attach_collector(self)
            if hasattr(torch, "neuron"):
                for i in range(torch.neuron.device_count()):
                    torch.neuron.reset_peak_memory_stats(i)
        _active = self
        self.started = True
        return self

    def stop(self) -> dict:
        """Detach and return the run's data (safe to call once; later calls return the same)."""
        global _active
        if getattr(self, "_data", None) is not None:
            return self._data
        t_end = time.perf_counter()
        if _active is self:
            _active = None
        if self._hook is not None:
            self._hook.remove()
        if self.role == "neuron":
            profiler.attach_collector(None)
        self._data = self._build(t_end)
        return self._data

    # -- tracer callbacks (neuron role) ---------------------------------------------------------
    def first_call(self, name: str, path: str) -> None:
        if self.internal:
            return
        if self.t_first_activity is None:
            self.t_first_activity = time.perf_counter()
        if path == "native":
            self.native_seen.add(name)
        self.sites[(name, path)] = sites.user_site()

    def failed(self, name: str, path: str, err: BaseException) -> None:
        if isinstance(err, BudgetReached | KeyboardInterrupt) or getattr(err, "_torchneuron_attributed", False):
            return
        try:
            err._torchneuron_attributed = True   # the innermost op owns the failure
        except AttributeError:
            pass
        key = (name, path)
        entry = self.failures.get(key)
        if entry is None:
            self.failures[key] = {"op": name, "path": path, "count": 1, "error_type": type(err).__name__,
                                  "error": str(err).strip()[:2000], "site": sites.user_site()}
        else:
            entry["count"] += 1

    def fallback_cost(self, name: str, copies: list[int], elapsed_ns: int) -> None:
        entry = self.fallback_costs.setdefault(name, {"calls": 0, "h2d_copies": 0, "h2d_bytes": 0,
                                                      "d2h_copies": 0, "d2h_bytes": 0, "seconds": 0.0})
        entry["calls"] += 1
        entry["h2d_copies"] += copies[0]
        entry["h2d_bytes"] += copies[1]
        entry["d2h_copies"] += copies[2]
        entry["d2h_bytes"] += copies[3]
        entry["seconds"] += elapsed_ns / 1e9

    def transfer(self, direction: str, nbytes: int) -> None:
        if self.internal:
            return
        if self.t_first_activity is None:
            self.t_first_activity = time.perf_counter()
        site = sites.user_site()
        key = (direction, _site_key(site))
        entry = self.transfers.get(key)
        if entry is None:
            entry = self.transfers[key] = {"direction": direction, "site": site, "count": 0, "bytes": 0}
        entry["count"] += 1
        entry["bytes"] += nbytes

    def float64(self, name: str) -> None:
        self.float64_sites[name] = sites.user_site()

    def eager_compile(self, name: str, reason: str, loaded: bool = False) -> None:
        """An eager op needed a new executable: compiled, or ``loaded`` from the persistent cache.
        The first step needs everything; after it, a call site that keeps needing new ones is a
        finding. Events keep the step boundary they follow; which steps count is decided at the end
        (see ``_step_choice``)."""
        if self.internal:
            return
        site = sites.user_site()
        key = (name, _site_key(site))
        entry = self.compile_sites.get(key)
        if entry is None:
            entry = self.compile_sites[key] = {"op": name, "site": site, "events": []}
        entry["events"].append((len(self.boundaries), reason, loaded))

    # -- steps ----------------------------------------------------------------------------------
    def _optimizer_stepped(self, optimizer, args, kwargs) -> None:
        index = self._optimizer_index.get(optimizer)
        if index is None:
            index = len(self.optimizers)
            devices = sorted({p.device.type for g in optimizer.param_groups for p in g["params"]})
            self._optimizer_index[optimizer] = index
            self.optimizers.append({"index": index, "type": type(optimizer).__name__, "steps": 0,
                                    "devices": devices, "on_device": self.device in devices})
        self.optimizers[index]["steps"] += 1
        self.mark_step("optimizer", None, optimizer=index)

    def _chosen_optimizer(self) -> int | None:
        """The optimizer whose steps are the run's steps, as far as the run has gone: the fixed one,
        else the first with parameters on the device, else the first that stepped."""
        if self.step_optimizer is not None:
            return self.step_optimizer
        for o in self.optimizers:
            if o["on_device"]:
                return o["index"]
        return 0 if self.optimizers else None

    def _step_choice(self) -> tuple[str | None, int | None]:
        if self.explicit_seen:
            return "explicit", None
        if not self.boundaries:
            return None, None
        return "optimizer", self._chosen_optimizer()

    @staticmethod
    def _is_step(b: dict, source, optimizer) -> bool:
        return b["source"] == source and (source != "optimizer" or b["optimizer"] == optimizer)

    def _budget_counts(self, source: str, optimizer) -> bool:
        """Whether this step mark counts towards the step budget: an optimizer's only once it is
        known to be the one that marks steps (a CPU reference loop first does not use it up)."""
        if source == "explicit":
            return True
        if self.step_optimizer is not None:
            return optimizer == self.step_optimizer
        if self.role == "baseline":
            return optimizer == 0
        return self.optimizers[optimizer]["on_device"] and optimizer == self._chosen_optimizer()

    def mark_step(self, source: str, samples, optimizer: int | None = None) -> None:
        if source == "optimizer" and self.explicit_seen:
            return
        if source == "explicit" and not self.explicit_seen:
            self.explicit_seen = True
        if self.sync and self.role == "neuron":
            # Device work runs asynchronously; a step ends when its work has finished.
            torch.neuron.synchronize()
        t = time.perf_counter()
        mem = None
        if self.role == "neuron":
            mem = torch.neuron.memory_allocated()
        self.boundaries.append({"t": t, "source": source, "optimizer": optimizer, "samples": samples,
                                "snap": _light_snapshot(), "memory": mem})
        if self.max_steps is not None and self._budget_counts(source, optimizer):
            counted = sum(1 for b in self.boundaries if self._is_step(b, source, optimizer))
            if counted >= self.max_steps:
                raise BudgetReached("steps")

    def current_step(self) -> int:
        """Steps marked so far (as the run's steps are chosen now; ``_build`` decides for good)."""
        return self._steps_before(len(self.boundaries), *self._step_choice())

    def _steps_before(self, pos: int, source, optimizer) -> int:
        return sum(1 for b in self.boundaries[:pos] if self._is_step(b, source, optimizer))

    def _step_note(self, source, optimizer) -> str | None:
        """Why the steps are the ones they are, when more than one optimizer could have marked them."""
        if source != "optimizer" or optimizer is None:
            return None
        others = [o for o in self.optimizers if o["index"] != optimizer]
        chosen = self.optimizers[optimizer] if optimizer < len(self.optimizers) else None
        if self.step_optimizer is not None:
            if not others:
                return None
            return (f"steps are counted from optimizer #{optimizer + 1} by order of first step, the one "
                    f"the run under test counted; {len(others)} other optimizer(s) stepped "
                    f"({sum(o['steps'] for o in others)} steps) and are not counted")
        if chosen is not None and not chosen["on_device"] and self.role == "neuron":
            where = ", ".join(chosen["devices"]) or "no device"
            return (f"steps are counted from an optimizer whose parameters are on {where}: no optimizer "
                    f"had {self.device} parameters")
        if others:
            off = [o for o in others if not o["on_device"]]
            note = (f"steps are counted from optimizer #{optimizer + 1} by order of first step, the first "
                    f"whose parameters are on {self.device}")
            if off:
                note += (f"; {len(off)} optimizer(s) with parameters on "
                         f"{', '.join(sorted({d for o in off for d in o['devices']})) or 'no device'} "
                         f"stepped too ({sum(o['steps'] for o in off)} steps) and are not counted")
            return note
        return None

    # -- tracked values -------------------------------------------------------------------------
    def track(self, name: str, value, rtol, atol) -> None:
        values, shape = self._host_values(value)
        entry = self.tracked.get(name)
        if entry is None:
            entry = self.tracked[name] = {"shape": shape, "rtol": rtol, "atol": atol, "steps": [],
                                          "values": []}
        if rtol is not None:
            entry["rtol"] = rtol
        if atol is not None:
            entry["atol"] = atol
        entry["steps"].append(len(self.boundaries))   # the boundary it follows: a step number in _build
        entry["values"].append(values)

    def _host_values(self, value):
        if isinstance(value, torch.Tensor):
            t = value.detach()
            shape = list(t.shape)
            if t.device.type != "cpu":
                # The report's own read must not count as the script's traffic.
                saved = (metrics.d2h_copies, metrics.d2h_bytes)
                self.internal = True
                try:
                    t = t.reshape(1).cpu() if t.dim() == 0 else t.cpu()
                finally:
                    self.internal = False
                    metrics.d2h_copies, metrics.d2h_bytes = saved
            flat = t.reshape(-1)
            if flat.numel() > TRACK_LIMIT:
                stride = math.ceil(flat.numel() / TRACK_LIMIT)
                flat = flat[::stride]
            if flat.is_complex():
                flat = flat.abs()
            return [float(x) for x in flat.to(torch.float64).tolist()], shape
        if isinstance(value, bool | int | float):
            return [float(value)], []
        try:
            arr = np.asarray(value, dtype=np.float64).reshape(-1)
            return [float(x) for x in arr[: TRACK_LIMIT]], list(np.shape(value))
        except (TypeError, ValueError):
            raise TypeError(f"torchneuron.track({value!r}): expected a number, tensor or array") from None

    # -- the run as data ------------------------------------------------------------------------
    def _build(self, t_end: float) -> dict:
        end_snapshot = _light_snapshot()
        source, optimizer = self._step_choice()
        bounds = [b for b in self.boundaries if self._is_step(b, source, optimizer)]
        steps = []
        # The first step counts from the start (of the script, or of the check() block) in every run,
        # so cold starts compare like for like: imports, set-up, uploads and compiles included.
        prev_t = self.t_start
        prev_snap = self.start_snapshot
        for b in bounds:
            d = _delta(b["snap"], prev_snap)
            steps.append({
                "seconds": b["t"] - prev_t,
                "samples": b["samples"],
                "memory": b["memory"],
                "compiles": d["executables_compiled"],
                "loads": d["eager_cache_loads"],
                "compile_seconds": d["compile_seconds"],
                "cache_hits": d["cache_hits"],
                "graphs_compiled": d["graphs_compiled"],
                "recompiles": sum(d["recompiles"].values()),
                "graph_breaks": sum(d["graph_breaks"].values()),
                "fallbacks": d["fallbacks"],
                "h2d_copies": d["h2d_copies"], "h2d_bytes": d["h2d_bytes"],
                "d2h_copies": d["d2h_copies"], "d2h_bytes": d["d2h_bytes"],
                "ops": d["op_calls"],
            })
            prev_t, prev_snap = b["t"], b["snap"]
        after = _delta(end_snapshot, prev_snap) if bounds else None

        counters = {k: counter_delta(dict(getattr(metrics, k)), self.start_counters[k])
                    for k in _TOTAL_COUNTERS}
        totals = {k: getattr(metrics, k) - self.start_scalars[k] for k in _LIGHT_SCALARS}
        totals.update(counters)

        memory = None
        if self.role == "neuron":
            n = torch.neuron.device_count()
            memory = {"devices": [{"index": i, "peak_bytes": torch.neuron.max_memory_allocated(i),
                                   "allocated_bytes": torch.neuron.memory_allocated(i)} for i in range(n)]}

        # Step numbers count from 0: the steps of the chosen source marked before the event.
        step_at = [0]
        for b in self.boundaries:
            step_at.append(step_at[-1] + self._is_step(b, source, optimizer))
        isolated = list(getattr(metrics, "fusion_isolated", ()))
        isolated = isolated[self.start_isolated:] if len(isolated) >= self.start_isolated else isolated
        tracked = {}
        for name, e in self.tracked.items():
            tracked[name] = {"shape": e["shape"], "rtol": e["rtol"], "atol": e["atol"],
                             "steps": [step_at[p] for p in e["steps"]], "values": e["values"]}
        compile_sites = []
        for e in self.compile_sites.values():
            events = [(step_at[p], reason, loaded) for p, reason, loaded in e["events"] if step_at[p] >= 1]
            if not events:
                continue
            in_steps, reasons = [], {}
            for step, reason, _ in events:
                if not in_steps or in_steps[-1] != step:
                    in_steps.append(step)
                reasons[reason] = reasons.get(reason, 0) + 1
            loaded = sum(1 for *_, was_loaded in events if was_loaded)
            compile_sites.append({"op": e["op"], "site": e["site"], "count": len(events),
                                  "compiled": len(events) - loaded, "loaded": loaded, "steps": in_steps,
                                  "reasons": reasons})

        return {
            "schema": RUN_SCHEMA,
            "role": self.role,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.wall_start)),
            "seconds": t_end - self.t_start,
            "first_activity_seconds": (self.t_first_activity - self.t_start)
            if self.t_first_activity is not None else None,
            "step_source": source,
            "step_optimizer": optimizer,
            "step_note": self._step_note(source, optimizer),
            "optimizers": [dict(o) for o in self.optimizers],
            "steps": steps,
            "after_steps": after,
            "metrics": totals,
            "sites": [{"op": op, "path": path, "site": site} for (op, path), site in self.sites.items()],
            "float64_sites": self.float64_sites,
            "failures": list(self.failures.values()),
            "fallback_costs": self.fallback_costs,
            "transfers": sorted(self.transfers.values(), key=lambda e: -e["bytes"]),
            "compile_sites": sorted(compile_sites, key=lambda e: -e["count"]),
            "tracked": tracked,
            "tolerance": {"rtol": self.rtol, "atol": self.atol},
            "memory": memory,
            "persistent_cache": dict(self.persistent_cache),
            "fusion_isolated": [dict(e) for e in isolated],
        }


class DriftCapture:
    """``torchneuron check --locate-drift``: keeps the first call of the outermost module whose
    parameters are all on the device (the module and CPU copies of its inputs), and after the
    script has ended runs ``locate_drift`` on it (in eval mode, with the model's final weights).

    The script sees nothing of it: the inputs' copies to the host are not counted as its traffic,
    nothing runs on the device until the script is over (after the run's metrics are taken), and
    the random number generators are not used. Nothing is installed unless it is asked for.
    """

    def __init__(self, collector: Collector, device: str = "neuron"):
        self.collector = collector
        self.device = device
        self.module = None
        self.inputs = None
        self.site = None
        self._stack: list[bool] = []      # per running module call: do its parameters qualify
        self._handles = []

    def install(self) -> DriftCapture:
        self._handles = [register_module_forward_pre_hook(self._enter),
                         register_module_forward_hook(self._leave, with_kwargs=True, always_call=True)]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _qualifies(self, module) -> bool:
        devices = {p.device.type for p in module.parameters()}
        return devices == {self.device}

    def _enter(self, module, args):
        self._stack.append(self._qualifies(module))

    def _leave(self, module, args, kwargs, output):
        # The call's own hooks run innermost first: a module is outermost when no module around it
        # qualifies (a CPU wrapper around the device model leaves the device model outermost).
        qualifies = self._stack.pop() if self._stack else False
        if not qualifies or any(self._stack) or output is None:   # None: the call raised
            return
        self.remove()
        self.module = module
        self.site = sites.user_site()
        col = self.collector
        saved = (metrics.d2h_copies, metrics.d2h_bytes)
        col.internal = True
        try:
            self.inputs = tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t,
                                   (tuple(args), dict(kwargs)))
        finally:
            col.internal = False
            metrics.d2h_copies, metrics.d2h_bytes = saved

    def run(self, rtol: float, atol: float) -> dict:
        """The localisation as JSON-able data (call after the script and the collector stopped)."""
        self.remove()
        if self.module is None:
            return {"captured": None, "error": None,
                    "note": f"no module with all its parameters on {self.device} was called"}
        module = self.module
        captured = {"type": type(module).__name__, "site": self.site}
        modes = {m: m.training for m in module.modules()}
        module.eval()   # dropout off, batch norm statistics untouched: both sides compute the same thing
        # A training script (an optimizer of the device's parameters stepped): gradients too.
        backward = any(o["on_device"] for o in self.collector.optimizers)
        captured["backward"] = backward
        try:
            args, kwargs = self.inputs
            try:
                found = locate_drift(module, tuple(args), rtol=rtol, atol=atol, kwargs=kwargs, backward=backward)
            except ValueError as err:
                if not backward or "backward=True" not in str(err):
                    raise
                # No floating output to take a gradient of (an output that is a dict of ints...).
                captured["backward"] = False
                found = locate_drift(module, tuple(args), rtol=rtol, atol=atol, kwargs=kwargs)
        except Exception as err:  # noqa: BLE001 - a failed localisation is the report's data
            return {"captured": captured, "error": f"{type(err).__name__}: {str(err).strip()[:2000]}"}
        finally:
            for m, mode in modes.items():
                m.training = mode
        return {"captured": captured, "error": None, "text": str(found), **_drift_data(found)}


def _drift_data(found) -> dict:
    def difference(d):
        return {"max_abs": d.max_abs, "max_rel": d.max_rel, "note": d.note,
                "elements": [{"index": list(i), "cpu": _real(c), "neuron": _real(n)} for i, c, n in d.elements]}

    out = {"rtol": found.rtol, "atol": found.atol, "drift": found.drift, "modules_compared": found.modules_compared,
           "ops_compared": found.ops_compared, "note": found.note, "module": None, "op": None}
    if found.module is not None:
        m = found.module
        out["module"] = {"name": m.name, "type": m.type, "call": m.call, "phase": m.phase, "output": m.output,
                         "difference": difference(m.difference)}
    if found.op is not None:
        o = found.op
        out["op"] = {"op": o.op, "index": o.index, "phase": o.phase, "difference": difference(o.difference),
                     "input_dtypes": o.input_dtypes, "cpu_input_dtypes": o.cpu_input_dtypes,
                     "output_dtypes": o.output_dtypes, "cpu_output_dtypes": o.cpu_output_dtypes,
                     "float64_downcast": o.float64_downcast, "upstream_float64_downcast": o.upstream_float64_downcast,
                     "cpu_fallback": o.cpu_fallback, "fused": o.fused, "site": o.site}
    return out


def _real(v):
    return str(v) if isinstance(v, complex) else float(v)


_jax_listening = False


def _listen_to_jax() -> None:
    """Count JAX persistent compilation cache hits/misses for whichever collector is active."""
    global _jax_listening
    if _jax_listening:
        return
    _jax_listening = True
    try:
        from jax import monitoring  # optional: older jax releases have no event listeners
    except ImportError:
        return

    def on_event(event, **kwargs):
        col = _active
        if col is not None and event.startswith("/jax/compilation_cache/"):
            col.persistent_cache[event.rsplit("/", 1)[1]] += 1

    def on_duration(event, duration, **kwargs):
        col = _active
        if col is not None and event == "/jax/compilation_cache/compile_time_saved_sec":
            col.persistent_cache["seconds_saved"] += duration

    monitoring.register_event_listener(on_event)
    monitoring.register_event_duration_secs_listener(on_duration)


def describe_exception(err: BaseException) -> dict:
    return {
        "type": type(err).__name__,
        "message": str(err).strip()[:4000],
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-8000:],
        "site": _exception_site(err),
    }


def _exception_site(err: BaseException):
    tb = err.__traceback__
    found = None
    while tb is not None:
        if not sites.internal(tb.tb_frame.f_code.co_filename):
            found = tb
        tb = tb.tb_next
    if found is None:
        return None
    frame = found.tb_frame
    return {"file": frame.f_code.co_filename, "line": found.tb_lineno, "function": frame.f_code.co_name,
            "code": linecache.getline(frame.f_code.co_filename, found.tb_lineno).strip()}
