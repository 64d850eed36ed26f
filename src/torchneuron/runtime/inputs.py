"""How an executable receives its inputs: the one encoding of an input, shared by every path.

An executable (an eager op's, an adaptive-eager region's, a torch.compile graph's) takes the flat
buffers of the storages its inputs live on, in slot order, then its runtime values (scalars, view
offsets, 0-dim CPU tensors, uploaded CPU tensors, RNG seeds) in input order. Each input is
described by a *spec*: a plain tuple, cheap to build on the hot path, hashable, and the input's
part of the cache key, so it must hold everything that decides the program and nothing that only
varies between calls (see DESIGN.md, "Executable keys"):

===========================  ===========================================================================
``(dtype, sizes, strides,    a view of the buffer in ``slot``. ``offset`` is 0 for a view that starts
offset, slot)``              its storage and spans all of it (compiled in), else None: the storage
                             offset is the next runtime input (``x[i]`` and ``x[j]`` share a program)
``("empty", dtype, sizes)``  a tensor without elements (read as zeros, nothing to write)
``("cpu-scalar", dtype)``    a 0-dim CPU tensor: a runtime scalar, as on CUDA (eager)
``("host", dtype, sizes)``   a CPU tensor the call uploads, counted as a copy (graphs)
``("int", value)``           an integer compiled in (graphs: sizes and integer arguments)
``("const", value)``         any other compiled-in value (graphs)
a Python type                a runtime scalar of that type (``float``: a learning rate)
``None``                     an absent optional argument
===========================  ===========================================================================

Beside the specs, a call's key holds ``storages``: (numel, dtype) of each slot's buffer, since
executables are compiled for exact buffer avals and equal views can sit on storages of different
sizes. ``Inputs`` builds specs from a call's arguments (``tensor``/``scalar`` for eager kernels,
``graph_arg`` for graphs); ``read`` and ``write_back`` are their inverse inside the traced program;
``match_view`` checks a later call against a recorded spec (adaptive eager's replay).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from ..metrics import metrics
from . import layout, memory, transfers
from .device import current_device, device_mismatch_error
from .dtypes import cast_and_broadcast, jax_dtype
from .values import offset_array, scalar_array

_records = memory.allocator.records

# The fields of a view spec, by position.
DTYPE, SIZES, STRIDES, OFFSET, SLOT = range(5)
EMPTY, CPU_SCALAR, HOST, INT, CONST = "empty", "cpu-scalar", "host", "int", "const"


def is_view(spec) -> bool:
    """The spec describes a view of a storage buffer (not a scalar, an empty tensor, None...)."""
    return spec.__class__ is tuple and len(spec) == 5 and spec[0].__class__ is torch.dtype


def views(specs):
    """Every view spec among ``specs``, lists' elements included, in input order."""
    for s in specs:
        if s.__class__ is tuple and s:
            if s[0].__class__ is torch.dtype:
                yield s
            elif s[0].__class__ is tuple or s[0] is None or s[0].__class__ is type:
                yield from views(s)


class Inputs:
    """Collects the buffers, runtime values and device of one call while its specs are built."""

    __slots__ = ("bufs", "addrs", "slots", "runtime", "device_index", "storages")

    def __init__(self):
        self.bufs = []       # flat buffer of each storage the inputs live on, in slot order
        self.addrs = []      # and its address
        self.slots = {}      # address -> slot
        self.runtime = []    # runtime inputs, in input order
        self.device_index = None
        self.storages = []   # (numel, dtype) of each slot's buffer: part of the key

    # -- eager kernels (the hot path) -----------------------------------------------------------
    def tensor(self, t):
        """The spec of one tensor argument of an eager kernel."""
        try:
            addr = t.data_ptr()
        except AttributeError:
            # The dispatcher hands "wrapped numbers" (x * 2) to Python kernels as plain scalars.
            self.runtime.append(scalar_array(t))
            return t.__class__
        rec = _records.get(addr)
        if rec is not None:               # data_ptr() is a storage's start: offset 0
            nbytes = t.nbytes
            if nbytes == rec.nbytes:
                offset = 0
            elif nbytes == 0:
                return (EMPTY, t.dtype, tuple(t.shape))
            else:
                offset = None
                self.runtime.append(offset_array(0))
        else:
            addr = t.untyped_storage().data_ptr()
            rec = _records.get(addr)
            if rec is None or t.nbytes == 0:
                return self._unusual_tensor(t)
            offset = None
            self.runtime.append(offset_array(t.storage_offset()))
        if self.device_index is None:
            self.device_index = rec.device_index
        elif rec.device_index != self.device_index:
            raise device_mismatch_error(t, self.device_index)
        slot = self.slots.get(addr)
        if slot is None:   # _add_storage, inlined: this runs for every tensor of every op
            slot = self.slots[addr] = len(self.bufs)
            buf = rec.buf
            self.bufs.append(buf if buf is not None else memory.empty_buffer(rec))
            self.addrs.append(addr)
            self.storages.append((rec.numel, rec.dtype))
        return (t.dtype, t.shape, t.stride(), offset, slot)

    def _add_storage(self, addr, rec, buf) -> int:
        slot = self.slots[addr] = len(self.bufs)
        self.bufs.append(buf)
        self.addrs.append(addr)
        self.storages.append((rec.numel, rec.dtype))
        return slot

    def _unusual_tensor(self, t):
        if t.device.type == "neuron":
            if t.numel() == 0:
                return (EMPTY, t.dtype, tuple(t.shape))
            memory.record_of(t)  # raises the freed-storage error
        if t.device.type == "cpu" and t.dim() == 0:
            # A 0-dim CPU tensor is a scalar operand, as on CUDA.
            self.runtime.append(np.asarray(t.item(), dtype=jax_dtype(t.dtype)))
            return (CPU_SCALAR, t.dtype)
        raise device_mismatch_error(t, self.device_index if self.device_index is not None else current_device())

    def scalar(self, v):
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        self.runtime.append(scalar_array(v))
        return v.__class__

    # -- graphs ---------------------------------------------------------------------------------
    def graph_arg(self, a):
        """The spec of one input of a torch.compile graph: neuron tensors as eager reads them (a
        pending adaptive region they depend on runs first), CPU tensors uploaded by the call,
        integers compiled in, floats as runtime values."""
        if isinstance(a, torch.Tensor):
            try:   # costs nothing unless raised (Python 3.11)
                addr = a.data_ptr()
            except RuntimeError:   # no storage (sparse...): the general path says what is wrong
                addr = None
            rec = _records.get(addr)
            if rec is not None and a.nbytes == rec.nbytes and rec.nbytes:
                # A whole storage from its start (parameters, most activations): the spec of the
                # general path below, from five attribute reads instead of ten.
                return (a.dtype, tuple(a.shape), a.stride(), 0, self._graph_slot(a, addr, rec))
            dev = a.device.type
            if dev == "neuron":
                if a.numel() == 0:
                    return (EMPTY, a.dtype, tuple(a.shape))
                addr = a.untyped_storage().data_ptr()
                rec = _records.get(addr)
                if rec is None:
                    memory.record_of(a)       # raises the freed-storage error
                slot = self._graph_slot(a, addr, rec)
                offset = a.storage_offset()
                if offset == 0 and a.nbytes == rec.nbytes:
                    return (a.dtype, tuple(a.shape), a.stride(), 0, slot)
                self.runtime.append(offset_array(offset))
                return (a.dtype, tuple(a.shape), a.stride(), None, slot)
            if dev == "cpu":
                host = transfers.host_array(a)      # uploaded by the call: counted as a copy
                metrics.h2d_copies += 1
                metrics.h2d_bytes += host.nbytes
                self.runtime.append(host)
                return (HOST, a.dtype, tuple(a.shape))
            raise RuntimeError(
                f"torchneuron: a torch.compile(backend=\"neuron\") graph got an input on {a.device}; "
                "move it to the neuron device (or to the CPU) first.")
        if a is None:
            return None
        if isinstance(a, bool | int | torch.SymInt):
            return (INT, int(a))                   # integers shape things: compiled in
        if isinstance(a, float | torch.SymFloat):
            self.runtime.append(float(a))
            return float
        return (CONST, a)

    def _graph_slot(self, a, addr, rec) -> int:
        """The slot of graph input ``a``'s storage (at ``addr``, record ``rec``), its device checked
        against the call's."""
        if self.device_index is None:
            self.device_index = rec.device_index
        elif rec.device_index != self.device_index:
            raise device_mismatch_error(a, self.device_index)
        slot = self.slots.get(addr)
        if slot is None:
            slot = self._add_storage(addr, rec, memory.empty_buffer(rec))
        return slot


class StableStorages:
    """The specs of a graph's inputs that are whole neuron storages of static shape -- a model's
    parameters and buffers, the same storages call after call -- computed once per set of storages.
    A later call reads each input's address, checks it is still the start of the same storage, and
    takes the storages' current buffers: ~30 specs cost ~200 µs built one by one, a few µs here.
    These inputs are collected first (their slots come first). Only graphs use it: Dynamo's guards
    have already checked these inputs' dtypes, sizes and strides, which is why they are not compared
    again."""

    __slots__ = ("positions", "others", "entries")

    def __init__(self, placeholders):
        self.positions, self.others = [], []   # placeholder indices: static neuron tensors, the rest
        for i, ph in enumerate(placeholders):
            v = ph.meta.get("val")
            stable = isinstance(v, torch.Tensor) and v.device.type == "neuron" and all(
                isinstance(x, int) for x in (*v.shape, *v.stride()))
            (self.positions if stable else self.others).append(i)
        self.entries = {}     # the inputs' addresses -> what collecting them gave

    def collect(self, ins: Inputs, args, check=None):
        """Fill the fresh ``ins`` with the inputs at ``positions`` and return their specs; None
        (``ins`` untouched) when one of them is not a whole neuron storage: the caller then
        collects every input in order. ``check(a)``, if given, runs on each input collected one
        by one."""
        stable = [args[i] for i in self.positions]
        try:
            ptrs = tuple([a.data_ptr() for a in stable])
        except (AttributeError, RuntimeError):   # not a tensor, or no storage: said by graph_arg
            return None
        entry = self.entries.get(ptrs)
        if entry is not None:
            recs, slot_recs, specs, addrs, slots, storages, device_index = entry
            get = _records.get
            # No storage freed and another made at its address, none given a bucket's capacity.
            if all([get(p) is r for p, r in zip(ptrs, recs)]) and storages == tuple(
                    [(r.numel, r.dtype) for r in slot_recs]):
                ins.bufs = [memory.empty_buffer(r) for r in slot_recs]
                ins.addrs, ins.slots, ins.storages = list(addrs), dict(slots), list(storages)
                ins.device_index = device_index
                return specs
        if check is not None:
            for a in stable:
                check(a)
        trial = Inputs()
        specs = [trial.graph_arg(a) for a in stable]
        recs = [_records.get(p) for p in ptrs]
        # Runtime values (view offsets, uploads) must reach the program in input order.
        if trial.runtime or None in recs or not all(is_view(s) and s[OFFSET] == 0 for s in specs):
            return None
        if len(self.entries) >= 8:   # parameters replaced call after call: stop keeping them
            self.entries.clear()
        self.entries[ptrs] = (recs, [_records[a] for a in trial.addrs], specs, tuple(trial.addrs),
                              dict(trial.slots), tuple(trial.storages), trial.device_index)
        ins.bufs, ins.addrs, ins.slots = trial.bufs, trial.addrs, trial.slots
        ins.storages, ins.device_index = trial.storages, trial.device_index
        return specs


# -- inside the traced program ---------------------------------------------------------------------
def read(spec, bufs, runtime):
    """(value, storage offset) of one input inside the traced executable (``runtime`` is an
    iterator over the runtime values); the offset, static or traced, is None for non-views."""
    if spec is None:
        return None, None
    if spec.__class__ is type:
        return next(runtime), None
    tag = spec[0]
    if tag == EMPTY:
        return jnp.zeros(spec[2], dtype=jax_dtype(spec[1])), None
    if tag == CPU_SCALAR or tag == HOST:
        return next(runtime), None
    if tag == INT or tag == CONST:
        return spec[1], None
    dtype, sizes, strides, offset, slot = spec
    if offset is None:
        offset = next(runtime)
    return layout.read(bufs[slot], jax_dtype(dtype), sizes, strides, offset), offset


def write_back(new_bufs: dict, bufs, spec, value, offset) -> None:
    """Write ``value`` (the new value of the view ``spec``, read at ``offset``) into its storage's
    buffer: ``new_bufs[slot]``, starting from the buffers earlier writes of this call made."""
    dtype, sizes, strides, _, slot = spec
    base = new_bufs.get(slot, bufs[slot])
    value = cast_and_broadcast(value, dtype, sizes)
    new_bufs[slot] = layout.write(base, value, jax_dtype(dtype), sizes, strides, offset)


# -- a later call against a recorded spec (adaptive eager's replay) ----------------------------------
def match_view(v, spec, runtime):
    """The storage address of ``v`` when it is a view with ``spec``'s dtype, sizes, strides and
    offset rule (its offset appended to ``runtime`` when that is a runtime input), else None."""
    dtype = spec[0]
    try:
        if v.dtype is not dtype or v.stride() != spec[2] or v.shape != spec[1]:
            return None
        offset = v.storage_offset()
        addr = v.data_ptr() - offset * dtype.itemsize
    except AttributeError:                   # not a tensor
        return None
    if spec[3] is None:
        runtime.append(offset_array(offset))
    elif offset:
        return None
    return addr
