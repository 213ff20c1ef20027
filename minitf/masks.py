"""The additive attention masks (paper 3.2.3): 0 where a query may look, NEG_INF where not.

Added to the scores before the softmax; exp(NEG_INF - max) is exactly 0, so a masked key
gets exactly zero weight (docs/derivations/attention.md).
"""
import numpy as np

from .backend import to_device

NEG_INF = -1e9  # additive mask value; exp(NEG_INF - max) underflows to exactly 0
NEG_INF_HALF = -3e4  # float16 cannot hold -1e9; exp(-3e4) is still exactly 0 in float32 (bfloat16 holds -1e9)


def _neg_inf(dtype):
    return NEG_INF_HALF if np.dtype(dtype) == np.float16 else NEG_INF


def padding_bias(ids, pad_id, dtype, xp=None):
    """ids [B, L] -> [B, 1, 1, L] additive bias: NEG_INF on pad keys, 0 elsewhere. With host ids
    and a device's `xp`: made on the host and moved in one copy (no kernel launches)."""
    if xp is not None and isinstance(ids, np.ndarray):
        return to_device(padding_bias(ids, pad_id, dtype), xp)
    bias = (ids == pad_id).astype(dtype)
    bias *= _neg_inf(dtype)   # in place, in the dtype asked for (CuPy: bfloat16 times a Python float is float32
    #                           with ml_dtypes before 0.7)
    return bias[:, None, None, :]


_CAUSAL = {}   # (array module, length, dtype name) -> the [T, T] bias, made once (it never changes)


def causal_bias(length, xp, dtype):
    """[T, T] additive bias: NEG_INF above the diagonal (position i sees only j <= i). Read only:
    kept per (array module, length, dtype) for the next batch of that length. Made on the host and
    moved in one copy: no kernel launches, and the dtype asked for (CuPy 14's triu turns bfloat16 into
    float32: its `where` has no bfloat16 loop)."""
    key = (id(xp), int(length), np.dtype(dtype).name)
    if key not in _CAUSAL:
        if len(_CAUSAL) > 512:   # lengths come and go with the batches: bound the cache
            _CAUSAL.clear()
        made = to_device(np.triu(np.full((length, length), _neg_inf(dtype), dtype=dtype), k=1), xp)
        if isinstance(made, np.ndarray):
            made.flags.writeable = False   # shared by every model of the process: a write would unmask the future
        _CAUSAL[key] = (xp, made)
    return _CAUSAL[key][1]
