"""The additive attention masks (paper 3.2.3): 0 where a query may look, NEG_INF where not.

Added to the scores before the softmax; exp(NEG_INF - max) is exactly 0, so a masked key
gets exactly zero weight (docs/derivations/attention.md).
"""
import numpy as np

NEG_INF = -1e9  # additive mask value; exp(NEG_INF - max) underflows to exactly 0
NEG_INF_HALF = -3e4  # float16 cannot hold -1e9; exp(-3e4) is still exactly 0 in float32


def _neg_inf(dtype):
    return NEG_INF_HALF if np.dtype(dtype) == np.float16 else NEG_INF


def padding_bias(ids, pad_id, dtype):
    """ids [B, L] -> [B, 1, 1, L] additive bias: NEG_INF on pad keys, 0 elsewhere."""
    return ((ids == pad_id).astype(dtype) * _neg_inf(dtype))[:, None, None, :]


def causal_bias(length, xp, dtype):
    """[L, L] additive bias: NEG_INF above the diagonal (position i sees only j <= i)."""
    return xp.triu(xp.full((length, length), _neg_inf(dtype), dtype=dtype), k=1)
