"""Eager kernels for ops whose output *shape* depends on tensor values (``unique`` and friends).

These are not lowerings (a compiled executable needs static shapes): each is a short composition
of lowered ops that runs on neuron, with exactly one host read -- the positions where a new value
starts (``nonzero``, counted as a device->host copy like every host read). ``ops/oprecord.py``'s
``EAGER`` names them (``"data_dependent.unique2"``), as it names ``host_ops``' kernels; under
torch.compile these ops are graph breaks, as on CUDA.
"""

from __future__ import annotations

import torch

_LONG = torch.int64


def _empty_long(device):
    return torch.empty(0, dtype=_LONG, device=device)


def _runs(keys_equal_prev, n, device):
    """Start flags of runs, given ``keys_equal_prev[i] = key[i+1] == key[i]`` (length n-1)."""
    new = torch.ones(n, dtype=torch.bool, device=device)
    if n > 1:
        new[1:] = ~keys_equal_prev
    return new


def _groups(new, n):
    """(first position of each run, run id of every element, run lengths) -- one host read."""
    first = new.nonzero().squeeze(1)
    group = torch.cumsum(new, 0) - 1
    ends = torch.cat([first[1:], torch.full((1,), n, dtype=_LONG, device=new.device)])
    return first, group, ends - first


def _unique_flat(flat, sort, return_inverse, return_counts):
    device, n = flat.device, flat.numel()
    if n == 0:
        return flat.clone(), _empty_long(device), _empty_long(device)
    if sort:
        vals, perm = torch.sort(flat, stable=True)
    else:
        vals, perm = flat, None
    new = _runs(vals[1:] == vals[:-1], n, device)
    first, group, counts = _groups(new, n)
    uniq = vals[first]
    inverse = _empty_long(device)
    if return_inverse:
        inverse = group if perm is None else torch.empty_like(group).scatter_(0, perm, group)
    return uniq, inverse, counts if return_counts else _empty_long(device)


def unique2(self, sorted=True, return_inverse=False, return_counts=False):
    # Values come back sorted whatever ``sorted`` says -- what CPU returns too.
    uniq, inverse, counts = _unique_flat(self.reshape(-1), True, return_inverse, return_counts)
    return uniq, inverse.reshape(self.shape) if return_inverse else inverse, counts


def unique(self, sorted=True, return_inverse=False):
    uniq, inverse, _ = unique2(self, sorted, return_inverse, False)
    return uniq, inverse


def _unique_rows(self, dim, sort, return_inverse, return_counts):
    device = self.device
    moved = self.movedim(dim, 0)
    n = moved.shape[0]
    if n == 0:
        return self.clone(), _empty_long(device), _empty_long(device)
    if self.numel() == 0:
        raise RuntimeError("There are 0 sized dimensions, and they aren't selected, so unique cannot be applied")
    rows = moved.reshape(n, -1)
    perm = None
    if sort:
        # Lexicographic order: stable sorts from the last column to the first.
        perm = torch.arange(n, device=device)
        for col in reversed(range(rows.shape[1])):
            perm = perm[torch.sort(rows[perm, col], stable=True)[1]]
        rows = rows[perm]
    same = (rows[1:] == rows[:-1]).all(1)
    new = _runs(same, n, device)
    first, group, counts = _groups(new, n)
    uniq = rows[first].reshape((first.shape[0],) + tuple(moved.shape[1:])).movedim(0, dim)
    inverse = _empty_long(device)
    if return_inverse:
        inverse = group if perm is None else torch.empty_like(group).scatter_(0, perm, group)
    return uniq, inverse, counts if return_counts else _empty_long(device)


def unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique_rows(self, dim, True, return_inverse, return_counts)


def unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    if dim is None:
        uniq, inverse, counts = _unique_flat(self.reshape(-1), False, return_inverse, return_counts)
        return uniq, inverse.reshape(self.shape) if return_inverse else inverse, counts
    return _unique_rows(self, dim, False, return_inverse, return_counts)


def unique_dim_consecutive(self, dim, return_inverse=False, return_counts=False):
    return _unique_rows(self, dim, False, return_inverse, return_counts)


def equal(self, other):
    """``torch.equal``: a Python bool, so one host read of the comparison."""
    if self.shape != other.shape:
        return False
    if self.numel() == 0:
        return True
    if self.dtype != other.dtype:
        other = other.to(self.dtype)
    return bool(torch.eq(self, other).all())


def bincount(self, weights=None, minlength=0):
    """``torch.bincount``: its length is max(input) + 1, so one host read (of the min and max)."""
    if self.dim() != 1 or self.is_floating_point() or self.is_complex() or self.dtype == torch.bool:
        raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs; got a {self.dim()}-d "
                           f"{self.dtype} tensor of shape {tuple(self.shape)}")
    if minlength < 0:
        raise RuntimeError(f"bincount: minlength should be >= 0, got {minlength}")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError(f"bincount: weights should be 1-d and have the same length as input; got "
                           f"{tuple(weights.shape)} for input {tuple(self.shape)}")
    size = minlength
    if self.numel():
        low, high = torch.stack([self.min(), self.max()]).tolist()
        if low < 0:
            raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs; input holds {low}")
        size = max(high + 1, minlength)
    # As CPU: counts are int64, float32 weights sum in float32, other weights in float64.
    if weights is None:
        values = torch.ones_like(self, dtype=_LONG)
    else:
        values = weights.to(torch.float32 if weights.dtype == torch.float32 else torch.float64)
    return torch.zeros(size, dtype=values.dtype, device=self.device).index_add_(0, self.to(_LONG), values)

