"""CPU PyTorch as the oracle for errors that meta kernels get wrong or do not make.

Eager kernels learn shapes and dtypes from PyTorch's meta kernels, which make most of the CPU
kernels' checks. Not all: some meta kernels are Python references that raise ``ValueError`` or a
tuple as message where CPU raises a ``RuntimeError`` (``clamp()`` without bounds, an integer
``alpha``), some checks exist only in the CPU kernels (a reduction over no elements, memory
overlap between what an op reads and writes). When a call fails, or is one a meta kernel cannot
judge (it writes a tensor that overlaps itself or another argument), :func:`cpu_error` replays it
on CPU: every neuron storage becomes a zero-filled CPU storage of the same size, every tensor the
same view of it (dtype, sizes, strides, offset: the same aliasing), and whatever CPU raises is
the error the user gets. This runs once per cache entry at most, never on the hot path.
Where the replay gives no verdict (its storages would pass ``REPLAY_LIMIT_BYTES``, or the op is
linear algebra, which is not replayed), ATen's own overlap rules decide from the views' strides and
spans (:func:`overlap_error`: internal overlap, partial and full overlap, as MemoryOverlap.cpp).
"""

from __future__ import annotations

import warnings

import torch

# Replays needing more CPU memory than this are skipped (the meta kernel's judgement stands).
REPLAY_LIMIT_BYTES = 64 << 20

# LAPACK-backed CPU kernels are not replayed: on zero-filled inputs some of them crash the process
# (ormqr on complex64 samples segfaulted in PyTorch's test_ops); their meta kernels' errors stand.
_NOT_REPLAYED = ("linalg_", "_linalg_", "ormqr", "geqrf", "householder_product", "triangular_solve",
                 "cholesky", "lu", "_lu", "lstsq", "svd", "_svd", "eig", "symeig", "qr", "slogdet",
                 "logdet", "det", "inverse", "pinverse", "matrix_exp", "lu_solve", "lu_unpack",
                 # CPU's kernel segfaults in eval mode without running stats (the meta kernel says why).
                 "_native_batch_norm_legit")

# linalg_ ops that are elementwise kernels (TensorIterator, no LAPACK): replayed, and their overlap
# checked as CPU does (torch.linalg.cross(a, b, out=a[1:]) ran on neuron where CPU refuses it).
_REPLAYED_LINALG = ("linalg_cross",)

# PyTorch's message for writes through overlapping memory starts with this.
OVERLAP = "unsupported operation:"


def replays(overload) -> bool:
    """Whether :func:`cpu_error` replays this op (linear algebra is not: zero-filled inputs make
    its CPU kernels fail for reasons of their own, singular or not positive-definite matrices)."""
    base = overload.name().split("::", 1)[-1].split(".", 1)[0]
    if base in _REPLAYED_LINALG:
        return True
    return not (base.startswith(_NOT_REPLAYED[:2]) or base.rstrip("_") in _NOT_REPLAYED[2:])


def cpu_error(overload, values, kwarg_only, arg_names):
    """What ``overload`` raises on CPU for these arguments (schema order), or None if it runs (or
    the replay would be too large to make, or the op is not replayed)."""
    if not replays(overload):
        return None
    storages: dict = {}
    budget = [REPLAY_LIMIT_BYTES]

    def cpu(v):
        if isinstance(v, torch.Tensor):
            if v.device.type != "neuron":
                return v
            storage = v.untyped_storage()
            key = storage.data_ptr()
            base = storages.get(key)
            if base is None:
                budget[0] -= storage.nbytes()
                if budget[0] < 0:
                    raise _TooLarge
                base = storages[key] = torch.zeros(storage.nbytes(), dtype=torch.uint8)
            return torch.empty(0, dtype=v.dtype).set_(base.untyped_storage(), v.storage_offset(),
                                                      v.shape, v.stride())
        if isinstance(v, list | tuple):
            return type(v)(cpu(x) for x in v)
        if isinstance(v, torch.device) and v.type == "neuron":
            return torch.device("cpu")
        if isinstance(v, str) and v.startswith("neuron"):
            return "cpu"
        return v

    try:
        replay = [cpu(v) for v in values]
    except _TooLarge:
        return None
    pos = [v for v, kw in zip(replay, kwarg_only) if not kw]
    kw = {n: v for n, v, k in zip(arg_names, replay, kwarg_only) if k}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            overload(*pos, **kw)
    except Exception as err:   # noqa: BLE001 - whatever CPU raises is the answer
        return err
    return None


class _TooLarge(Exception):
    pass


def too_large(values) -> bool:
    """Whether :func:`cpu_error` would skip this call (it returns None then: no verdict)."""
    seen, total = set(), 0

    def visit(v):
        nonlocal total
        if isinstance(v, torch.Tensor) and v.device.type == "neuron":
            storage = v.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(v, list | tuple):
            for x in v:
                visit(x)

    for v in values:
        visit(v)
    return total > REPLAY_LIMIT_BYTES


def may_overlap(mutated, others) -> bool:
    """Whether a written tensor overlaps itself (an expanded view) or shares its storage with
    another argument (``others``), the very same view included: what only the CPU kernels check.
    Elementwise ops accept ``x.add_(x)``, index ops refuse ``i.index_fill_(0, i, 0)``: CPU decides."""
    for t in mutated:
        if t.numel() > 1 and torch._debug_has_internal_overlap(t) == 1:
            return True
    for t in mutated:
        ptr = t.untyped_storage().data_ptr()
        start, stop = _span(t)
        for other in others:
            if other.device == t.device and other.untyped_storage().data_ptr() == ptr:
                other_start, other_stop = _span(other)
                if start < other_stop and other_start < stop:
                    return True
    return False


def check_overlaps(sig, values, describe) -> None:
    """CPU's "unsupported operation" error if a tensor the op ``sig`` writes (values in schema
    order) overlaps itself or another argument. CPU decides what it accepts: ``x.add_(x)`` yes,
    ``i.index_fill_(0, i, 0)`` and ``x[:-1].copy_(x[1:])`` no. Where CPU gives no verdict (a
    replay too large to make, an op not replayed: linear algebra), ATen's rules decide from the
    views' strides and spans (:func:`overlap_error`)."""
    mutated = [t for _, _, t in sig.mutated_tensors(values)]
    others = sig.other_tensors(values)
    if not mutated or not may_overlap(mutated, others):
        return
    key = (sig.overload, layout(values))
    try:
        err = _verdicts.get(key, _UNKNOWN)
    except TypeError:   # an argument that cannot be a key: judged each time
        key, err = None, _UNKNOWN
    if err is _UNKNOWN:
        if replays(sig.overload) and not too_large(values):
            err = cpu_error(sig.overload, values, sig.kwarg_only, sig.arg_names)
        else:
            err = overlap_error(sig.overload, mutated, others)
        if err is not None and not str(err.args[0] if err.args else err).startswith(OVERLAP):
            err = None
        if len(_verdicts) >= _VERDICTS_MAX:
            _verdicts.clear()
        if key is not None:
            _verdicts[key] = err
    if err is not None:
        raise as_cpu_error(err, sig.name, describe(values))


# CPU's overlap verdict per (op, layout): it depends on the views' dtypes, sizes, strides and where
# they lie relative to each other in their storages, not on where the group starts (``x[i].add_(x[i])``
# in a loop is one layout) nor on values. A call whose written tensor meets another argument (the
# very same view, ``x.add_(x)``; interleaved views) replayed on CPU every time: once per layout now.
_verdicts: dict = {}
_VERDICTS_MAX = 4096
_UNKNOWN = object()


def layout(values) -> tuple:
    """What decides an overlap verdict for these arguments (schema order): each tensor's dtype,
    device, sizes, strides, storage (numbered in order of appearance, with its size) and offset
    relative to the first view of that storage; the Python type of each scalar; other values as
    they are (dims, dtypes, flags)."""
    storages: dict = {}

    def one(v):
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            group = storages.setdefault((v.device, storage.data_ptr()), (len(storages), v.storage_offset()))
            return (v.dtype, v.device, tuple(v.shape), v.stride(), group[0], storage.nbytes(),
                    v.storage_offset() - group[1])
        if isinstance(v, list | tuple):
            return tuple(one(x) for x in v)
        if isinstance(v, bool | int | float | complex):
            return type(v)
        return v

    return tuple(one(v) for v in values)


# -- ATen's memory-overlap rules (aten/src/ATen/MemoryOverlap.cpp), from strides and spans -----------
NO, YES, TOO_HARD = 0, 1, 2          # MemOverlap: has_internal_overlap's answer
FULL, PARTIAL = "full", "partial"    # MemOverlapStatus besides NO and TOO_HARD

INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to "
                    "a single memory location. Please clone() the tensor before performing the "
                    "operation.")
PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor "
                   "refer to a single memory location. Please clone() the tensor before performing "
                   "the operation.")

# Ops whose CPU kernels refuse any overlap (the very same view too) between the written tensor and
# their index or source (assert_no_overlap); TensorIterator ops accept the very same view.
_NO_OVERLAP_OPS = ("index_fill", "index_copy", "index_add", "index_reduce", "index_put", "_index_put_impl",
                   "scatter", "scatter_add", "scatter_reduce", "put", "masked_scatter", "masked_fill",
                   "gather", "index_select", "take", "take_along_dim", "cat")
# Ops whose CPU kernels check only the written tensor's internal overlap, not its overlap with the
# inputs (reductions, BLAS products, softmax): CPU runs them on overlapping views.
# (addmm, addbmm and addr do refuse a partial overlap.)
_INPUTS_UNCHECKED_OPS = ("sum", "nansum", "mean", "prod", "amax", "amin", "mm", "bmm", "mv", "addmv", "baddbmm",
                         "dot", "vdot", "_softmax", "_log_softmax")
# Ops that do not check their written tensor at all (TensorIteratorConfig.set_check_mem_overlap(false)).
_UNCHECKED_OPS = ("fill", "zero", "set", "resize", "resize_as", "detach", "as_strided", "squeeze",
                  "unsqueeze", "transpose", "t", "swapdims", "swapaxes", "normal", "uniform", "bernoulli",
                  "random", "exponential", "geometric", "log_normal", "cauchy")


def has_internal_overlap(t: torch.Tensor) -> int:
    """ATen's has_internal_overlap: NO for a non-overlapping dense view, YES where a dimension of
    more than one element has stride 0, TOO_HARD otherwise (ATen then lets the write through)."""
    if _non_overlapping_and_dense(t):
        return NO
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return YES
    return TOO_HARD


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """ATen's is_non_overlapping_and_dense: some permutation of the view is contiguous."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def overlap_status(a: torch.Tensor, b: torch.Tensor):
    """ATen's get_overlap_status: FULL (the same bytes with the same strides), PARTIAL (their
    spans meet otherwise), NO, or TOO_HARD (either view is not non-overlapping and dense)."""
    if a is b:
        return FULL
    if a.numel() == 0 or b.numel() == 0:
        return NO
    if not (_non_overlapping_and_dense(a) and _non_overlapping_and_dense(b)):
        return TOO_HARD
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return NO
    a_start, a_end = _span(a)
    b_start, b_end = _span(b)
    if a_start == b_start and a_end == b_end:
        return FULL if a.stride() == b.stride() else PARTIAL
    return PARTIAL if a_start < b_end and b_start < a_end else NO


def overlap_error(overload, mutated, others) -> RuntimeError | None:
    """What ATen's overlap assertions raise for an op writing ``mutated`` and reading ``others``,
    decided from the views alone: assert_no_internal_overlap on each written tensor, then
    assert_no_partial_overlap (TensorIterator ops) or assert_no_overlap (index ops) against each
    other argument. Linear algebra kernels compute into temporaries and copy the result out: only
    the internal overlap of a written tensor fails there."""
    base = overload.name().split("::", 1)[-1].split(".", 1)[0].rstrip("_")
    if base in _UNCHECKED_OPS:
        return None
    for t in mutated:
        if t.numel() > 1 and has_internal_overlap(t) == YES:
            return RuntimeError(INTERNAL_OVERLAP)
    if not replays(overload) or base in _INPUTS_UNCHECKED_OPS:
        return None
    refused = (FULL, PARTIAL) if base in _NO_OVERLAP_OPS else (PARTIAL,)
    for t in mutated:
        for other in others:
            if overlap_status(t, other) in refused:
                return RuntimeError(PARTIAL_OVERLAP)
    return None


def shares_storage(mutated, others) -> bool:
    """Whether a written tensor shares its storage with another argument (however their bytes lie)."""
    ptrs = {t.untyped_storage().data_ptr() for t in mutated}
    return any(o.untyped_storage().data_ptr() in ptrs for o in others)


def _span(t):
    """The bytes of its storage that a view can touch: [first, last + 1) (an empty view: none)."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    low = high = 0
    for n, stride in zip(t.shape, t.stride()):
        if stride > 0:
            high += (n - 1) * stride
        else:
            low += (n - 1) * stride
    return start + low * size, start + (high + 1) * size


def as_cpu_error(err: BaseException, op: str, described: str) -> BaseException:
    """CPU's exception, with the op (its qualified name) and its neuron inputs appended."""
    first = str(err.args[0]) if err.args else str(err)
    try:
        return type(err)(f"{first}\n[torchneuron] in {op}{described}")
    except Exception:   # noqa: BLE001 - an exception type with another constructor
        return err
