"""Conv1d: the convolutional layer of the paper's Table 1 (kernel width k, as in ByteNet and
ConvS2S, paper section 2), written as im2col + one matmul.

    cols[b, t] = [x_pad[b, t] ; x_pad[b, t + 1] ; ... ; x_pad[b, t + k - 1]]   [B, L, k*I]
    y = cols @ weight + bias                                                  [B, L, O]

with x_pad = x with (k - 1) // 2 zero rows before and k - 1 - (k - 1) // 2 after ("same"
padding: position t sees t - (k-1)//2 ... t + k//2). One layer reaches (k - 1) / 2
positions to each side: a path of length n needs about 2 n / (k - 1) stacked layers (the paper's section 4: O(n / k)
for contiguous kernels; its Table 1 lists O(log_k n), with dilations). Padding tokens of a batch are not masked: the layer is for the
Table 1 measurements (bench/table1.py), not part of a model. Derivation: docs/derivations/conv.md.
"""
import numpy as np

from ..backend import xp_of
from .base import Layer


class Conv1d(Layer):
    def __init__(self, d_in, d_out, k, rng):
        super().__init__()
        self.k = k
        limit = np.sqrt(6.0 / (k * d_in + d_out))
        self.params["weight"] = rng.uniform(-limit, limit, size=(k * d_in, d_out))   # window j: rows j*I..(j+1)*I
        self.params["bias"] = np.zeros(d_out)

    def _pad(self, length):
        before = (self.k - 1) // 2
        return before, self.k - 1 - before

    def forward(self, x):
        """x [B, L, I] -> y [B, L, O]."""
        xp = xp_of(x)
        b, length, d = x.shape
        before, after = self._pad(length)
        x_pad = xp.concatenate([xp.zeros((b, before, d), x.dtype), x, xp.zeros((b, after, d), x.dtype)], axis=1)
        cols = xp.concatenate([x_pad[:, j: j + length] for j in range(self.k)], axis=2)   # [B, L, k*I]
        self.cache = cols
        return cols @ self.params["weight"] + self.params["bias"]

    def backward(self, dy):
        cols = self.take_cache()
        xp = xp_of(dy)
        b, length, _ = dy.shape
        d = cols.shape[-1] // self.k
        # y = cols @ weight + bias
        self.grads["weight"] += cols.reshape(b * length, -1).T @ dy.reshape(b * length, -1)
        self.grads["bias"] += dy.reshape(b * length, -1).sum(axis=0)
        dcols = dy @ self.params["weight"].T
        # cols[:, t, j*I:(j+1)*I] = x_pad[:, t + j]: each window scatters back to its shifted rows
        before, after = self._pad(length)
        dx_pad = xp.zeros((b, length + before + after, d), dtype=dy.dtype)
        for j in range(self.k):
            dx_pad[:, j: j + length] += dcols[:, :, j * d: (j + 1) * d]
        return dx_pad[:, before: before + length]
