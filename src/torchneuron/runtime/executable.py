"""A compiled program and the layout of its results: one class for eager ops, adaptive regions'
ops and torch.compile graphs.

An executable's results come in this order: its new device outputs, then (graphs) outputs that
live on the host, then the new buffers of the storages it writes (``writes``: their input slots,
see ``runtime/inputs.py``), then (graphs) the new values of mutated CPU inputs (``host_writes``),
and last, if it has device checks (``ops/checks.py``), their outcome.
"""

from __future__ import annotations

from . import deferred, memory

_records = memory.allocator.records


class Executable:
    __slots__ = ("call", "name", "key", "reason", "writes", "check_mode", "_checks", "traced", "out_specs",
                 "outputs", "single", "single_checked", "aliased", "n_new", "n_host", "host_writes", "boxed",
                 "donated")

    def __init__(self, call, name, writes=(), check_mode="off", checks=(), *, traced=None, out_specs=(),
                 n_new=None, n_host=0, host_writes=()):
        self.call = call              # the compiled program; None until an eager op's first call
        self.name = name              # the op ("add", "mylib::op") or the graph
        self.key = None               # the cache key (what decides this program)
        self.reason = None            # why it was needed: "new op", "new shape", ...
        self.writes = writes          # input slots whose storages get new buffers
        self.check_mode = check_mode  # config.device_checks when it was planned
        self._checks = checks         # ((check, op), ...) of the outcome it returns last
        # Eager ops: the function jax.jit traces (which learns the checks as it traces), and per new
        # output (torch dtype, sizes, strides) or None, with the layouts the allocator wraps
        # results in.
        self.traced = traced
        self.out_specs = out_specs
        self.outputs = tuple(None if spec is None else memory.output_layout(*spec) for spec in out_specs)
        self.single = False           # exactly one new output, nothing written, no checks
        self.single_checked = False   # the same, plus the outcome of its device checks
        # A written tensor shares its storage with another argument: each call checks the overlap
        # (``x[:9].copy_(x[9:])`` and ``x[:9].copy_(x[1:10])`` have one key, their offsets differ).
        self.aliased = False
        self.n_new = len(self.outputs) if n_new is None else n_new
        self.n_host = n_host          # graphs: outputs that live on the CPU
        self.host_writes = host_writes  # graphs: input indices of mutated CPU inputs
        # Bucketed eager ops: results are buffers of their bucket's capacity, wrapped with the
        # true layouts of ``out_specs`` (compile/eager_buckets.py).
        self.boxed = False
        # Input slots whose buffers the program donates (runtime/donation.py): a call first makes
        # sure nothing else refers to them.
        self.donated = ()

    @property
    def checks(self):
        """((check, op), ...) of the device checks whose outcome is the last result; for an eager
        op None until it was traced or loaded."""
        traced = self.traced
        return self._checks if traced is None else traced.checks

    def split_single(self) -> None:
        """Once its device checks are known (traced or loaded): their outcome is one more result,
        so a checked single-output op takes its own shortcut."""
        if self.single and self.checks:
            self.single, self.single_checked = False, True

    def take_writes(self, results, k: int, addrs) -> int:
        """Give each written storage (``addrs``: address per input slot) its new buffer from
        ``results[k:]``; the index after them."""
        for slot in self.writes:
            _records[addrs[slot]].buf = results[k]
            k += 1
        return k

    def report(self, outcome, site) -> None:
        """Hand the outcome of its device checks to the runtime: raised now (``sync``) or at the
        next synchronisation point, with the user's call site."""
        if self.check_mode == "sync":
            deferred.check_now(outcome, self.checks)
        else:
            deferred.defer(outcome, self.checks, site)

    def meta(self) -> dict:
        """What a stored graph executable needs besides its code (``compile/executables.py``)."""
        return {"n_new": self.n_new, "n_host": self.n_host, "writes": self.writes,
                "host_writes": self.host_writes, "name": self.name, "checks": self.checks}
