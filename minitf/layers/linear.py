"""Linear: y = x @ weight + bias, weight [I, O] (so head i of a projection is a column block)."""
import numpy as np

from .. import functional as F
from .. import gemm
from .base import Layer


class Linear(Layer):
    def __init__(self, d_in, d_out, rng):
        super().__init__()
        limit = np.sqrt(6.0 / (d_in + d_out))  # Xavier/Glorot uniform (the paper does not say)
        self.params["weight"] = rng.uniform(-limit, limit, size=(d_in, d_out))
        self.params["bias"] = np.zeros(d_out)

    def forward(self, x, bias=True):
        """x [..., I] -> [..., O]; bias=False: without the bias add, left to the caller's next pass
        over the rows (backward is the same: db is the sum of dy either way)."""
        self.cache = x
        return F.linear_forward(x, self.params["weight"], self.params["bias"] if bias else None)

    def project(self, x):
        """The forward without the bias add, x [..., I] -> x @ weight as rows [rows, O] (the
        leading axes flattened; the caller reshapes), for a caller that adds the bias in its next
        pass over the rows (the feed-forward's kernels.bias_relu).
        Backward is `backward`, as for `forward` (db is the sum of dy either way)."""
        self.cache = x
        return gemm.product(x.reshape(-1, x.shape[-1]), self.params["weight"])

    def apply(self, x):
        """The forward without keeping a cache (decoding, and RNNSearch's forward, whose backward takes this
        layer's gradients itself)."""
        return F.linear_forward(x, self.params["weight"], self.params["bias"])

    def backward(self, dy, dx_into=None, bias=True):
        """dx; with `dx_into` (an array of x's shape the caller owns) dx is added into it instead.
        bias=False: the bias gradient (the column sums of dy) is the caller's to take (a post-norm
        block's LayerNorm takes it in its own launch: blocks, LayerNorm.backward)."""
        x = self.take_cache()
        return F.linear_backward(dy, x, self.params["weight"], self.grads["weight"],
                                 self.grads["bias"] if bias else None, dx_into)
