"""Architecture coverage of Hugging Face causal LMs on neuron: ``python -m tools.hf_coverage``.

For every entry of the installed transformers' causal-LM auto mapping it builds a tiny
random-weight configuration (``hf_configs``: few layers, small hidden size, small vocabulary;
nothing downloaded), instantiates the model on CPU, and compares neuron against that CPU oracle:

* forward: logits and loss (labels = inputs);
* backward: the gradient of every parameter;
* greedy ``generate()``: token for token (dynamic cache), when forward passed.

Each architecture ends as ``pass``, ``fail`` (with the first mismatch or error) or ``not-buildable``
(its configuration or model cannot be instantiated offline without extra packages, with the reason).
The CPU fallbacks each model used on neuron are recorded. Results go to ``docs/hf_coverage.md``
(``hf_report``).

Architectures run in worker processes (``sweep``: compiled executables are shared between models of
equal shapes); a worker that crashes or hangs is replaced and the architecture is recorded as failed.
Needs transformers (``pip install -e ".[hf]"``); run it from the repository root:
``python -m tools.hf_coverage``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

try:
    import transformers  # noqa: F401  (checked first, for the message below)
except ImportError as err:
    raise ImportError("tools.hf_coverage needs transformers: pip install -e \".[hf]\" "
                      "(or the transformers version pyproject.toml pins)") from err
import jax
import torch
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)
from transformers.utils import logging as hf_logging

import torchneuron

from . import sweep as resumable
from .hf_configs import (
    BATCH,
    HIDDEN,
    LAYERS,
    NEW_TOKENS,
    SEQ_LEN,
    VOCAB,
    NotBuildable,
    first_line,
    rejection_reason,
    tiny_config,
)
from .hf_report import pct, render, summarise

DEFAULT_RESULTS = resumable.default_path("build/hf_coverage/results.jsonl")
DEFAULT_OUTPUT = resumable.default_path("docs/hf_coverage.md")

# Tolerances against the CPU oracle (float32 everywhere; XLA may reassociate sums). Logits:
# |neuron - cpu| <= LOGITS_ATOL * max(1, max|cpu|) + LOGITS_RTOL * |cpu|, elementwise.
LOGITS_RTOL, LOGITS_ATOL = 1e-3, 1e-4
GRAD_RTOL = 2e-3


# -- one architecture ------------------------------------------------------------------------------
def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _inputs(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # Ids above the special tokens the tiny configs use (0..3 and VOCAB-15..VOCAB-1).
    ids = torch.randint(4, min(vocab, VOCAB) - 16, (BATCH, SEQ_LEN), generator=g)
    return ids, torch.ones_like(ids)


def build_model(model_type: str, seed: int = 0):
    """The tiny model (CPU, eval mode, seeded random weights) and its config."""
    cfg = tiny_config(model_type)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(cfg, wanted):
        # Composite configs whose causal-LM class takes one of their parts (musicgen's decoder).
        part = next((getattr(cfg, k) for k in getattr(cfg, "sub_configs", {}) if isinstance(getattr(cfg, k, None), wanted)),
                    None)
        cfg = part if part is not None else cfg
    torch.manual_seed(seed)
    try:
        # The class itself: a sub-config (emu3's text config) has no entry of its own in the mapping.
        model = model_cls._from_config(cfg)
    except ImportError as err:
        raise NotBuildable(f"needs an extra package: {first_line(err) or 'ImportError'}") from err
    except Exception as err:
        raise NotBuildable(rejection_reason(model_type, err)) from err
    prepare = _PREPARE.get(model_type)
    if prepare is not None:
        prepare(model)
    _break_ties(model, seed)
    return model.eval(), cfg


def _break_ties(model, seed: int) -> None:
    """Give constant-initialised weights (zero router gates, zero expert-score biases, unit norms)
    a little seeded noise. Otherwise every router score is equal and top-k picks among exact ties,
    whose order PyTorch leaves unspecified (CPU and CUDA already differ), which would compare
    arbitrary expert choices instead of the model. Trained checkpoints have no such ties."""
    g = torch.Generator().manual_seed(seed + 1)
    tensors = [p for p in model.parameters()]
    tensors += [b for n, b in model.named_buffers() if "bias" in n.rsplit(".", 1)[-1]]
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point() and t.numel() > 1 and bool((t == t.reshape(-1)[0]).all()):
                t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.02)


def _xmod_language(model):
    model.set_default_language(next(iter(model.config.languages)))


# Set-up an architecture needs before its first forward (not a config field).
_PREPARE = {"xmod": _xmod_language}
# Architectures whose backward refuses eval mode: forward and backward run in training mode (every
# dropout probability is zero in the tiny configs, so the result is the same), generate in eval mode.
_TRAIN_MODE_BACKWARD = {"reformer"}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


def _forward_backward(model, ids, mask):
    """(logits, loss, {param name: grad}) of one forward+backward with labels = ids."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return _logits(out).detach().cpu(), loss.detach().cpu(), grads


def _generate(model, ids, mask, **kwargs):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, pad_token_id=_pad_id(model), **kwargs)
    return out.cpu()


def _pad_id(model):
    cfg = model.generation_config
    for v in (cfg.pad_token_id, cfg.eos_token_id, 0):
        if isinstance(v, int):
            return v
        if isinstance(v, list) and v:
            return v[0]
    return 0


def _close(a, b, rtol, atol) -> tuple[bool, float]:
    if a.shape != b.shape:
        return False, float("inf")
    a, b = a.float(), b.float()
    err = (a - b).abs()
    # float32 rounding grows with the size of the values: atol is relative to the largest one.
    finite_ref = b[torch.isfinite(b)]
    scale = max(1.0, float(finite_ref.abs().max())) if finite_ref.numel() else 1.0
    bad = err > atol * scale + rtol * b.abs()
    finite = torch.isfinite(a) == torch.isfinite(b)
    return bool((~bad).all() and finite.all()), float(err[torch.isfinite(err)].max()) if err.numel() else 0.0


def _grads_close(neuron: dict, cpu: dict) -> tuple[bool, str, float]:
    """Per parameter: ||g_neuron - g_cpu|| <= GRAD_RTOL * ||g_cpu|| (+ a floor from the largest grad)."""
    if set(neuron) != set(cpu):
        missing = sorted(set(cpu) ^ set(neuron))[:3]
        return False, f"parameters with gradients differ: {missing}", float("inf")
    scale = max((float(g.float().norm()) for g in cpu.values()), default=0.0)
    worst, worst_name = 0.0, ""
    for name, g in cpu.items():
        ref = g.float()
        diff = float((neuron[name].float() - ref).norm())
        rel = diff / (float(ref.norm()) + 1e-3 * scale + 1e-12)
        if not rel <= worst and rel == rel:
            worst, worst_name = rel, name
        if rel != rel:   # NaN
            return False, f"NaN gradient for {name}", float("nan")
    return worst <= GRAD_RTOL, worst_name, worst


def _greedy_tie(model_cpu, tokens_cpu, tokens_neuron, ids, mask) -> float | None:
    """Where greedy outputs first differ: the CPU logit gap between the two chosen tokens."""
    diff = (tokens_cpu != tokens_neuron).nonzero()
    if not len(diff):
        return None
    row, col = int(diff[0, 0]), int(diff[0, 1])
    with torch.no_grad():
        prefix = tokens_cpu[row:row + 1, :col]
        logits = _logits(model_cpu(input_ids=prefix, use_cache=False))[0, -1]
    return float(logits[tokens_cpu[row, col]] - logits[tokens_neuron[row, col]])


def check_architecture(model_type: str, generate: bool = True) -> dict:
    """Run one architecture on neuron against CPU; returns its result row (never raises)."""

    row = {"arch": model_type, "status": "fail", "reason": "", "fallbacks": {}, "forward": None,
           "backward": None, "generate": None, "seconds": 0.0}
    start = time.perf_counter()
    try:
        try:
            model, cfg = build_model(model_type)
        except NotBuildable as err:
            row.update(status="not-buildable", reason=str(err))
            return row
        row["model_class"] = type(model).__name__
        row["params"] = sum(p.numel() for p in model.parameters())
        vocab = getattr(cfg.get_text_config(), "vocab_size", VOCAB) or VOCAB
        ids, mask = _inputs(vocab)
        # Copied before the CPU run: some models keep tensors of their last forward as attributes
        # (recurrent_gemma's recurrent and conv states), which are not graph leaves and cannot be
        # deep-copied afterwards.
        neuron_model = copy.deepcopy(model)
        if model_type in _TRAIN_MODE_BACKWARD:
            model.train()
            neuron_model.train()
        try:
            ref_logits, ref_loss, ref_grads = _forward_backward(model, ids, mask)
        except Exception as err:
            row.update(status="not-buildable", reason=f"CPU reference fails: {type(err).__name__}: {first_line(err)}")
            return row
        neuron_model = neuron_model.to("neuron")
        before = torchneuron.metrics()["fallbacks"]
        try:
            logits, loss, grads = _forward_backward(neuron_model, ids.to("neuron"), mask.to("neuron"))
        except Exception as err:
            row["reason"] = f"forward/backward on neuron raised {type(err).__name__}: {first_line(err)}"
            row["traceback"] = traceback.format_exc()[-3000:]
            return row
        finally:
            row["fallbacks"] = _delta(before, torchneuron.metrics()["fallbacks"])
        ok_logits, err_logits = _close(logits, ref_logits, LOGITS_RTOL, LOGITS_ATOL)
        ok_loss, err_loss = _close(loss, ref_loss, LOGITS_RTOL, LOGITS_ATOL)
        row["forward"] = {"ok": ok_logits and ok_loss, "logits_max_abs_err": err_logits, "loss_abs_err": err_loss}
        if not row["forward"]["ok"]:
            row["reason"] = f"forward mismatch: logits max abs err {err_logits:.3g}, loss err {err_loss:.3g}"
            return row
        ok_grads, where, worst = _grads_close(grads, ref_grads)
        row["backward"] = {"ok": ok_grads, "worst_param": where, "worst_rel_err": worst}
        if not ok_grads:
            row["reason"] = f"backward mismatch: {where} relative error {worst:.3g}"
            return row
        if generate:
            model.eval()
            neuron_model.eval()
            row["generate"] = _check_generate(model, neuron_model, ids, mask, row)
            if row["generate"]["ok"] is None:
                # CPU itself cannot generate: nothing to compare, so not a pass (nor a failure).
                row["status"] = "generate-not-compared"
                row["reason"] = row["generate"]["not_compared"]
                return row
            if not row["generate"]["ok"]:
                row["reason"] = row["generate"]["reason"]
                return row
        row["status"] = "pass"
        return row
    except Exception as err:  # a bug in this tool or in transformers: recorded, the sweep goes on
        row["reason"] = f"{type(err).__name__}: {first_line(err)}"
        row["traceback"] = traceback.format_exc()[-3000:]
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - start, 2)


def _check_generate(model, neuron_model, ids, mask, row) -> dict:
    try:
        ref = _generate(model, ids, mask)
    except Exception as err:
        return {"ok": None, "not_compared": f"CPU generate fails: {type(err).__name__}: {first_line(err)}"}
    before = torchneuron.metrics()["fallbacks"]
    try:
        out = _generate(neuron_model, ids.to("neuron"), mask.to("neuron"))
    except Exception as err:
        row["traceback"] = traceback.format_exc()[-3000:]
        return {"ok": False, "reason": f"generate on neuron raised {type(err).__name__}: {first_line(err)}"}
    finally:
        for op, n in _delta(before, torchneuron.metrics()["fallbacks"]).items():
            row["fallbacks"][op] = row["fallbacks"].get(op, 0) + n
    if out.shape == ref.shape and bool((out == ref).all()):
        return {"ok": True, "tokens": int(out.shape[1] - ids.shape[1])}
    gap = _greedy_tie(model, ref, out, ids, mask) if out.shape == ref.shape else None
    if gap is not None and abs(gap) < 1e-4:
        # Two candidate tokens with equal CPU logits: either choice is a correct greedy step.
        return {"ok": True, "tie": gap, "tokens": int(out.shape[1] - ids.shape[1])}
    return {"ok": False, "reason": f"greedy tokens differ from CPU (logit gap at first difference: {gap})"}


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# -- the sweep -------------------------------------------------------------------------------------
def _results(path: Path) -> resumable.ResultsFile:
    """One row per architecture (the last one written counts)."""
    return resumable.ResultsFile(path, lambda row: row.get("arch"))


def _append(results: Path, row: dict) -> None:
    _results(results).append(row)


_run_info = resumable.run_info


def _worker(archs: list[str], results: Path, timeout: int, generate: bool, run: dict | None = None) -> None:
    """Runs in a child process: one JSON line per architecture, each with ``run`` (the command that
    produced it, when and at which commit)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torchneuron.config.fallback = "silent"
    _enable_jax_cache()

    def alarm(signum, frame):
        raise TimeoutError(f"over {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    for arch in archs:
        print(f"[hf_coverage] {arch} ...", file=sys.stderr, flush=True)
        signal.alarm(timeout)
        try:
            row = check_architecture(arch, generate=generate)
        finally:
            signal.alarm(0)
        _append(results, {**row, "run": _run_info(run)})
        print(f"[hf_coverage] {arch}: {row['status']} {row['reason'][:160]} ({row['seconds']} s)",
              file=sys.stderr, flush=True)


def _enable_jax_cache() -> None:
    """Re-sweeps reuse compiled executables through JAX's persistent compilation cache."""
    path = os.environ.get("TORCHNEURON_HF_JAX_CACHE", str(Path.home() / ".cache" / "torchneuron" / "hf-jax"))
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def sweep(archs: list[str], results: Path, timeout: int, generate: bool, jobs: int = 1,
          run: dict | None = None) -> None:
    """Run those of ``archs`` that have no row in ``results`` yet, in ``jobs`` worker processes (each
    keeps its compiled executables across its architectures); a worker that dies is replaced and
    the architecture it was on is failed. ``run`` (command, commit) is recorded in every row."""
    results.parent.mkdir(parents=True, exist_ok=True)
    done = _results(results).done()
    todo = [a for a in archs if a not in done]
    resumable.in_parallel(todo, jobs, lambda share: _run_shard(share, results, timeout, generate, run))


def _run_shard(archs: list[str], results: Path, timeout: int, generate: bool, run: dict | None = None) -> None:
    def command(todo):
        return [*resumable.tool_command("hf_coverage"), "--worker", "--results", str(results),
                "--timeout", str(timeout), *(["--no-generate"] if not generate else []),
                "--run-info", json.dumps(run or {}), *todo]

    def crashed(arch, code):
        _append(results, {"arch": arch, "status": "fail", "fallbacks": {}, "seconds": 0,
                          "reason": f"worker process died (exit code {code})", "run": _run_info(run)})

    resumable.run_worker(archs, _results(results), command, crashed, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hf_coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("archs", nargs="*", help="model types to run (default: every causal-LM architecture)")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="JSON-lines results file")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report to write")
    p.add_argument("--resume", action="store_true",
                   help="keep results already in --results; architectures named on the command line are run "
                        "again (their old rows are replaced), with none named only those without a row run")
    p.add_argument("--render-only", action="store_true", help="write the report from --results only")
    p.add_argument("--timeout", type=int, default=600, help="seconds per architecture")
    p.add_argument("--no-generate", action="store_true", help="skip the greedy generate check")
    p.add_argument("--jobs", type=int, default=1, help="worker processes run in parallel")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-info", default="{}", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.worker:
        _worker(args.archs, args.results, args.timeout, not args.no_generate, json.loads(args.run_info))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    command = " ".join(["python -m tools.hf_coverage", *map(shlex.quote, raw)])
    archs = args.archs or causal_lm_types()
    start = time.perf_counter()
    if not args.render_only:
        if not args.resume:
            _results(args.results).clear()
        elif args.resume and args.archs:
            _results(args.results).drop(args.archs)   # named again: run them, not keep their old rows
        sweep(archs, args.results, args.timeout, not args.no_generate, args.jobs,
              run={"command": command, "commit": resumable.source_revision()})
    wall = time.perf_counter() - start
    done = _results(args.results).done()
    # A resumed or re-rendered sweep reports every architecture of the mapping, not only those named.
    scope = archs if args.archs and not args.resume else sorted(set(causal_lm_types()) | set(archs))
    rows = [done[a] for a in scope if a in done]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(rows, command, [a for a in scope if a not in done]) + "\n")
    s = summarise(rows)
    print(f"{s['passed']}/{s['buildable']} buildable architectures pass ({pct(s['passed'], s['buildable'])}); "
          f"{s['not_buildable']} not buildable; {len(scope) - len(rows)} not run; wall {wall:.0f} s; "
          f"report: {args.output}")
    return 0


# What tests and other tools use from here.
__all__ = ["BATCH", "HIDDEN", "LAYERS", "NEW_TOKENS", "SEQ_LEN", "VOCAB", "NotBuildable", "build_model",
           "causal_lm_types", "check_architecture", "main", "render", "summarise", "sweep", "tiny_config"]


if __name__ == "__main__":
    sys.exit(main())
