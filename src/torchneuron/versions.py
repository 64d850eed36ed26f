"""The releases torchneuron is pinned to and tested with, and how the installed ones compare.

The project pins one stack (pyproject.toml); the package also runs on neighbouring releases
(README, "Tested combinations"). Code that depends on a release feature-detects it; this module only
says whether the installed torch is the pinned one, where a missing op means a typo rather than an
older release.
"""

from __future__ import annotations

import torch

PINNED = {"python": "3.11", "torch": "2.13.0", "jax": "0.10.2"}


def _release(version: str) -> str:
    return version.split("+")[0]


def differs(installed: str, pinned: str) -> bool:
    """``installed`` is another release than ``pinned`` (a local build tag such as "+cpu" aside;
    "3.11" pins a minor release, so 3.11.9 matches it)."""
    parts = pinned.split(".")
    return _release(installed).split(".")[:len(parts)] != parts


def pinned_torch() -> bool:
    """The installed torch is the release the op tables were written against."""
    return not differs(torch.__version__, PINNED["torch"])
