"""Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2.

`dropout` > 0: dropout on the hidden ReLU output while training ("ReLU dropout", not in the
paper; docs/deviations.md). activation "swish": x W1 + b1 goes through swish(a) = a * sigmoid(a)
instead of the ReLU (Marian's option, for imported models: docs/interop.md)."""
from .. import functional as F
from .. import kernels
from .base import Layer
from .dropout import Dropout
from .linear import Linear


class FeedForward(Layer):
    def __init__(self, d_model, d_ff, rng, dropout=0.0, activation="relu"):
        super().__init__()
        self.activation = activation
        self.fc1 = self.add("fc1", Linear(d_model, d_ff, rng))
        self.fc2 = self.add("fc2", Linear(d_ff, d_model, rng))
        self.drop = self.add("drop", Dropout(dropout))

    def forward(self, x, sites=None, rows=None, out_bias=True):
        """x [..., D] -> [..., D], hidden [..., F]: [B, L, D] padded, [N_t, D] or [N_s, D] packed (training's
        kept positions, packing.Rows); position-wise, so the leading axes do not matter.
        `sites`/`rows` (functional.DropoutSites, packing.Rows): the ReLU-dropout mask, when
        training with dropout > 0. out_bias=False: fc2's bias is left to the caller's next pass
        (blocks.add_norm)."""
        if self.activation == "swish":  # h = swish(a), a = x W1 + b1 (backward needs a)
            a = self.fc1.forward(x)
            h = F.swish_forward(a)
            self.cache = a
            return self.fc2.forward(self.drop.forward(h, sites, rows=rows), out_bias)
        if kernels.fused(x, "relu"):    # one pass: h = max(x W1 + b1, 0) in place
            h = kernels.bias_relu(self.fc1.project(x), self.fc1.params["bias"]).reshape(x.shape[:-1] + (-1,))
        else:
            h = F.relu_forward(self.fc1.forward(x))
        self.cache = h
        return self.fc2.forward(self.drop.forward(h, sites, rows=rows), out_bias)

    def backward(self, dy, out_bias=True):
        """dx; out_bias=False: fc2's bias gradient is the caller's (Linear.backward's bias)."""
        h = self.take_cache()
        # y = fc2(drop(h))
        dh = self.drop.backward(self.fc2.backward(dy, bias=out_bias))
        if self.activation == "swish":
            # h = swish(a), a = fc1(x); here h is a
            return self.fc1.backward(F.swish_backward(dh, h))
        # h = relu(fc1(x))
        if kernels.fused(dh, "relu") and dh.flags.c_contiguous:
            db = self.fc1.grads["bias"]
            if kernels.switched_on("MINITF_FUSED_RELUSUMS") and kernels.sums_into(dh, db):
                # dh = relu's backward in place and db1 += its column sums: one launch (MINITF_FUSED_RELUSUMS=1:
                # off by default: slower steps on an H200); fc1 leaves its bias alone
                return self.fc1.backward(kernels.relu_backward_sums(dh, h, db), bias=False)
            return self.fc1.backward(kernels.relu_backward(dh, h))      # in place: dh is this layer's own
        return self.fc1.backward(F.relu_backward(dh, h))

    def apply(self, x):
        """Inference: the forward without keeping caches (incremental.py)."""
        act = F.swish_forward if self.activation == "swish" else F.relu_forward
        return self.fc2.apply(act(self.fc1.apply(x)))
