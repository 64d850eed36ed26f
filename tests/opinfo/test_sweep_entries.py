"""Entries the bucketed OpInfo sweep (``python -m tools.coverage --shapes bucketed``) found failing,
run through the same harness: each of their leading samples must end as a pass (or a parity of
errors), in the static eager sweep and compiled at padded sizes."""

from __future__ import annotations

import pytest
import torch

from . import harness


def _statuses(name, check, shapes, limit=5):
    try:
        results = list(harness.run(harness.OPS[name], torch.float32, check, limit=limit, shapes=shapes))
    finally:
        harness.clear_caches()
    return [(r.index, r.status, r.detail) for r in results]


# CPU refuses a bool operand of a subtraction (sample 3 of _foreach_sub: a bool scalar) and bool
# trunc/addcmul; neuron must refuse them too (error parity), eagerly and in a compiled graph.
@pytest.mark.parametrize("shapes", ["static", "bucketed"])
@pytest.mark.parametrize("name", ["_foreach_sub", "_foreach_trunc", "_foreach_addcmul", "index_put"])
def test_sweep_entries_pass(name, shapes, monkeypatch):
    monkeypatch.setenv("TORCHNEURON_CACHE_DIR", "")
    failing = [s for s in _statuses(name, "forward", shapes) if s[1] in ("fail", "expected")]
    assert not failing, failing


@pytest.mark.parametrize("name", ["_foreach_sub", "_foreach_trunc", "_foreach_addcmul"])
def test_foreach_of_bool_is_refused_as_cpu_refuses_it(name):
    from torchneuron.eager import kernel
    kernel.clear_cache()
    args = {"_foreach_sub": lambda d: ([torch.ones(3, device=d)], True),
            "_foreach_trunc": lambda d: ([torch.ones(3, dtype=torch.bool, device=d)],),
            "_foreach_addcmul": lambda d: ([torch.ones(3, dtype=torch.bool, device=d)],) * 3}[name]
    op = getattr(torch, name)
    with pytest.raises((RuntimeError, NotImplementedError)) as cpu:
        op(*args("cpu"))
    with pytest.raises(type(cpu.value)) as neuron:
        op(*args("neuron"))
    assert str(cpu.value) in str(neuron.value) and name in str(neuron.value)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=str(cpu.value).split(".")[0].replace("(", r"\(").replace(")", r"\)")):
        torch.compile(lambda: op(*args("neuron")), backend="neuron")()


_MASK = [True, True, False, True, False]


@pytest.mark.parametrize("self_shape,lead,values_shape", [
    ((5, 5), 0, (5,)), ((5, 5), 0, (3, 5)), ((5, 5), 0, (1, 5)), ((5, 5), 0, ()), ((5, 5), 0, (3, 1)),
    ((4, 5), 1, (4, 3)), ((4, 5), 1, (3,)), ((4, 5), 1, (4, 1)), ((4, 5, 2), 1, (3, 2)), ((4, 5, 2), 1, (4, 3, 2)),
])
@pytest.mark.parametrize("accumulate", [False, True])
def test_compiled_bool_mask_index_put_matches_cpu(self_shape, lead, values_shape, accumulate):
    """``x[mask] = v`` in a graph: values broadcast to ``x[mask]`` from the right, so a row of
    values repeats at every True position and only a leading dim of the True count varies."""
    torch.manual_seed(0)
    x, v, mask = torch.randn(self_shape), torch.randn(values_shape), torch.tensor(_MASK)
    indices = [None] * lead + [mask]
    want = torch.ops.aten.index_put(x, indices, v, accumulate)
    torch._dynamo.reset()
    f = torch.compile(lambda x, m, v: torch.ops.aten.index_put(x, [None] * lead + [m], v, accumulate),
                      backend="neuron")
    got = f(x.to("neuron"), mask.to("neuron"), v.to("neuron"))
    torch.testing.assert_close(got.cpu(), want)
