"""Dropout (paper 5.4): on every sublayer output and on the embedding + positional sums.

One instance per call site, so each keeps its own mask. The random generator is passed in
by the model for each forward pass (so a run can be resumed exactly); `mask=` fixes the mask
(gradient checks).
"""
from .. import functional as F
from .base import Layer


class Dropout(Layer):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x, rng=None, mask=None):
        """x * mask (a fresh mask from `rng` unless `mask` is given); identity in eval mode."""
        if mask is None:
            if not self.training or self.p == 0.0 or rng is None:
                self.cache = None
                return x
            mask = F.dropout_mask(rng, x.shape, self.p, x.dtype)
        self.cache = mask
        return F.dropout_forward(x, mask)

    def forward_add(self, y, x, rng=None):
        """x + Dropout(y), written into y (a sublayer output nothing else holds)."""
        if not self.training or self.p == 0.0 or rng is None:
            self.cache = None
            y += x
            return y
        out, self.cache = F.dropout_add_forward(rng, y, x, self.p)
        return out

    def backward(self, dy):
        mask, self.cache = self.cache, None
        if mask is None:
            return dy
        return F.dropout_backward(dy, mask)
