"""``torchneuron.kernel``: a JAX function registered as a PyTorch custom op.

The op is a real ``torch.library`` custom op (the result *is* a ``CustomOpDef``), with:

* the schema ``torch.library.custom_op`` infers from the annotations;
* a neuron (PrivateUse1) kernel: an eager ``Kernel`` whose lowering is the JAX body, so calls go
  through the eager executable cache (keys, metrics, runtime Scalars, adaptive-eager fusion) like
  any ATen op, and torch.compile graphs lower it with the same body;
* a CPU kernel running the same body on the host (``host.py``);
* a fake/meta kernel from ``jax.eval_shape`` of the body;
* autograd from ``jax.vjp`` or ``backward=`` (``grad.py``).
"""

from __future__ import annotations

import importlib

import jax
import torch
from torch._library import utils as library_utils
from torch._library.custom_ops import CustomOpDef

from ..eager.kernel import Kernel
from ..metrics import metrics
from ..ops.registry import Lowering
from ..ops.signature import register_signature
from ..runtime.dtypes import jax_dtype, torch_dtype
from . import grad
from .body import SCALAR, SCALAR_LIST, STATIC, TENSOR, TENSOR_LIST, Body, KernelError, describe_value
from .host import HostKernel, returned, schema_values

_KEYS = {"neuron": torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1),
         "cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
         "meta": torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)}

# qualname -> JaxKernel, for every kernel registered in this process (forward and backward).
_REGISTRY: dict[str, JaxKernel] = {}


class NeuronKernel(Kernel):
    """The PrivateUse1 kernel of a custom op: an eager ``Kernel`` whose lowering is the JAX body."""

    # The body is user code, which the persistent cache's fingerprint does not cover.
    persistent = False

    def __init__(self, overload, body: Body):
        super().__init__(overload, Lowering(name=body.qualname, fn=body, derive_variants=False))
        # Metrics, profiler ranges and messages name the op with its namespace ("mylib::rms_norm").
        self.short_name = self.name
        self.body = body

    def first_call(self, exe, bufs, runtime, values, device_index):
        results = super().first_call(exe, bufs, runtime, values, device_index)
        metrics.custom_kernel_compiles[self.name] += 1
        return results

    def compile_error(self, values, err) -> Exception:
        if isinstance(err, KernelError):
            return err
        return KernelError(
            f"torchneuron kernel {self.name}: JAX could not compile it for inputs "
            f"({self.body.describe(values)}): {type(err).__name__}: {err}")


class JaxKernel(CustomOpDef):
    """A custom op whose implementation is a JAX function (what ``torchneuron.kernel`` returns).

    Call it like the function it decorates, or as ``torch.ops.<ns>.<name>``. ``jax_fn`` is the
    JAX function itself (for testing it with JAX directly).
    """

    def __init__(self, qualname: str, fn, schema: str, *, mutates_args=(), backward=None, tags=(),
                 defined_at: str = ""):
        namespace, name = qualname.split("::")
        super().__init__(namespace, name, schema, fn, tags)
        self.jax_fn = fn
        self.backward_fn = backward
        self.defined_at = defined_at
        overload = self._opoverload
        self.body = body = Body(qualname, fn, overload._schema, on_device=True)
        self.neuron_kernel = NeuronKernel(overload, body)
        self.host_kernel = HostKernel(body, overload._schema)
        self._lib.impl(name, self._neuron_impl(), "PrivateUse1")
        self._lib.impl(name, self.host_kernel, "CPU")
        if not library_utils.has_tensor_arg(overload._schema):
            self._lib.impl(name, self._backend_select(qualname), "BackendSelect", with_keyset=True)
        self.register_fake(self._fake)
        register_signature(overload, self.neuron_kernel)   # how torch.compile graphs lower it
        self._static = [(a.name, i) for i, (a, k) in enumerate(zip(overload._schema.arguments, body.kinds))
                        if k == STATIC]
        self.backward_op = None

    def _backend_select(self, qualname):
        # No tensor argument tells the dispatcher the device: the ``device`` argument does.
        index = library_utils.get_device_arg_index(self._opoverload._schema)
        op = self._opoverload

        def backend_select(keyset, *args, **kwargs):
            device = torch.device(args[index] if index < len(args) else kwargs["device"])
            key = _KEYS.get(device.type)
            if key is None:
                raise KernelError(f"torchneuron kernel {qualname} runs on neuron and cpu, not on {device}")
            return op.redispatch(key, *args, **kwargs)
        return backend_select

    def _neuron_impl(self):
        kernel, name = self.neuron_kernel, self._qualname

        def neuron(*args, **kwargs):
            metrics.custom_kernel_calls[name] += 1
            return kernel(*args, **kwargs)
        return neuron

    # -- calling -------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._static:
            self._check_static(args, kwargs)
        return self._opoverload(*args, **kwargs)

    def _check_static(self, args, kwargs):
        # PyTorch would quietly turn a one-element tensor into the number (and compile its value
        # in, one executable per value): say so instead.
        for name, i in self._static:
            v = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(v, torch.Tensor):
                arg = self._opoverload._schema.arguments[i]
                raise KernelError(
                    f"torchneuron kernel {self._qualname}: argument {name!r} is declared {arg.type} (a static "
                    f"value compiled into the kernel) but got a tensor {describe_value(v)}. Pass a Python "
                    f"value (t.item()), or declare it torch.Tensor to make it a traced input, or "
                    f"torch.types.Number for a runtime scalar.")

    def __reduce__(self):
        # Pickled by name: loading finds the kernel registered by the module that defines it.
        return (_load, (self._qualname, getattr(self.jax_fn, "__module__", None)))

    def __repr__(self):
        return f"<torchneuron kernel {self._qualname}>"

    # -- fake tensors ------------------------------------------------------------------------------
    def _fake(self, *args, **kwargs):
        body = self.body
        values = schema_values(self._opoverload._schema, args, kwargs)
        device = _output_device(values)
        dyn_idx = [i for i, k in enumerate(body.kinds) if k in (TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST)]
        template = [_concrete(v) for v in values]
        for i in dyn_idx:
            template[i] = None

        def run(*dyn):
            vals = list(template)
            for i, v in zip(dyn_idx, dyn):
                vals[i] = v
            return body.flatten(body.run(vals), vals)

        run.__name__ = self._qualname.replace("::", "_")
        shapes = jax.eval_shape(run, *[_shape_struct(values[i]) for i in dyn_idx])
        n_mut = _count_mutated(body, values)
        outs = []
        for s in shapes[n_mut:]:
            try:
                dtype = torch_dtype(s.dtype)
            except KeyError:
                raise KernelError(
                    f"torchneuron kernel {self._qualname} returns an array of dtype {s.dtype}, which has no "
                    f"PyTorch counterpart on neuron. Inputs: ({body.describe(values)})") from None
            outs.append(torch.empty(s.shape, dtype=dtype, device=device))
        return returned(body, outs)


def _count_mutated(body, values) -> int:
    n = 0
    for i in body.mutated:
        v = values[i]
        if body.kinds[i] == TENSOR_LIST:
            n += sum(1 for x in v if x is not None)
        elif v is not None:
            n += 1
    return n


def _output_device(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
        if isinstance(v, list | tuple):
            for x in v:
                if isinstance(x, torch.Tensor):
                    return x.device
    for v in values:
        if isinstance(v, torch.device):
            return v
    return torch.device("cpu")


def _concrete(v):
    if isinstance(v, torch.SymInt | torch.SymBool):
        return int(v) if isinstance(v, torch.SymInt) else bool(v)
    if isinstance(v, torch.SymFloat):
        return float(v)
    if isinstance(v, list | tuple):
        return type(v)(_concrete(x) for x in v)
    return v


def _shape_struct(v):
    if isinstance(v, torch.Tensor):
        # The neuron backend compiles static shapes: symbolic sizes are specialised here.
        return jax.ShapeDtypeStruct(tuple(int(s) for s in v.shape), jax_dtype(v.dtype))
    if isinstance(v, list | tuple):
        return [_shape_struct(x) for x in v]
    return _concrete(v)


def _load(qualname: str, module: str | None):
    k = _REGISTRY.get(qualname)
    if k is None and module:
        importlib.import_module(module)
        k = _REGISTRY.get(qualname)
    if k is None:
        raise KernelError(
            f"torchneuron kernel {qualname} is not registered in this process"
            + (f" (importing {module!r} did not register it)" if module else "")
            + ": import the module that defines it before loading.")
    return k


# -- the decorator -------------------------------------------------------------------------------
def kernel(name: str, fn=None, /, *, mutates_args=(), backward=None, tags=()):
    """Register a JAX function as the PyTorch custom op ``name`` ("namespace::op_name").

    Shaped like ``torch.library.custom_op``: the function's annotations (``torch.Tensor``, int,
    float, bool, ``torch.types.Number``, ...) give the op's schema; its body receives
    ``jax.Array`` for each tensor and returns ``jax.Array`` results -- after the new values of the
    arguments named in ``mutates_args``, in signature order. ``backward`` is an optional JAX
    function of (the kernel's arguments..., one gradient per result) returning one gradient per
    argument; without it gradients come from ``jax.vjp``. See docs/kernels.md.
    """
    if isinstance(mutates_args, str) and mutates_args != "unknown":
        mutates_args = (mutates_args,)

    def register(fn):
        qualname = _check_name(name, fn)
        if mutates_args == "unknown":
            raise KernelError(f"torchneuron kernel {qualname}: mutates_args='unknown' cannot work for a JAX "
                              "function (it cannot mutate anything): name the arguments it returns new values for.")
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        parsed = torch._C.parse_schema(qualname.split("::")[1] + schema)
        if Body(qualname, fn, parsed).returns == "unsupported":
            raise KernelError(
                f"torchneuron kernel {qualname}: a kernel returns tensors; declare -> Tensor, "
                f"-> tuple[Tensor, ...], -> list[Tensor] or -> None (got {parsed}).")
        if not library_utils.has_tensor_arg(parsed) and library_utils.get_device_arg_index(parsed) is None:
            raise KernelError(f"torchneuron kernel {qualname}: a kernel without tensor arguments needs a "
                              "`device: torch.device` argument (the device its results live on).")
        where = _where(fn)
        _unregister(qualname)
        op = JaxKernel(qualname, fn, schema, mutates_args=mutates_args, backward=backward, tags=tags,
                       defined_at=where)
        _REGISTRY[qualname] = op
        if op.body.mutated:
            if backward is not None:
                raise KernelError(f"torchneuron kernel {qualname}: backward= is not supported for a kernel that "
                                  "mutates its arguments (PyTorch has no autograd for mutable custom ops); make "
                                  "it functional (return new tensors) to differentiate it.")
            return op
        schema_text, _, _ = grad.backward_schema(schema, op.body.names)
        bw_name = f"{qualname}_backward"
        _check_free(bw_name, f"the backward of {qualname}")
        _unregister(bw_name)
        bw = JaxKernel(bw_name, grad.make_backward_fn(op.body, backward), schema_text, defined_at=where)
        bw.forward_op = op
        _REGISTRY[bw_name] = bw
        op.backward_op = bw
        grad.install(op, bw)
        return op

    if fn is None:
        return register
    return register(fn)


def _where(fn) -> str:
    code = getattr(fn, "__code__", None)
    mod = getattr(fn, "__module__", "?")
    qual = getattr(fn, "__qualname__", repr(fn))
    return f"{mod}.{qual}" + (f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else "")


def _identity(fn):
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))


def _check_name(name, fn) -> str:
    if not isinstance(name, str) or name.count("::") != 1 or not all(p.isidentifier() for p in name.split("::")):
        raise KernelError(f"torchneuron.kernel: the name must be 'namespace::op_name' (identifiers), got {name!r}")
    if not callable(fn):
        raise KernelError(f"torchneuron kernel {name}: decorate a function, got {fn!r}")
    existing = _REGISTRY.get(name)
    if existing is not None and _identity(existing.jax_fn) != _identity(fn):
        raise KernelError(
            f"torchneuron kernel {name} is registered twice: first by {existing.defined_at}, now by "
            f"{_where(fn)}. Kernel names are global in the process (torch.ops.{name.replace('::', '.')}); "
            "give one of them another name.")
    if existing is None:
        _check_free(name, "this kernel")
    return name


def _check_free(qualname, what):
    """Refuse a name an op not made by torchneuron.kernel already has (an ATen op, another
    library's custom op)."""
    if qualname in _REGISTRY:
        return
    ns, op = qualname.split("::")
    try:
        getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        return
    raise KernelError(f"torchneuron kernel {qualname}: {what} would be registered under the name of an existing "
                      f"operator torch.ops.{ns}.{op}; choose another name.")


def _unregister(qualname):
    # Re-running a definition (a notebook cell, importlib.reload) replaces it, as
    # torch.library.custom_op does; CustomOpDef drops the previous definition's library.
    old = _REGISTRY.pop(qualname, None)
    if old is not None:
        register_signature(old._opoverload, None)


def registered() -> dict[str, JaxKernel]:
    """Every kernel registered in this process, by name (backward kernels included)."""
    return dict(_REGISTRY)

