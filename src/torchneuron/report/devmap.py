"""``--device-map cuda=neuron`` for ``torchneuron check``: the device mapping of
``torchneuron.transfer_cuda()`` (``integrations/cuda.py``), installed in the process that runs the
user's script. The CPU baseline run uses the same mechanism with ``neuron=cpu`` (and ``cuda=cpu``)."""

from __future__ import annotations

from ..integrations.cuda import DeviceMap, compose, parse

__all__ = ["DeviceMap", "compose", "parse"]
