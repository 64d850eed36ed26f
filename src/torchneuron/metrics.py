"""One registry of counters that tests, the profiler and the readiness report all read.

``torchneuron.metrics()`` returns a snapshot; ``torchneuron.metrics.reset()`` clears it.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict


def op_key(qualified: str) -> str:
    """How counters name an op: ATen overloads without their namespace ("add.Tensor"), any other
    op in full ("mylib::scale"), so a custom op is never mistaken for an ATen one."""
    return qualified[6:] if qualified.startswith("aten::") else qualified


def op_label(key: str) -> str:
    """The qualified name of a counter's op key, for messages and reports."""
    return key if "::" in key else "aten::" + key


class _Registry:
    # Set by torchneuron.profiler while a profiler session or readiness report is active; the
    # kernels, fallback and copies call it only then. Survives reset(), never in snapshots.
    tracer = None

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.executables_compiled = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.eager_compiles = Counter()    # why an eager op needed a new executable -> compiles
        self.eager_cache_loads = 0         # eager executables loaded from the persistent cache
        self.op_calls = Counter()          # ATen overload -> eager kernel calls
        self.fallbacks = Counter()         # op (see op_key) -> CPU fallback runs
        self.decompositions = Counter()    # op (see op_key) -> decomposition runs
        self.float64_downcasts = Counter() # ATen overload -> float64 results run as float32
        # torchneuron.kernel custom ops: calls (neuron, CPU and compiled-graph runs) and the
        # executables compiled that contain them, by kernel name ("mylib::rms_norm").
        self.custom_kernel_calls = Counter()
        self.custom_kernel_compiles = Counter()
        self.h2d_copies = 0
        self.h2d_bytes = 0
        self.d2h_copies = 0
        self.d2h_bytes = 0
        # torch.compile
        self.graphs_compiled = 0
        self.graph_breaks = Counter()      # reason -> count
        self.recompiles = Counter()        # reason -> count
        self.graph_fallbacks = Counter()   # op that forced a graph to run eagerly -> count
        # adaptive eager
        self.regions_flushed = 0
        self.region_ops = 0
        self.region_replayed_ops = 0       # of those, ops checked against a known region (fast path)
        self.region_cache_hits = 0         # region segments run as one fused executable
        self.region_compiles = 0           # fused executables compiled (in the background)
        self.region_compile_seconds = 0.0
        self.region_unfused = Counter()    # reason -> region segments run op by op
        self.region_splits = 0             # regions too long for one fused executable
        # Groups of ops isolated from fusion (eager/adaptive/isolate.py): ops, call sites, reason
        self.fusion_isolated = []
        self.flush_reasons = Counter()     # where regions were cut
        # distributed
        self.collectives = Counter()
        self.collective_bytes = 0
        self.collective_seconds = 0.0
        # variable shapes (bucketed dynamic dimensions): per dynamic dim (named by its graph,
        # input and dim), calls per true size, compiles per bucket, and the ladder in force
        self.dynamic_sizes = defaultdict(Counter)
        self.bucket_compiles = defaultdict(Counter)
        self.dynamic_ladders = {}
        self.extra = defaultdict(int)

    def snapshot(self) -> dict:
        data = {k: (dict(v) if isinstance(v, Counter | defaultdict) else copy.copy(v))
                for k, v in vars(self).items() if k != "tracer"}
        for k in ("dynamic_sizes", "bucket_compiles"):   # nested counters: plain dicts all the way
            data[k] = {dim: dict(c) for dim, c in data[k].items()}
        lookups = self.executables_compiled + self.cache_hits
        data["cache_hit_rate"] = self.cache_hits / lookups if lookups else 0.0
        data["fallback_count"] = sum(self.fallbacks.values())
        return data

    def __call__(self) -> dict:
        return self.snapshot()

    def summary(self) -> str:
        s = self.snapshot()
        lines = [
            f"executables compiled : {s['executables_compiled']} ({s['compile_seconds']:.2f} s)"
            + (f", {s['eager_cache_loads']} eager loaded from the persistent cache" if s["eager_cache_loads"] else ""),
            f"cache hits           : {s['cache_hits']} (hit rate {s['cache_hit_rate']:.1%})",
            f"CPU fallbacks        : {s['fallback_count']}"
            + (f" {dict(s['fallbacks'])}" if s["fallbacks"] else ""),
            f"decompositions       : {sum(s['decompositions'].values())}",
            f"host->device copies  : {s['h2d_copies']} ({s['h2d_bytes']} bytes)",
            f"device->host copies  : {s['d2h_copies']} ({s['d2h_bytes']} bytes)",
        ]
        if s["custom_kernel_calls"]:
            lines.append(f"custom kernels       : {dict(s['custom_kernel_calls'])} calls, "
                         f"{sum(s['custom_kernel_compiles'].values())} compiles")
        if s["float64_downcasts"]:
            lines.append(f"float64 downcasts    : {dict(s['float64_downcasts'])}")
        if s["regions_flushed"]:
            unfused = ", ".join(f"{reason} {n}" for reason, n in s["region_unfused"].items())
            lines.append(f"adaptive regions     : {s['regions_flushed']} ({s['region_ops']} ops, "
                         f"{s['region_replayed_ops']} replayed), {s['region_cache_hits']} fused runs, "
                         f"{s['region_compiles']} compiled ({s['region_compile_seconds']:.2f} s)"
                         + (f"; op by op: {unfused}" if unfused else ""))
        if s["fusion_isolated"]:
            groups = "; ".join(f"{', '.join(e['ops'][:4])}{', ...' if len(e['ops']) > 4 else ''} ({e['reason']})"
                               for e in s["fusion_isolated"][:4])
            lines.append(f"isolated from fusion : {len(s['fusion_isolated'])} group(s): {groups}")
        if s["graphs_compiled"] or s["graph_breaks"] or s["recompiles"]:
            lines.append(f"compiled graphs      : {s['graphs_compiled']}, graph breaks "
                         f"{sum(s['graph_breaks'].values())}, recompiles {sum(s['recompiles'].values())}")
        return "\n".join(lines)


metrics = _Registry()
