"""The CPU platform's device memory is the process's heap: keep what it frees, like a caching allocator.

XLA:CPU allocates every buffer of an execution (outputs and the temporary block) with ``malloc``.
glibc serves blocks above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and gives them
back on ``free``, and it unmaps an idle thread heap: so each training step page-faults its large
buffers in again (the GPT step of bench/compile.py: 94 MiB of 4 KiB pages a step, ~20% of its time;
docs/performance.md). ``retain_freed_memory`` tells glibc to serve every block from one heap and to
keep freed memory (``mallopt``: no mmap blocks, no trimming, one arena), as a GPU's caching
allocator keeps freed device memory; ``torch.neuron.empty_cache()`` hands it back (``malloc_trim``).

The setting is process-wide (it also serves PyTorch's own CPU tensors, which benefit alike) and
applies only on glibc; elsewhere it is a no-op.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int: the largest, 2 GiB of free memory at the heap's top before it is trimmed.
_NEVER_TRIM = 2**31 - 1
# glibc's own defaults, to go back to.
_DEFAULT_MMAP_MAX = 65536
_DEFAULT_TRIM_THRESHOLD = 128 * 1024

_retained = False


def _glibc():
    """The process's glibc (None elsewhere: musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory() -> bool:
    """Keep freed heap memory in the process (True when applied)."""
    global _retained
    if _retained:
        return True
    libc = _glibc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
    _retained = ok
    return ok


def follow(wanted: bool) -> None:
    """Apply ``config.cpu_retain_freed_memory`` as it is now: retain, or give glibc back its
    defaults (at import, and again when the device starts on another platform or with it off).
    Earliest is best: a thread heap made before it keeps freeing its blocks."""
    global _retained
    if wanted:
        retain_freed_memory()
        return
    if _retained:
        libc = _glibc()
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        _retained = False
        libc.malloc_trim(ctypes.c_size_t(0))


def retained() -> bool:
    return _retained


def release_freed_memory() -> None:
    """Give the heap's free memory back to the operating system (``empty_cache``)."""
    if _retained:
        libc = _glibc()
        if libc is not None:
            libc.malloc_trim(ctypes.c_size_t(0))
