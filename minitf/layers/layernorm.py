"""LayerNorm over d_model (Ba et al. 2016), used after every residual sum (paper 3.1, the default post-norm
blocks); with norm_position "pre" (--norm pre), before each sublayer and after each stack instead."""
import numpy as np

from .. import functional as F
from .base import Layer


class LayerNorm(Layer):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.params["weight"] = np.ones(d)
        self.params["bias"] = np.zeros(d)

    def forward(self, x):
        """x [..., D] -> [..., D]."""
        y, self.cache = F.layernorm_forward(x, self.params["weight"], self.params["bias"], self.eps)
        return y

    def forward_residual(self, x, sublayer_out, dropout, sites=None, rows=None, sublayer_bias=None):
        """LayerNorm(x + dropout(sublayer_out + sublayer_bias)): a post-norm block's output (3.1), in
        one kernel (functional.residual_layernorm_forward), which hands `dropout` its mask for
        backward (a kernels.KeyedMask: the backward kernel draws it again). sublayer_bias: the bias the sublayer's last Linear left out (None: none)."""
        out, mask, self.cache = F.residual_layernorm_forward(sites if dropout.active(sites) else None, x,
                                                             sublayer_out, dropout.p, self.params["weight"],
                                                             self.params["bias"], self.eps, rows, sublayer_bias)
        dropout.hold(mask)
        return out

    def backward(self, dy, dy_residual=None, dropout=None, sublayer=None):
        """dx, also with `dy_residual` alone (another gradient of this output, added to dy: dy must be
        the caller's own, it may be overwritten with the sum); with `dropout` (the Dropout layer
        inside this LayerNorm's input x + dropout(sublayer)): (dx, its dropout's backward of dx),
        in one pass on a GPU (functional.layernorm_backward). `sublayer`: the sublayer's last
        Linear, whose bias gradient this backward takes (on a GPU in its column-sum launch, beside dg and db)."""
        cache = self.take_cache()
        mask = None if dropout is None else dropout.take_mask()
        out = F.layernorm_backward(dy, cache, self.params["weight"], self.grads["weight"], self.grads["bias"],
                                   dy_residual, mask, None if sublayer is None else sublayer.grads["bias"])
        if dropout is not None and mask is None:   # dropout off: the sublayer's gradient is dx itself
            return out, out
        return out

    def apply(self, x):
        """Inference: the forward without keeping a cache (incremental.py)."""
        return F.layernorm_forward(x, self.params["weight"], self.params["bias"], self.eps)[0]
