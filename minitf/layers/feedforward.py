"""Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2."""
from .. import functional as F
from .base import Layer
from .linear import Linear


class FeedForward(Layer):
    def __init__(self, d_model, d_ff, rng):
        super().__init__()
        self.fc1 = self.add("fc1", Linear(d_model, d_ff, rng))
        self.fc2 = self.add("fc2", Linear(d_ff, d_model, rng))

    def forward(self, x):
        """x [..., D] -> [..., D], hidden [..., F]: [B, L, D] padded, [N, D] packed (training's
        kept positions, packing.Rows); position-wise, so the leading axes do not matter."""
        h = F.relu_forward(self.fc1.forward(x))
        self.cache = h
        return self.fc2.forward(h)

    def backward(self, dy):
        h, self.cache = self.cache, None
        # y = fc2(h)
        dh = self.fc2.backward(dy)
        # h = relu(fc1(x))
        return self.fc1.backward(F.relu_backward(dh, h))

    def apply(self, x):
        """Inference: the forward without keeping caches (decode.py)."""
        return self.fc2.apply(F.relu_forward(self.fc1.apply(x)))
