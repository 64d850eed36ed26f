"""The OpInfo harness judges random ops by their distribution too (a two-sample test against CPU's
draws): the property checks alone pass an all-zero normal() or a dropout that never drops."""

from __future__ import annotations

import pytest
import torch

from . import harness


def _entry(name):
    return next(op for op in harness.op_db if harness.name_of(op) == name)


def _first_sample(op):
    """The first sample that draws (dropout: in training, with 0 < p < 1)."""
    return next(s for s in op.sample_inputs("cpu", torch.float32)
                if s.kwargs.get("training", True) and 0 < s.kwargs.get("p", 0.5) < 1)


def _calls(name):
    """The entry's first drawing sample: (sample, its input on neuron, the CPU call, the neuron call)."""
    op = _entry(name)
    sample = _first_sample(op)
    inp, args, kwargs = harness._move(sample, name=name)
    return (sample, inp, lambda: op(sample.input, *sample.args, **sample.kwargs),
            lambda: op(inp, *args, **kwargs))


@pytest.mark.parametrize("name", ["normal", "nn.functional.dropout", "exponential"])
def test_right_draws_pass_and_wrong_ones_fail(name):
    sample, inp, cpu, neuron = _calls(name)

    def wrong():       # the right shape and dtype: a wrong spread, or a dropout that never drops
        if name == "nn.functional.dropout":
            return inp / (1 - sample.kwargs.get("p", 0.5))
        return neuron() * 0.5

    assert harness._same_distribution(cpu, neuron, sample) is None
    msg = harness._same_distribution(cpu, wrong, sample)
    assert msg is not None and msg.startswith("distribution: two-sample KS statistic"), msg


def test_all_zero_normal_passes_properties_but_fails_the_distribution():
    op = _entry("normal")
    sample = _first_sample(op)
    zeros = torch.zeros_like(op(sample.input, *sample.args, **sample.kwargs))
    assert harness.RANDOM["normal"](zeros, sample) is None            # finite: the old check passed it
    msg = harness._same_distribution(lambda: op(sample.input, *sample.args, **sample.kwargs),
                                     lambda: zeros.to("neuron") + torch.randn(()).to("neuron") * 0, sample)
    assert msg is not None


@pytest.mark.parametrize("name", ["nn.functional.dropout2d"])
def test_dependent_draws_are_compared_per_run(name):
    sample, inp, cpu, neuron = _calls(name)

    def never_drops():   # every element kept and scaled: the expectation is right, the spread is not
        return inp / (1 - sample.kwargs.get("p", 0.5))

    assert harness._same_distribution(cpu, neuron, sample, dependent=True) is None
    msg = harness._same_distribution(cpu, never_drops, sample, dependent=True)
    assert msg is not None and "per-run" in msg, msg
