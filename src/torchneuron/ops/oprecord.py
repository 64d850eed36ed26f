"""One record per ATen op: every fact that decides how it runs, reachable from one entry.

``record("index.Tensor")`` (or ``records(platform)`` for all of them) gives an ``OpRecord``: the
op's lowering (``registry``) and where it was registered, the eager kernel it gets and the special
cases wrapped around it (``EAGER`` below), the functional op an in-place/``out=`` variant derives
from, its device-index rule (``devices.DEVICE_INDEX``), its torch.compile graph kind
(``GRAPH_KINDS`` below) and the dtypes CPU refuses for it (``cpu_dtype_refusals``).
``python -m torchneuron.where OP`` prints them with the file and line of each.

The ops layer *declares* the eager policies, by name; ``eager/registration.py`` supplies their
implementations (the kernels written by hand stay in ``eager/``) and registers one kernel per
record, in a loop over ``records()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import cpu_dtypes, devices, registry
from .registry import Lowering
from .signature import aten_overload, is_composite_implicit, lowers_in_eager, registry_name, variants_of

# -- eager kernels ---------------------------------------------------------------------------------
# What an op's PrivateUse1 kernel is. Besides these: "<module>.<function>", a kernel written by hand
# in eager/<module>.py; and None, no kernel (the global fallback: decomposition, else the CPU).
LOWERED = "lowered"      # a Kernel (eager/kernel.py) over the op's own lowering
INPLACE = "in-place"     # a Kernel over the lowering of its functional op, derived from the schema
OUT = "out="             # an OutKernel (eager/out_variants.py) around the functional op's kernel
METADATA = "metadata"    # PyTorch's CPU kernel, redispatched: it only builds sizes/strides on the storage
RUNTIME_LR = "runtime-lr"   # the kernel of the ``tensor_lr`` overload, with a float lr as a 0-dim tensor


@dataclass(frozen=True, kw_only=True)
class EagerPolicy:
    """An op's eager special cases. Wrappers apply in the order of the fields below."""
    # The kernel, when it is not the one its lowering gives: METADATA, "<module>.<function>" (written
    # by hand in eager/), or RUNTIME_LR (with ``via``).
    kernel: str | None = None
    via: str | None = None              # RUNTIME_LR: the overload whose kernel runs
    # Masks and CPU index tensors are turned into device positions first (eager/host_ops.py); for
    # index_put, ``x[mask] = scalar`` becomes this masked_fill overload's kernel.
    host_indices: bool = False
    masked_fill: str | None = None
    # linalg ``*_ex``: with check_errors=True, ``info`` is read back and checked (api, info index).
    checked_errors: tuple[str, int] | None = None
    # Positions of the tensors whose lazy conj/neg bits are resolved first: PyTorch's math-bit
    # fallbacks let these ops through with the bit still set (CPU folds it into BLAS).
    math_bits: tuple[int, ...] | None = None
    # copy_ honours the conj/neg bits of its source and of its destination.
    copy_math_bits: bool = False

    def wrappers(self) -> tuple[str, ...]:
        return tuple(n for n, on in (("host_indices", self.host_indices),
                                     ("checked_errors", self.checked_errors is not None),
                                     ("math_bits", self.math_bits is not None),
                                     ("copy_math_bits", self.copy_math_bits)) if on)


_PLAIN = EagerPolicy()


def _metadata():
    return EagerPolicy(kernel=METADATA)


def _hand(kernel, **wrappers):
    return EagerPolicy(kernel=kernel, **wrappers)


# Op -> its eager special cases. An op not listed runs the kernel its lowering gives (or none).
EAGER: dict[str, EagerPolicy] = {
    # Metadata-only ops: their CPU kernel builds sizes/strides on the same storage.
    "view.default": _metadata(),
    "as_strided.default": _metadata(),
    "_reshape_alias.default": _metadata(),
    "unfold.default": _metadata(),
    "view_as_real.default": _metadata(),
    "view_as_complex.default": _metadata(),
    "set_.source_Storage": _metadata(),
    "set_.source_Storage_storage_offset": _metadata(),
    "as_strided_.default": _metadata(),
    # Allocation, copies, .item(), resizes, storage sharing (eager/storage_ops.py). set_(tensor)
    # shares the source's storage and set_() makes an empty one on the tensor's device (through
    # CPU's kernels, set_(tensor) got a copy and set_() a CPU storage).
    "empty.memory_format": _hand("storage_ops.empty_memory_format"),
    "empty_strided.default": _hand("storage_ops.empty_strided"),
    "copy_.default": _hand("storage_ops.copy_", copy_math_bits=True),
    "_to_copy.default": _hand("storage_ops.to_copy"),
    "_copy_from.default": _hand("storage_ops.copy_from", math_bits=(0,)),
    "_local_scalar_dense.default": _hand("storage_ops.local_scalar_dense"),
    "resize_.default": _hand("storage_ops.resize_"),
    "set_.source_Tensor": _hand("storage_ops.set_tensor_"),
    "set_.default": _hand("storage_ops.set_empty_"),
    "is_set_to.default": _hand("storage_ops.is_set_to"),
    "_lazy_clone.default": _hand("storage_ops.lazy_clone"),
    # Data-dependent shapes and host-side decisions (eager/host_ops.py, eager/data_dependent.py).
    "index.Tensor": EagerPolicy(host_indices=True),
    # _unsafe_index(_put) are index(_put) without bounds checks (CompositeExplicitAutograd over
    # them in ATen): CUDA takes their indices on the CPU as it does index's.
    "_unsafe_index.Tensor": EagerPolicy(host_indices=True),
    "_unsafe_index_put.default": EagerPolicy(host_indices=True, masked_fill="masked_fill.Tensor"),
    "index_put.default": EagerPolicy(host_indices=True, masked_fill="masked_fill.Tensor"),
    "index_put_.default": EagerPolicy(host_indices=True, masked_fill="masked_fill_.Tensor"),
    "_index_put_impl_.default": EagerPolicy(host_indices=True, masked_fill="masked_fill_.Tensor"),
    "nonzero.default": _hand("host_ops.nonzero"),
    "masked_select.default": _hand("host_ops.masked_select"),
    "_fused_sdp_choice.default": _hand("host_ops.fused_sdp_choice"),
    "repeat_interleave.Tensor": _hand("host_ops.repeat_interleave_tensor"),
    "bincount.default": _hand("data_dependent.bincount"),
    "_unique2.default": _hand("data_dependent.unique2"),
    "_unique.default": _hand("data_dependent.unique"),
    "unique_dim.default": _hand("data_dependent.unique_dim"),
    "unique_consecutive.default": _hand("data_dependent.unique_consecutive"),
    "unique_dim_consecutive.default": _hand("data_dependent.unique_dim_consecutive"),
    "equal.default": _hand("data_dependent.equal"),
    # A float lr would be compiled into the executable (every step of an LR schedule would compile
    # anew): the tensor_lr form takes it as a runtime input.
    "_fused_adamw_.default": EagerPolicy(kernel=RUNTIME_LR, via="_fused_adamw_.tensor_lr"),
    "_fused_adam_.default": EagerPolicy(kernel=RUNTIME_LR, via="_fused_adam_.tensor_lr"),
    # The linalg ``*_ex`` ops raise ATen's LinAlgError with check_errors=True (functional and out=).
    "linalg_inv_ex.default": EagerPolicy(checked_errors=("linalg.inv_ex", 1)),
    "linalg_inv_ex.inverse": EagerPolicy(checked_errors=("linalg.inv_ex", 1)),
    "linalg_cholesky_ex.default": EagerPolicy(checked_errors=("linalg.cholesky_ex", 1)),
    "linalg_cholesky_ex.L": EagerPolicy(checked_errors=("linalg.cholesky_ex", 1)),
    "linalg_lu_factor_ex.default": EagerPolicy(checked_errors=("torch.linalg.lu_factor_ex", 2)),
    "linalg_lu_factor_ex.out": EagerPolicy(checked_errors=("torch.linalg.lu_factor_ex", 2)),
    "_linalg_solve_ex.default": EagerPolicy(checked_errors=("torch.linalg.solve_ex", 3)),
    "_linalg_solve_ex.result": EagerPolicy(checked_errors=("torch.linalg.solve_ex", 3)),
    # Lazy conj/neg bits resolved first (checking them costs ~1 us per tensor, so only these pay);
    # the products' in-place and out= forms read the same inputs (a conj view into
    # torch.mm(..., out=) was read unconjugated).
    "clone.default": EagerPolicy(math_bits=(0,)),
    **{f"{op}{form}": EagerPolicy(math_bits=inputs)
       for op, inputs, forms in (("mm", (0, 1), (".default", ".out")), ("bmm", (0, 1), (".default", ".out")),
                                 ("dot", (0, 1), (".default", ".out")), ("vdot", (0, 1), (".default", ".out")),
                                 ("addmm", (0, 1, 2), (".default", "_.default", ".out")),
                                 ("baddbmm", (0, 1, 2), (".default", "_.default", ".out")),
                                 ("linalg_solve_triangular", (0, 1), (".default", ".out")))
       for form in forms},
}

# -- torch.compile graph nodes ----------------------------------------------------------------------
NOOP = "noop"            # only checks metadata at trace time: dropped from the graph
SYM = "sym"              # a Python int known from the fake tensors (shapes are static)
INDEX_PUT = "index_put"  # an index_put node (its indices may hold None)
OP = "op"                # any other op with a lowering (or derived in-place lowering)
GRAPH_KINDS: dict[str, str] = {
    "_assert_tensor_metadata.default": NOOP, "_assert_scalar.default": NOOP,
    "_functional_assert_async.msg": NOOP, "_assert_async.default": NOOP, "_assert_async.msg": NOOP,
    "sym_constrain_range_for_size.default": NOOP, "sym_constrain_range.default": NOOP,
    "_print.default": NOOP,
    "sym_size.int": SYM, "sym_numel.default": SYM, "sym_stride.int": SYM, "sym_storage_offset.default": SYM,
    "index_put.default": INDEX_PUT, "_unsafe_index_put.default": INDEX_PUT,
    "_index_put_impl_.default": INDEX_PUT,
}


# -- the record -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpRecord:
    name: str                       # ATen overload, registry spelling: "add.Tensor"
    lowering: Lowering | None       # its own lowering (ops.registry), graph-only ones included
    kernel: str | None              # its eager kernel (LOWERED, INPLACE, OUT, METADATA, ...) or None
    functional: str | None = None   # INPLACE/OUT: the functional op it derives from
    policy: EagerPolicy = field(default=_PLAIN)   # EAGER's entry
    variants: tuple[str, ...] = ()  # the in-place/out= variants derived from this op's lowering
    # The kernel its lowering gives (LOWERED, INPLACE, OUT), also where a hand-written one replaces
    # it in eager mode (copy_.default): special cases and hand-written kernels may call it.
    lowered: str | None = None

    @property
    def wrappers(self) -> tuple[str, ...]:
        return self.policy.wrappers() if self.kernel is not None else ()

    @property
    def site(self) -> tuple[str, int] | None:
        """(file, line) where the lowering was registered (the ``@lowering`` call, in a loop too)."""
        return registry.SITES.get(self.name) if self.lowering is not None else None

    @property
    def device_index(self) -> str | None:
        """The argument that must live on the op's device, as on CUDA (ops/devices.py)."""
        return devices.device_index_name(self.name.partition(".")[0])

    @property
    def graph_kind(self) -> str | None:
        kind = GRAPH_KINDS.get(self.name)
        if kind is not None:
            return kind
        # An in-place op runs its functional op's lowering in graphs too (signature_for).
        return OP if self.lowering is not None or self.lowered == INPLACE else None

    def dtype_refusals(self) -> tuple[str, dict]:
        """(the table entry, its refused dtype signatures) of ops/data/cpu_dtype_refusals.json."""
        return cpu_dtypes.refusals_of(self.name, self.functional)


def records(platform: str) -> dict[str, OpRecord]:
    """Every op torchneuron knows something about, in registration order: each lowering, its
    derived in-place and out= variants, and the ops EAGER and GRAPH_KINDS name."""
    kernels: dict[str, tuple[str, str | None]] = {}
    variants: dict[str, list[str]] = {}
    for name, low in registry.LOWERINGS.items():
        try:
            overload = aten_overload(name)
        except AttributeError:
            raise RuntimeError(f"torchneuron: lowering registered for unknown op aten::{name}") from None
        if not lowers_in_eager(low, overload, platform):
            continue
        kernels.setdefault(name, (LOWERED, None))
        if not low.derive_variants:
            continue
        for variant, kind in zip(variants_of(overload), (INPLACE, OUT)):
            if variant is None or is_composite_implicit(variant):
                continue
            vname = registry_name(variant)
            if vname not in registry.LOWERINGS:
                kernels[vname] = (kind, name)
                variants.setdefault(name, []).append(vname)
    out = {}
    for name in [*kernels, *(n for n in EAGER if n not in kernels),
                 *(n for n in registry.LOWERINGS if n not in kernels and n not in EAGER)]:
        lowered, functional = kernels.get(name, (None, None))
        policy = EAGER.get(name, _PLAIN)
        kind = lowered
        if policy.kernel is not None and (policy.via is None or policy.via in kernels):
            kind = policy.kernel
        out[name] = OpRecord(name, registry.get(name), kind, functional, policy,
                             tuple(variants.get(name, ())), lowered)
    for name in GRAPH_KINDS:
        out.setdefault(name, OpRecord(name, registry.get(name), None))
    return out


def record(name: str, platform: str) -> OpRecord:
    """The record of one op ("add.Tensor"), also for an op torchneuron has nothing for (kernel None)."""
    found = records(platform).get(name)
    return found if found is not None else OpRecord(name, None, None)
