"""Adaptive eager mode (opt-in): records ops and runs pending regions as fused executables."""

from __future__ import annotations


def flush(reason: str) -> None:
    """Run every pending recorded op. Plain eager mode records nothing, so there is nothing to do."""
    return None
