"""Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2.

`dropout` > 0: dropout on the hidden ReLU output while training ("ReLU dropout", not in the
paper; docs/deviations.md)."""
from .. import functional as F
from .base import Layer
from .linear import Linear


class FeedForward(Layer):
    def __init__(self, d_model, d_ff, rng, dropout=0.0):
        super().__init__()
        self.dropout = dropout
        self.fc1 = self.add("fc1", Linear(d_model, d_ff, rng))
        self.fc2 = self.add("fc2", Linear(d_ff, d_model, rng))

    def forward(self, x, stream=None, rows=None):
        """x [..., D] -> [..., D], hidden [..., F]: [B, L, D] padded, [N, D] packed (training's
        kept positions, packing.Rows); position-wise, so the leading axes do not matter.
        `stream`/`rows` (functional.DropoutStream, packing.Rows): the ReLU-dropout mask, when
        training with dropout > 0."""
        h = F.relu_forward(self.fc1.forward(x))
        mask = None
        if self.training and self.dropout > 0.0 and stream is not None:
            mask = F.dropout_mask(stream, h.shape, self.dropout, h.dtype, F.xp_of(h), rows)
        self.cache = h, mask
        return self.fc2.forward(h if mask is None else F.dropout_forward(h, mask))

    def backward(self, dy):
        (h, mask), self.cache = self.cache, None
        # y = fc2(h), or fc2(h * mask)
        dh = self.fc2.backward(dy)
        if mask is not None:
            dh = F.dropout_backward(dh, mask)
        # h = relu(fc1(x))
        return self.fc1.backward(F.relu_backward(dh, h))

    def apply(self, x):
        """Inference: the forward without keeping caches (decode.py)."""
        return self.fc2.apply(F.relu_forward(self.fc1.apply(x)))
