"""The bucket advisor: for each dynamic dimension a program saw, the sizes it saw, what today's
bucket ladder costs (compiles, padding), and a proposed bucket set that costs less.

Bucketed shapes (docs/shapes.md) compile one executable per bucket of a dynamic dimension and pad
every call up to its bucket. Two costs pull apart: each bucket used is a compile (seconds to
minutes on an accelerator), and each padded element is work done for nothing. Given the observed
histogram of true sizes, the best set of ``k`` buckets (the one padding least) is found exactly by
dynamic programming over the distinct sizes (a bucket's upper bound is always an observed size in
an optimal set); the proposal is the ``k`` whose total cost -- ``k`` compiles plus the padded
elements' work, both in seconds as measured in the run -- is lowest. Without timings the cost is
``compiles x padded/real work`` (both factors matter equally).

The counters it reads (``torchneuron.metrics``): ``dynamic_sizes[dim][size]`` (calls per true
size), ``bucket_compiles[dim][bucket]`` (compiles per bucket) and ``dynamic_ladders[dim]`` (the
ladder in force), written by the bucketed compile path (``compile/dynamic.py``).
"""

from __future__ import annotations

import bisect

# At most this many buckets are proposed (a ladder longer than this compiles too often to pay).
MAX_BUCKETS = 16


def _histogram(raw) -> list[tuple[int, int]]:
    """(size, calls) sorted by size; keys may be strings after a JSON round trip."""
    return sorted((int(s), int(n)) for s, n in raw.items() if int(n) > 0)


def bucket_of(size: int, ladder) -> int | None:
    """The smallest bucket of ``ladder`` holding ``size`` (None: above the largest)."""
    i = bisect.bisect_left(ladder, size)
    return ladder[i] if i < len(ladder) else None


def expand_ladder(ladder, largest: int) -> list[int]:
    """A ladder as sizes: a list as it is; ``"pow2 from N"`` (the open-ended power-of-two ladder)
    as its buckets up to the first that holds ``largest``."""
    if isinstance(ladder, str):
        size = int(ladder.rsplit(" ", 1)[1])
        out = [size]
        while size < largest:
            size *= 2
            out.append(size)
        return out
    return sorted(set(int(b) for b in ladder))


def ladder_cost(hist, ladder) -> dict:
    """What a ladder costs on a histogram: buckets used (compiles), real and padded elements, the
    padding share of the padded work, and the calls no bucket holds."""
    ladder = expand_ladder(ladder, hist[-1][0] if hist else 0)
    used, real, padded, over = set(), 0, 0, 0
    for size, calls in hist:
        b = bucket_of(size, ladder)
        if b is None:
            over += calls
            b = size      # such a call compiles its own shape (or fails): no padding counted
        used.add(b)
        real += size * calls
        padded += b * calls
    return {"buckets": ladder, "compiles": len(used), "real": real, "padded": padded,
            "waste": (padded - real) / padded if padded else 0.0, "over_largest": over}


def best_ladders(hist, max_buckets: int = MAX_BUCKETS) -> dict[int, list[int]]:
    """k -> the k-bucket ladder with the fewest padded elements, for k = 1 .. min(max, distinct
    sizes). Exact: dynamic programming over the sorted distinct sizes, buckets at observed sizes."""
    sizes = [s for s, _ in hist]
    n = len(sizes)
    if n == 0:
        return {}
    prefix_calls = [0]
    prefix_elems = [0]
    for s, c in hist:
        prefix_calls.append(prefix_calls[-1] + c)
        prefix_elems.append(prefix_elems[-1] + s * c)

    def group_cost(i, j):   # sizes[i..j] padded to sizes[j]: padded elements beyond the real ones
        return sizes[j] * (prefix_calls[j + 1] - prefix_calls[i]) - (prefix_elems[j + 1] - prefix_elems[i])

    kmax = min(max_buckets, n)
    inf = float("inf")
    # cost[k][j]: least padding covering sizes[0..j] with k buckets, the last one at sizes[j].
    cost = [[inf] * n for _ in range(kmax + 1)]
    back = [[-1] * n for _ in range(kmax + 1)]
    for j in range(n):
        cost[1][j] = group_cost(0, j)
    for k in range(2, kmax + 1):
        for j in range(k - 1, n):
            for i in range(k - 2, j):
                c = cost[k - 1][i] + group_cost(i + 1, j)
                if c < cost[k][j]:
                    cost[k][j], back[k][j] = c, i
    out = {}
    for k in range(1, kmax + 1):
        ladder, j = [], n - 1
        for kk in range(k, 0, -1):
            ladder.append(sizes[j])
            j = back[kk][j]
        out[k] = sorted(ladder)
    return out


def propose(hist, compile_seconds: float | None = None, element_seconds: float | None = None,
            max_buckets: int = MAX_BUCKETS) -> dict:
    """The proposed ladder and the frontier it was chosen from ({k: ladder cost}). With both
    timings the cost of a ladder is k * compile_seconds + padded elements * element_seconds;
    otherwise compiles * padded / real."""
    frontier = {k: ladder_cost(hist, ladder) for k, ladder in best_ladders(hist, max_buckets).items()}
    if not frontier:
        return {"ladder": [], "cost": None, "frontier": {}, "model": None}
    timed = bool(compile_seconds) and bool(element_seconds)

    def cost(c):
        if timed:
            return c["compiles"] * compile_seconds + (c["padded"] - c["real"]) * element_seconds
        return c["compiles"] * (c["padded"] / c["real"] if c["real"] else 1.0)

    k = min(frontier, key=lambda k: (cost(frontier[k]), k))
    return {"ladder": frontier[k]["buckets"], "cost": frontier[k], "frontier": frontier,
            "model": "seconds" if timed else "compiles x padded/real",
            "objective": cost(frontier[k])}


def advise(metrics: dict, compile_seconds: float | None = None, element_seconds: float | None = None) -> list[dict]:
    """One entry per dynamic dimension the run saw: its histogram, today's ladder and its measured
    compiles per bucket, and the proposal, each with compiles and padding side by side."""
    out = []
    ladders = metrics.get("dynamic_ladders") or {}
    compiles = metrics.get("bucket_compiles") or {}
    for dim, raw in sorted((metrics.get("dynamic_sizes") or {}).items()):
        hist = _histogram(raw)
        if not hist:
            continue
        today = ladders.get(dim) or sorted({int(b) for b in (compiles.get(dim) or {})})
        entry = {
            "dim": dim,
            "calls": sum(c for _, c in hist),
            "distinct": len(hist),
            "histogram": hist,
            "today": ladder_cost(hist, today) if today else None,
            "measured_compiles": {int(b): int(n) for b, n in (compiles.get(dim) or {}).items()},
            "proposal": propose(hist, compile_seconds, element_seconds),
        }
        out.append(entry)
    return out


def histogram_rows(hist, bins: int = 8) -> list[tuple[str, int]]:
    """The histogram folded into at most ``bins`` size ranges for a table."""
    if len(hist) <= bins:
        return [(str(s), c) for s, c in hist]
    lo, hi = hist[0][0], hist[-1][0]
    width = max(1, -(-(hi - lo + 1) // bins))
    rows = []
    for b in range(bins):
        a, z = lo + b * width, min(hi, lo + (b + 1) * width - 1)
        n = sum(c for s, c in hist if a <= s <= z)
        if n:
            rows.append((f"{a}–{z}", n))
    return rows
