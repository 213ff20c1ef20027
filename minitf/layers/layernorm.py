"""LayerNorm over d_model (Ba et al. 2016), used after every residual sum (paper 3.1)."""
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

    def backward(self, dy):
        cache, self.cache = self.cache, None
        return F.layernorm_backward(dy, cache, self.params["weight"], self.grads["weight"], self.grads["bias"])

    def apply(self, x):
        """Inference: the forward without keeping a cache (decode.py)."""
        return F.layernorm_forward(x, self.params["weight"], self.params["bias"], self.eps)[0]
