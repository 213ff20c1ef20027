"""Positional encodings (paper 3.5): fixed sinusoids, or learned (Table 3 row E).

PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)), pos from 0.
"""
import numpy as np

from ..backend import xp_of
from ..errors import ConfigError
from .base import Layer


def sinusoid_table(max_len, d_model):
    """[max_len, D] float64 table of the paper's sinusoids."""
    pos = np.arange(max_len)[:, None]
    i2 = np.arange(0, d_model, 2)[None, :]
    angle = pos / np.power(10000.0, i2 / d_model)
    pe = np.zeros((max_len, d_model))
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe


class SinusoidalPositional(Layer):
    """x + PE[:L]; no parameters, the gradient passes through unchanged."""

    def __init__(self, max_len, d_model):
        super().__init__()
        self.table = sinusoid_table(max_len, d_model)
        self._device_table = None

    def _table(self, x, length):
        """The table on x's device and dtype, with at least `length` rows: the sinusoids are
        defined for any position, so a longer input extends the table (doubling) instead of
        being cut."""
        if length > self.table.shape[0]:
            self.table = sinusoid_table(max(length, 2 * self.table.shape[0]), self.table.shape[1])
            self._device_table = None
        xp = xp_of(x)
        t = self._device_table
        if t is None or xp_of(t) is not xp or t.dtype != x.dtype:
            t = self._device_table = xp.asarray(self.table, dtype=x.dtype)
        return t

    def table_like(self, x, length):
        """PE[:length] on x's device, in x's dtype (for a kernel that adds it itself)."""
        return self._table(x, length)[:length]

    def forward(self, x, offset=0):
        """x [B, L, D] -> x + PE[offset:offset+L]; decoding one position per row (L = 1), offset
        may be a host int array [B]: row b gets PE[offset[b]]."""
        if np.ndim(offset):
            return x + self._table(x, int(offset.max()) + 1)[xp_of(x).asarray(offset)][:, None]
        return x + self._table(x, offset + x.shape[1])[offset: offset + x.shape[1]]

    def backward(self, dy, offset=0):
        # y = x + PE
        return dy


class LearnedPositional(Layer):
    """x + weight[:L], weight [max_len, D] learned (Table 3 row E); one table for both stacks."""

    def __init__(self, max_len, d_model, rng):
        super().__init__()
        self.params["weight"] = rng.normal(0.0, d_model ** -0.5, size=(max_len, d_model))

    def forward(self, x, offset=0):
        """x [B, L, D] -> x + weight[offset:offset+L]; nothing is cached: backward needs only dy and the
        offset. Decoding one
        position per row (L = 1), offset may be a host int array [B]: row b gets weight[offset[b]]."""
        needed = int(offset.max()) + 1 if np.ndim(offset) else offset + x.shape[1]
        if needed > self.params["weight"].shape[0]:
            raise ConfigError(f"learned positions cover {self.params['weight'].shape[0]} positions (max_len), "
                              f"this input needs {needed}: shorten it, or train with sinusoidal "
                              f"positions, which have no limit")
        if np.ndim(offset):
            return x + self.params["weight"][xp_of(x).asarray(offset)][:, None]
        return x + self.params["weight"][offset: offset + x.shape[1]]

    def backward(self, dy, offset=0):
        # y = x + weight[offset:offset+L]
        self.grads["weight"][offset: offset + dy.shape[1]] += dy.sum(axis=0)
        return dy
