"""Kernels whose result shape depends on tensor values, and small host-side decisions.

``nonzero``, ``masked_select``, boolean-mask indexing and friends need the data to know their
output shape, so (like CUDA) they synchronise: the mask is read back, the positions are computed on
the host and uploaded. Every such read is counted as a device->host copy.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from ..runtime import memory, transfers

_SDP_MATH = int(torch._C._SDPBackend.MATH)


def _device_tensor(host: np.ndarray, dtype: torch.dtype, device_index: int) -> torch.Tensor:
    """A new neuron tensor holding ``host``: one counted host->device copy. Unlike ``.to(device)``
    (a copy_ into a storage a pending adaptive region might write), it leaves that region pending."""
    arr = transfers.upload(np.ascontiguousarray(host).reshape(-1), device_index)
    return memory.new_buffer_tensor(arr, dtype, device_index, host.shape, memory.contiguous_strides(host.shape))


def _upload_int64(positions: np.ndarray, device_index: int) -> torch.Tensor:
    return _device_tensor(positions.astype(np.int64, copy=False), torch.int64, device_index)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index, mask or 0-d value on ``device``, as ATen's indexing moves it there."""
    if t.device.type == "cpu":
        return _device_tensor(transfers.host_array(t), t.dtype, device.index or 0)
    return t.to(device)


def nonzero(self: torch.Tensor) -> torch.Tensor:
    host = transfers.to_host(self)
    # A 0-d tensor has one (empty) position when it is nonzero: shape (1, 0) or (0, 0).
    positions = np.stack(np.nonzero(host), axis=1) if host.ndim else np.zeros((int(host != 0), 0), np.int64)
    return _upload_int64(positions.reshape(positions.shape[0], host.ndim), self.device.index or 0)


def _device_indices(self, indices):
    """Index tensors as the lowering takes them: every one on ``self``'s device, masks replaced by
    the integer positions they select (PyTorch semantics). As on CUDA, index tensors and masks may
    live on the CPU: a CPU mask is read where it is (no device round trip), a CPU index moves."""
    out = []
    dim = 0    # the first of self's dimensions the next index applies to
    for idx in indices:
        if idx is not None and idx.dtype in (torch.bool, torch.uint8):
            _check_mask_shape(self, idx, dim)
        dim += 1 if idx is None or idx.dtype not in (torch.bool, torch.uint8) else idx.dim()
        if idx is not None and idx.dtype == torch.uint8:
            warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool "
                          "instead.", UserWarning, stacklevel=3)   # ATen's warning
        if idx is None:
            out.append(None)
        elif idx.dtype in (torch.bool, torch.uint8):
            if idx.device.type == "neuron":
                positions = nonzero(idx)
            else:
                positions = _upload_int64(np.stack(np.nonzero(idx.numpy()), axis=1).reshape(-1, idx.dim()),
                                          self.device.index or 0)
            out.extend(positions[:, d] for d in range(idx.dim()))
        elif idx.device.type != "neuron" and idx.dim():
            out.append(_to_device(idx, self.device))   # a 0-d CPU index is a runtime scalar already
        else:
            out.append(idx)
    return out


def _check_mask_shape(self, mask, dim):
    """ATen's check (expandTensors): a mask's sizes are those of the dimensions it indexes."""
    for j, n in enumerate(mask.shape):
        if dim + j < self.dim() and n != self.shape[dim + j]:
            raise IndexError(f"The shape of the mask {list(mask.shape)} at index {j} does not match the "
                             f"shape of the indexed tensor {list(self.shape)} at index {dim + j}")


def _needs_host_work(indices) -> bool:
    """Masks (data-dependent shapes) or index tensors that are not on the device."""
    return any(i is not None and (i.dtype in (torch.bool, torch.uint8) or i.device.type != "neuron")
               for i in indices)


def make_index(kernel):
    unsafe = getattr(kernel, "name", "").startswith("aten::_unsafe_index")

    def index(self, indices):
        if unsafe and any(i is not None and i.dtype == torch.bool for i in indices):
            raise RuntimeError("_unsafe_index found unexpected index type Bool")   # ATen's check
        if _needs_host_work(indices):
            indices = _device_indices(self, indices)
        return kernel(self, indices)
    return index


def make_index_put(kernel, masked_fill_kernel):
    def index_put(self, indices, values, accumulate=False, *rest):
        if values.device != self.device and values.dim() == 0:
            # As ATen's index_put_: a 0-d value may live anywhere.
            values = _to_device(values, self.device)
        if _needs_host_work(indices):
            masks = [i for i in indices if i is not None]
            # x[mask] = scalar-like: a select, no host round trip.
            if (len(masks) == 1 and indices[0] is not None and not accumulate and values.numel() == 1
                    and masks[0].dtype == torch.bool and masks[0].dim() <= self.dim()):
                _check_mask_shape(self, masks[0], 0)
                mask = _to_device(masks[0], self.device)
                mask = mask.reshape(tuple(mask.shape) + (1,) * (self.dim() - mask.dim()))
                return masked_fill_kernel(self, mask, values.reshape(()))
            indices = _device_indices(self, indices)
        return kernel(self, indices, values, accumulate, *rest)
    return index_put


def masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype != torch.bool:   # ATen's check (indexing would take a uint8 mask, with a warning)
        raise RuntimeError("masked_select: expected BoolTensor for mask")
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    return self.expand(shape)[mask.expand(shape)]


def fused_sdp_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False):
    # The math path is built from ops that all have lowerings.
    return _SDP_MATH


def repeat_interleave_tensor(repeats: torch.Tensor, *, output_size=None) -> torch.Tensor:
    # CPU's checks and messages: the counts come to the host anyway (they size the result).
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if repeats.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("repeats has to be Long or Int tensor")
    host = transfers.to_host(repeats).astype(np.int64)
    if (host < 0).any():
        raise RuntimeError("repeats can not be negative")
    return _upload_int64(np.repeat(np.arange(host.shape[0]), host), repeats.device.index or 0)


# The linalg ``*_ex`` ops with ``check_errors=True`` raise ATen's LinAlgError for a failed
# factorisation: ATen's kernels read ``info`` back after the factorisation (a synchronisation, as
# on CUDA). The lowerings return ``info``; this does the read and the check, with ATen's own texts
# (``api``, the name in the message, and ``info_index``, per op in ops/oprecord.py's EAGER).
def make_check_errors(kernel, api: str, info_index: int):
    def checked(A, *args, **kwargs):
        result = kernel(A, *args, **kwargs)
        if kwargs.get("check_errors", False):
            torch.ops.aten._linalg_check_errors(result[info_index], api, is_matrix=A.dim() == 2)
        return result
    return checked
