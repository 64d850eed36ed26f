"""Drift localisation: which module, then which ATen op inside it, first leaves CPU's tolerance.

``locate_drift(model, inputs)`` runs the model on a CPU copy (the oracle) and on neuron with
forward hooks (and, for ``backward=True``, full backward hooks and the parameters' gradients),
compares each module's output in execution order (then its gradients in backward order), and re-runs the first drifting module op by op under a
``TorchDispatchMode`` on both sides, fed the CPU side's inputs to that module so upstream drift
does not pollute the bisection. Nothing is installed unless it is called.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..config import config
from ..metrics import metrics
from ..runtime import sites


@dataclass
class Difference:
    """How far neuron's value is from CPU's: the worst elements as (index, cpu, neuron)."""
    max_abs: float
    max_rel: float
    elements: list = field(default_factory=list)
    note: str = ""

    def text(self) -> str:
        if self.note:
            return self.note
        worst = ", ".join(f"[{','.join(map(str, i))}] cpu={c:.8g} neuron={n:.8g}" for i, c, n in self.elements)
        return f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}; worst: {worst}"


@dataclass
class ModuleDrift:
    name: str          # qualified name in the model ("" is the model itself)
    type: str
    call: int          # which call of this module (shared modules run more than once)
    phase: str         # "forward", or "backward (input gradient)" / "(output gradient)" / "(gradient of weight)"
    output: int        # index of the drifting tensor among the module's flattened outputs
    difference: Difference


@dataclass
class OpDrift:
    op: str                   # ATen overload, e.g. "aten.sub.Tensor"
    index: int                # position among the module's ATen ops (0-based)
    phase: str
    difference: Difference
    input_dtypes: list        # neuron's
    cpu_input_dtypes: list
    output_dtypes: list       # neuron's
    cpu_output_dtypes: list
    float64_downcast: bool    # config.float64 ran a float64 result as float32
    upstream_float64_downcast: bool   # an earlier op in the module was downcast
    cpu_fallback: bool        # the op ran through the counted CPU fallback
    fused: bool               # recorded into an adaptive eager region
    site: dict | None         # the user's source line


@dataclass
class DriftReport:
    rtol: float
    atol: float
    backward: bool
    modules_compared: int
    module: ModuleDrift | None = None
    op: OpDrift | None = None
    ops_compared: int = 0
    note: str = ""

    @property
    def drift(self) -> bool:
        return self.module is not None

    def __str__(self) -> str:
        tol = f"rtol={self.rtol:g}, atol={self.atol:g}"
        what = "forward and backward" if self.backward else "forward"
        if self.module is None:
            return (f"No drift: {self.modules_compared} module outputs ({what}) match CPU within {tol}."
                    + (f"\n{self.note}" if self.note else ""))
        m = self.module
        label = m.name or "(model)"
        lines = [f"Drift ({tol}): first module leaving the tolerance: {label} ({m.type}), call {m.call}, "
                 f"{m.phase}, tensor {m.output}: {m.difference.text()}"]
        if self.op is None:
            lines.append(f"  no single ATen op of it was found leaving the tolerance when re-run from CPU's "
                         f"inputs ({self.ops_compared} ops compared): "
                         + (self.note or "the error accumulates across ops."))
            return "\n".join(lines)
        o = self.op
        flags = []
        if o.float64_downcast:
            flags.append(f"float64 was downcast to float32 (config.float64={config.float64!r})")
        elif o.upstream_float64_downcast:
            flags.append("an earlier op of this module had float64 downcast to float32")
        if o.cpu_fallback:
            flags.append("ran as a CPU fallback")
        if o.fused:
            flags.append("ran inside an adaptive fused region")
        lines += [
            f"  first op leaving the tolerance: {o.op} (op {o.index} of {self.ops_compared}, {o.phase})",
            f"    {o.difference.text()}",
            f"    dtypes: neuron {o.input_dtypes} -> {o.output_dtypes}; cpu {o.cpu_input_dtypes} -> {o.cpu_output_dtypes}",
            f"    at {sites.format_site(o.site)}" + (f": {o.site['code']}" if o.site and o.site.get("code") else ""),
        ]
        if flags:
            lines.append("    " + "; ".join(flags))
        return "\n".join(lines)


def _tensors(value) -> list:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


def compare(cpu: torch.Tensor, dev: torch.Tensor, rtol: float, atol: float) -> Difference | None:
    """None when ``dev`` matches ``cpu`` (|dev - cpu| <= atol + rtol * |cpu|, NaN where CPU has NaN);
    otherwise how far apart they are."""
    dev = dev.detach().to("cpu")
    cpu = cpu.detach()
    if cpu.shape != dev.shape:
        return Difference(math.inf, math.inf, note=f"shapes differ: cpu {tuple(cpu.shape)}, neuron {tuple(dev.shape)}")
    if cpu.numel() == 0:
        return None
    wide = torch.complex128 if (cpu.is_complex() or dev.is_complex()) else torch.float64
    a, b = cpu.to(wide), dev.to(wide)
    err = (a - b).abs()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    same_inf = torch.isinf(a) & (a == b)
    err = torch.where(nan_a & nan_b | same_inf, 0.0, err)
    err = torch.where(nan_a ^ nan_b, math.inf, err)
    bad = err > atol + rtol * a.abs()
    if not bool(bad.any()):
        return None
    flat_err = err.reshape(-1)
    rel = (flat_err / a.abs().reshape(-1).clamp_min(torch.finfo(torch.float64).tiny))
    worst = torch.topk(torch.nan_to_num(flat_err, posinf=math.inf), min(3, flat_err.numel())).indices
    elements = []
    for i in worst.tolist():
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), cpu.shape)) if cpu.dim() else ()
        ca, cb = a.reshape(-1)[i], b.reshape(-1)[i]
        elements.append((idx, complex(ca).real if wide == torch.float64 else complex(ca),
                         complex(cb).real if wide == torch.float64 else complex(cb)))
    return Difference(float(flat_err.max()), float(rel.max()), elements)


def _recorded_ops() -> int | None:
    """Ops adaptive eager has recorded into regions so far (pending ones too); None in plain mode."""
    if config.eager_mode != "adaptive":
        return None
    from ..eager.adaptive import recorder  # loaded already: adaptive mode is on
    return metrics.region_ops + len(recorder.region.ops)


class _Recorder(TorchDispatchMode):
    """Records every ATen op's outputs in order, with the dtype path and counters around it."""

    def __init__(self):
        super().__init__()
        self.ops: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fallbacks = sum(metrics.fallbacks.values())
        downcasts = sum(metrics.float64_downcasts.values())
        recorded = _recorded_ops()
        out = func(*args, **kwargs)
        self.ops.append({
            "op": str(func),
            "outputs": [t.detach() for t in _tensors(out)],
            "input_dtypes": [_dtype(t) for t in _tensors((args, kwargs))],
            "fallback": sum(metrics.fallbacks.values()) > fallbacks,
            "downcast": sum(metrics.float64_downcasts.values()) > downcasts,
            "fused": recorded is not None and _recorded_ops() > recorded,
            "site": sites.user_site(2),
        })
        return out


def _to(value, device):
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        moved = t.detach().to(device)
        return moved.requires_grad_(t.requires_grad) if moved.is_floating_point() or moved.is_complex() else moved
    return tree_map(move, value)


def _loss(output, loss_fn):
    if loss_fn is not None:
        return loss_fn(output)
    floats = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError("locate_drift(backward=True): the model's output has no floating tensor that "
                         "requires grad; pass loss_fn=... that returns a scalar loss.")
    return sum(t.float().sum() for t in floats)


def _keep(t):
    if not isinstance(t, torch.Tensor):
        return t
    kept = t.detach().clone()
    return kept.requires_grad_() if t.requires_grad else kept


class _Run:
    """One side's run: each module call's inputs and outputs, and with ``backward`` each module's
    gradients (of its outputs, its inputs and its own parameters) in the order backward made them."""

    def __init__(self, model, keep_inputs: bool, backward: bool):
        self.calls: list[tuple] = []     # (name, call, type) in forward completion order
        self.inputs: dict = {}
        self.outputs: dict = {}
        self.backward: dict = {}         # (name, backward call) -> (grad_output, grad_input)
        self.backward_order: list = []
        self.param_grads: dict = {}      # parameter name -> gradient of the loss
        self._counts: dict = {}
        self._backward_counts: dict = {}
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_hook(
                self._hook(name, keep_inputs), with_kwargs=True))
            if backward:
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def _hook(self, name, keep_inputs):
        def hook(module, args, kwargs, output):
            call = self._counts.get(name, 0)
            self._counts[name] = call + 1
            key = (name, call)
            self.calls.append((name, call, type(module).__name__))
            if keep_inputs:   # the op-level re-run starts from these
                self.inputs[key] = tree_map(_keep, (args, kwargs))
            self.outputs[key] = [t.detach() for t in _tensors(output)]
        return hook

    def _backward_hook(self, name):
        def hook(module, grad_input, grad_output):
            call = self._backward_counts.get(name, 0)
            self._backward_counts[name] = call + 1
            detach = [None if g is None else g.detach() for g in grad_output]
            self.backward[(name, call)] = (detach, [None if g is None else g.detach() for g in grad_input])
            self.backward_order.append((name, call))
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def _run(model, inputs, keep_inputs, backward, loss_fn):
    run = _Run(model, keep_inputs, backward)
    try:
        args, kwargs = inputs
        with torch.set_grad_enabled(backward):
            output = model(*args, **kwargs)
            if backward:
                named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                loss = _loss(output, loss_fn)
                # autograd.grad, not backward(): the user's .grad stays as it was
                grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                run.param_grads = {n: g for (n, _), g in zip(named, grads) if g is not None}
    finally:
        run.remove()
    return run


def _device_of(model) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("neuron")


def locate_drift(model, inputs, baseline: str = "cpu", *, rtol: float = 1e-4, atol: float = 1e-5,
                 backward: bool = False, loss_fn=None, kwargs: dict | None = None) -> DriftReport:
    """Find the first module, and the first ATen op inside it, whose neuron result leaves CPU's
    tolerance. ``inputs``: a tensor or a tuple of positional arguments (``kwargs`` for keyword
    ones), on neuron or CPU. ``backward=True`` also compares each module output's gradient of
    ``loss_fn(output)`` (default: the sum of the floating outputs). Returns a :class:`DriftReport`;
    ``print()`` it for the readable text."""
    if baseline != "cpu":
        raise ValueError(f"locate_drift: baseline={baseline!r} is not supported; CPU is the oracle "
                         "(baseline='cpu').")
    device = _device_of(model)
    if device.type == "cpu":
        raise ValueError("locate_drift: the model is on CPU; move it to neuron first (model.to('neuron')).")
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    cpu_model = copy.deepcopy(model).to("cpu")
    cpu_in = _to((args, kwargs or {}), "cpu")
    dev_in = _to((args, kwargs or {}), device)
    cpu = _run(cpu_model, cpu_in, True, backward, loss_fn)
    dev = _run(model, dev_in, False, backward, loss_fn)
    if [c[:2] for c in cpu.calls] != [c[:2] for c in dev.calls]:
        raise RuntimeError("locate_drift: the model ran different modules on CPU and on neuron "
                           "(data-dependent control flow?); compare a smaller part of it.")
    report = DriftReport(rtol=rtol, atol=atol, backward=backward, modules_compared=len(cpu.calls))
    found = _first_module(cpu, dev, rtol, atol, backward, cpu_model)
    if found is None:
        return report
    report.module = found
    modules = dict(model.named_modules())
    cpu_modules = dict(cpu_model.named_modules())
    key = (found.name, found.call)
    grads = None
    if found.phase.startswith("backward"):
        grads = cpu.backward[(found.name, _backward_call(cpu, found.name, found.call))][0]
    _bisect_ops(report, cpu_modules[found.name], modules[found.name], cpu.inputs[key], device, grads)
    return report


def _backward_call(run, name, call) -> int:
    """Backward hooks number a module's calls in backward order: the last forward call is 0."""
    return sum(1 for c in run.calls if c[0] == name) - 1 - call


def _first_module(cpu, dev, rtol, atol, backward, model) -> ModuleDrift | None:
    for name, call, kind in cpu.calls:
        for i, (c, d) in enumerate(zip(cpu.outputs[(name, call)], dev.outputs[(name, call)])):
            diff = compare(c, d, rtol, atol)
            if diff is not None:
                return ModuleDrift(name, kind, call, "forward", i, diff)
    if not backward:
        return None
    modules = dict(model.named_modules())
    # The first module, in the order backward reached it, whose gradients (of its inputs or its own
    # parameters) drift; one whose output gradient already drifts got it from code between modules.
    for name, bw_call in cpu.backward_order:
        if (name, bw_call) not in dev.backward:
            continue
        (c_out, c_in), (d_out, d_in) = cpu.backward[(name, bw_call)], dev.backward[(name, bw_call)]
        call = _backward_call(cpu, name, bw_call)   # the same map turns it back into the forward call
        kind = type(modules[name]).__name__
        for what, cs, ds in (("output gradient", c_out, d_out), ("input gradient", c_in, d_in)):
            for i, (c, d) in enumerate(zip(cs, ds)):
                diff = c is not None and d is not None and compare(c, d, rtol, atol)
                if diff:
                    return ModuleDrift(name, kind, call, f"backward ({what})", i, diff)
        prefix = f"{name}." if name else ""
        for i, (pname, _) in enumerate(modules[name].named_parameters(recurse=False)):
            c, d = cpu.param_grads.get(prefix + pname), dev.param_grads.get(prefix + pname)
            diff = c is not None and d is not None and compare(c, d, rtol, atol)
            if diff:
                return ModuleDrift(name, kind, call, f"backward (gradient of {pname})", i, diff)
    return None


def _rerun(module, inputs, grads, device):
    """Run ``module`` on ``inputs`` (and its backward from ``grads``) under a recorder."""
    args, kwargs = inputs
    grads = None if grads is None else [None if g is None else g.to(device) for g in grads]   # not recorded
    recorder = _Recorder()
    with torch.set_grad_enabled(grads is not None), recorder:
        out = module(*args, **kwargs)
        forward_ops = len(recorder.ops)
        if grads is not None:
            pairs = [(o, g) for o, g in zip(_tensors(out), grads) if g is not None and o.requires_grad]
            leaves = [p for p in module.parameters() if p.requires_grad] + [
                t for t in _tensors(inputs) if t.requires_grad]
            if pairs and leaves:
                torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return recorder.ops, forward_ops


def _bisect_ops(report, cpu_module, dev_module, inputs, device, grads):
    cpu_ops, cpu_forward = _rerun(cpu_module, _to(inputs, "cpu"), grads, "cpu")
    dev_ops, _ = _rerun(dev_module, _to(inputs, device), grads, device)
    report.ops_compared = min(len(cpu_ops), len(dev_ops))
    downcast_seen = False
    for i, (c, d) in enumerate(zip(cpu_ops, dev_ops)):
        if c["op"] != d["op"]:
            report.note = (f"the op sequences part at op {i} (cpu {c['op']}, neuron {d['op']}); "
                           "ops after it were not compared.")
            return
        cpu_dtypes = [_dtype(t) for t in c["outputs"]]
        dev_dtypes = [_dtype(t) for t in d["outputs"]]
        downcast = d["downcast"] or any(
            a == "float64" and b == "float32" for a, b in zip(cpu_dtypes, dev_dtypes))
        for ct, dt in zip(c["outputs"], d["outputs"]):
            diff = compare(ct, dt, report.rtol, report.atol)
            if diff is not None:
                report.op = OpDrift(
                    op=d["op"], index=i, phase="forward" if i < cpu_forward else "backward",
                    difference=diff, input_dtypes=d["input_dtypes"], cpu_input_dtypes=c["input_dtypes"],
                    output_dtypes=dev_dtypes,
                    cpu_output_dtypes=cpu_dtypes, float64_downcast=downcast,
                    upstream_float64_downcast=downcast_seen, cpu_fallback=d["fallback"], fused=d["fused"],
                    site=d["site"])
                return
        downcast_seen = downcast_seen or downcast
