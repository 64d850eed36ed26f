"""``torchneuron doctor``: a preflight that checks, in seconds and before any model code, what a long
run would otherwise find out late: versions and the platform, the device each torchrun rank would
use, a small collective across the ranks, the compile cache folder, the multiprocessing start method
and the settings in force.

Each check is ok, warn, FAIL (with the way out) or skip; :func:`exit_status` is 1 when any failed.
"""

from __future__ import annotations

import datetime
import difflib
import multiprocessing
import os
import shutil
import tempfile

from ..versions import PINNED, differs

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
CHECKS = ("versions", "platform", "rank device", "collective", "cache folder", "multiprocessing", "settings")
# TORCHNEURON_* variables that are not config fields but are read by torchneuron.
_OTHER_VARIABLES = {"TORCHNEURON_CACHE_LOOKUP_LOG"}


def _result(name, status, detail, fix=None, **data) -> dict:
    return {"check": name, "status": status, "detail": detail, "fix": fix, **data}


def _int_env(environ, name):
    raw = environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def check_versions(info: dict, absent_lowerings=()) -> dict:
    """ok on the pinned stack; warn on another (it may run: README's tested combinations), naming
    the releases that differ and the lowerings left out because the installed torch lacks their op."""
    keys = ("python", "torch", "jax", "jaxlib", "numpy", "torchneuron")
    detail = ", ".join(f"{k} {info[k]}" for k in keys)
    off = [f"{k} {info[k]} (pinned {want})" for k, want in PINNED.items() if differs(info[k], want)]
    if not off:
        return _result("versions", OK, detail, versions={k: info[k] for k in keys})
    detail += "; not the pinned stack: " + ", ".join(off)
    if absent_lowerings:
        detail += f"; this torch lacks {len(absent_lowerings)} op(s) a lowering is written for: " + \
            ", ".join(absent_lowerings)
    return _result("versions", WARN, detail,
                   "the README's 'Tested combinations' lists what else was run; `make test` installs the pinned stack",
                   versions={k: info[k] for k in keys}, absent_lowerings=list(absent_lowerings))


def check_platform(info: dict) -> dict:
    if info.get("pjrt_error"):
        return _result("platform", FAIL, f"PJRT platform {info['pjrt_platform']!r} did not start: {info['pjrt_error']}",
                       "check TORCHNEURON_PLATFORM (cpu, cuda, tpu, neuron) and that its PJRT plugin is installed",
                       platform=info["pjrt_platform"], device_count=0)
    return _result("platform", OK, f"{info['pjrt_platform']} ({info.get('device_kind')}), "
                   f"{info['device_count']} device(s) visible", platform=info["pjrt_platform"],
                   device_count=info["device_count"], pjrt_version=info.get("pjrt_version"))


def rank_device(environ, device_count: int, setting: str, platform: str) -> dict:
    """The neuron device this process would use under torchrun (LOCAL_RANK), as config.visible_device
    maps it (runtime/startup.py): a restricted process sees only its rank's device, as neuron:0."""
    from ..runtime.startup import visible_device  # loaded only when the check runs
    try:
        local_rank, rank, world = (_int_env(environ, v) for v in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    except ValueError as err:
        return _result("rank device", FAIL, str(err), "torchrun sets LOCAL_RANK, RANK and WORLD_SIZE; unset them "
                       "or set them to integers")
    if local_rank is None:
        if device_count < 1:
            return _result("rank device", FAIL, "no device visible", "see the platform check")
        return _result("rank device", OK, f"not under torchrun (no LOCAL_RANK): neuron:0 of {device_count}",
                       device="neuron:0")
    who = f"rank {rank if rank is not None else '?'} (LOCAL_RANK={local_rank}, WORLD_SIZE={world})"
    if world is not None and rank is not None and not 0 <= rank < world:
        return _result("rank device", FAIL, f"{who}: RANK is not below WORLD_SIZE",
                       "let torchrun set RANK and WORLD_SIZE, or set RANK in 0..WORLD_SIZE-1")
    try:
        restricted = visible_device(setting, platform, environ)
    except RuntimeError as err:
        return _result("rank device", FAIL, f"{who}: {err}", "see config.visible_device in docs/configuration.md")
    if restricted is not None:
        if device_count < 1:
            return _result("rank device", FAIL, f"{who}: {platform} device {restricted} "
                           f"(config.visible_device={setting!r}) is not visible",
                           f"run at most as many ranks per node as there are {platform} devices "
                           "(torchrun --nproc-per-node N)")
        return _result("rank device", OK, f"{who}: sees only {platform} device {restricted}, as neuron:0 "
                       f"(config.visible_device={setting!r})", device="neuron:0", physical_device=restricted)
    if local_rank >= device_count:
        return _result("rank device", FAIL,
                       f"{who}: neuron:{local_rank} does not exist, this process sees {device_count} device(s)",
                       f"run at most {device_count} rank(s) per node (torchrun --nproc-per-node {device_count}); "
                       "on the CPU platform force more devices with "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=N; or pick "
                       "torch.device('neuron', local_rank % torch.neuron.device_count()) to share devices",
                       device_count=device_count)
    return _result("rank device", OK, f"{who}: neuron:{local_rank} of {device_count} visible",
                   device=f"neuron:{local_rank}")


def collective(device: str, rank: int, world_size: int, timeout: float, environ=os.environ) -> dict:
    """An all_reduce of a small neuron tensor across all ranks through the "neuron" backend."""
    import torch
    import torch.distributed as dist
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(v)]
    fix = (f"every rank must run this with the same MASTER_ADDR/MASTER_PORT (set by torchrun; reachable from "
           f"each node, the port free on the master), backend 'neuron' (init_process_group('neuron')), and all "
           f"{world_size} ranks started within the timeout ({timeout:g} s, --timeout)")
    if missing:
        return _result("collective", FAIL, f"{' and '.join(missing)} not set for a {world_size}-rank group", fix)
    own = not dist.is_initialized()
    try:
        if own:
            dist.init_process_group("neuron", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        got, want = t.cpu().tolist(), [world_size * (world_size + 1) / 2] * 4
    except Exception as err:   # every failure of the rendezvous or the collective is this check's result
        return _result("collective", FAIL, f"all_reduce across {world_size} ranks "
                       f"(MASTER_ADDR={environ['MASTER_ADDR']}, MASTER_PORT={environ['MASTER_PORT']}) failed: "
                       f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", fix)
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()
    if got != want:
        return _result("collective", FAIL, f"all_reduce across {world_size} ranks gave {got}, expected {want}",
                       "report this as a torchneuron bug (the neuron backend reduced wrongly)")
    return _result("collective", OK, f"all_reduce of a {device} tensor across {world_size} ranks "
                   f"({environ['MASTER_ADDR']}:{environ['MASTER_PORT']})")


def check_cache(directory: str) -> dict:
    """The cache folder exists or can be created, takes a file, and holds how many entries."""
    from .. import cache_tools  # loaded with the check: the CLI imports this module for every command
    if not directory:
        return _result("cache folder", WARN, "the persistent compile cache is off (TORCHNEURON_CACHE_DIR is empty): "
                       "every process compiles everything", "set TORCHNEURON_CACHE_DIR to a writable folder")
    path = os.path.abspath(directory)
    fix = f"make {path} a writable folder, or point TORCHNEURON_CACHE_DIR (--cache-dir) at one"
    if os.path.exists(path) and not os.path.isdir(path):
        return _result("cache folder", FAIL, f"{path} is a file, not a folder", fix, path=path)
    # The topmost folder this check creates is removed again: a preflight leaves no trace.
    created = path
    while not os.path.exists(os.path.dirname(created)) and os.path.dirname(created) != created:
        created = os.path.dirname(created)
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=cache_tools.DOCTOR_PROBE_PREFIX) as probe:
            probe.write(b"probe")
            probe.flush()
    except OSError as err:
        return _result("cache folder", FAIL, f"cannot {'write to' if existed else 'create'} the cache folder {path} "
                       f"({err.strerror or err})", fix, path=path)
    finally:
        if not existed and os.path.isdir(created):
            shutil.rmtree(created, ignore_errors=True)
    entries = sum(cache_tools.scan(path)["entries"].values()) if existed else 0
    state = f"warm, {entries} entries" if entries else "cold, empty: the first run compiles everything"
    return _result("cache folder", OK, f"{path}: writable{'' if existed else ' (created at first use)'}, {state}",
                   path=path, entries=entries)


def check_multiprocessing(runtime_started: bool) -> dict:
    method = multiprocessing.get_start_method(allow_none=True)
    default = method is None
    method = method or multiprocessing.get_context().get_start_method()
    which = f"start method {method!r}{' (the default)' if default else ''}"
    if method != "fork":
        return _result("multiprocessing", OK, f"{which}: DataLoader workers do not inherit the neuron runtime",
                       start_method=method, runtime_started=runtime_started)
    if runtime_started:
        return _result("multiprocessing", WARN, f"{which}, and the neuron runtime already runs in this process: "
                       "a forked DataLoader worker that touches a neuron tensor raises "
                       "'Cannot re-initialize the neuron device in forked subprocess'",
                       "DataLoader(..., multiprocessing_context='spawn'), or keep worker code on CPU tensors",
                       start_method=method, runtime_started=True)
    return _result("multiprocessing", OK, f"{which}, the neuron runtime not started yet: workers forked before the "
                   "first neuron op may use the device; after it, only CPU tensors (docs/reliability.md)",
                   start_method=method, runtime_started=False)


def check_settings(info: dict, environ=os.environ) -> dict:
    import dataclasses

    from ..config import Config  # not at the top: importing config reads the environment
    known = {f"TORCHNEURON_{f.name.upper()}" for f in dataclasses.fields(Config)} | _OTHER_VARIABLES
    variables = {k: v for k, v in sorted(environ.items()) if k.startswith("TORCHNEURON_")}
    settings = info["settings"]
    detail = "; ".join([*(f"config.{k}={v!r}" for k, v in settings.items()),
                        *(f"{k}={v!r}" for k, v in variables.items())]) or "all defaults, no TORCHNEURON_* variable"
    unknown = [k for k in variables if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1)
            hints.append(f"{k} (did you mean {close[0]}?)" if close else k)
        return _result("settings", WARN, f"{detail}; not a torchneuron setting: {', '.join(hints)}",
                       "rename or unset it (docs/configuration.md lists every setting)",
                       settings=settings, variables=variables)
    return _result("settings", OK, detail, settings=settings, variables=variables)


def run_checks(cache_dir: str | None = None, timeout: float = 30.0, environ=os.environ) -> list[dict]:
    """Every check, in CHECKS order. Starts the neuron runtime (the platform check needs it)."""
    # Not at the top: the runtime modules start nothing until a check asks for them.
    from ..config import config
    from ..ops.registry import ABSENT
    from ..runtime.fork import runtime_started
    from .env import manifest
    started_before = runtime_started()   # before this check starts it
    info = manifest()
    results = [check_versions(info, ABSENT), check_platform(info)]
    device = rank_device(environ, info["device_count"], config.visible_device, info["pjrt_platform"])
    results.append(device)
    try:
        world, rank = _int_env(environ, "WORLD_SIZE"), _int_env(environ, "RANK")
    except ValueError:
        world = rank = None
    if world is None or world <= 1:
        results.append(_result("collective", SKIP, f"single process (WORLD_SIZE={world if world is not None else 'unset'})"))
    elif rank is None:
        results.append(_result("collective", FAIL, f"WORLD_SIZE={world} but RANK is not set", "run under torchrun"))
    else:
        # A rank whose own device is wrong still joins on a device it has, so the others do not wait for it.
        target = device.get("device") or "neuron:0"
        results.append(collective(target, rank, world, timeout, environ))
    results.append(check_cache(config.cache_dir if cache_dir is None else cache_dir))
    results.append(check_multiprocessing(started_before))
    results.append(check_settings(info, environ))
    return results


def exit_status(results: list[dict]) -> int:
    return 1 if any(r["status"] == FAIL for r in results) else 0


def table(results: list[dict]) -> str:
    width = max(len(r["check"]) for r in results)
    lines = []
    for r in results:
        lines.append(f"{r['status']:5} {r['check']:{width}}  {r['detail']}")
        if r["fix"] and r["status"] in (FAIL, WARN):
            lines.append(f"{'':5} {'':{width}}  way out: {r['fix']}")
    failed = sum(r["status"] == FAIL for r in results)
    warned = sum(r["status"] == WARN for r in results)
    lines.append(f"torchneuron doctor: {failed} failed, {warned} warning(s), {len(results)} checks")
    return "\n".join(lines)
