"""LSTM (Hochreiter & Schmidhuber 1997, with the forget gate of Gers et al. 2000), the
recurrent layer the Transformer replaced (paper section 1: "h_t as a function of the
previous hidden state h_{t-1} and the input for position t ... precludes parallelization").

One step, gates fused into one [rows, 4R] pre-activation (i, f, g, o blocks of R columns; R = rnn_hidden, a
decoder LSTM's width; each direction of the encoder's BiLSTM is the same layer with R' for R, as
docs/derivations/lstm.md writes it):

    a   = x_t @ w_x + b + h_{t-1} @ w_h        [rows, 4R]
    i, f, o = sigmoid(a_i), sigmoid(a_f), sigmoid(a_o);  g = tanh(a_g)
    c_t = f * c_{t-1} + i * g                  [rows, R]
    h_t = o * tanh(c_t)

The input part x_t @ w_x + b of every step is one matmul before the loop; only h @ w_h is
sequential (the O(n) sequential operations of the paper's Table 1). Padding: where
mask[:, t] is False, the state is carried unchanged (h_t = h_{t-1}, c_t = c_{t-1}), so a
right-padded sentence ends with the state of its last token, and the reverse direction
starts from the zero state at its last token. Backprop through time is the same loop in
reverse; the parameter gradients are again one matmul each, after it.
Derivation and a runnable check: docs/derivations/lstm.md.
"""
from typing import NamedTuple

import numpy as np

from ..backend import xp_of
from .base import Layer


def sigmoid(x):
    xp = xp_of(x)
    return 1.0 / (1.0 + xp.exp(-x))


class CellCache(NamedTuple):
    """One step's values for cell_backward: gates (i, f, g, o after their nonlinearities)
    [rows, 4R], c_prev [rows, R], tanh(c_t) [rows, R], keep [rows, 1] (1 real token, 0 padding) or None."""
    gates: object
    c_prev: object
    tanh_c: object
    keep: object


def cell_forward(a, h_prev, c_prev, keep=None):
    """a [rows, 4R] (the whole pre-activation) -> (h_t, c_t, cache). keep [rows, 1]: 0 carries the state."""
    hd = h_prev.shape[-1]
    gates = sigmoid(a)
    gates[:, 2 * hd: 3 * hd] = xp_of(a).tanh(a[:, 2 * hd: 3 * hd])
    i, f, g, o = (gates[:, j * hd: (j + 1) * hd] for j in range(4))
    c = f * c_prev + i * g
    tanh_c = xp_of(a).tanh(c)
    h = o * tanh_c
    if keep is not None:   # padding: carry the state
        h = keep * h + (1 - keep) * h_prev
        c = keep * c + (1 - keep) * c_prev
    return h, c, CellCache(gates, c_prev, tanh_c, keep)


def cell_backward(dh, dc, cache):
    """dh, dc [rows, R] (gradients of h_t and c_t) -> (da [rows, 4R], dh_prev part, dc_prev).

    dh_prev here is only the carried part (padding); the caller adds da @ w_h^T."""
    gates, c_prev, tanh_c, keep = cache
    hd = dh.shape[-1]
    i, f, g, o = (gates[:, j * hd: (j + 1) * hd] for j in range(4))
    dh_carry = dc_carry = 0.0
    if keep is not None:
        # h = keep * h_new + (1 - keep) * h_prev   (likewise c)
        dh_carry, dc_carry = (1 - keep) * dh, (1 - keep) * dc
        dh, dc = keep * dh, keep * dc
    # h = o * tanh(c)
    dc = dc + dh * o * (1 - tanh_c * tanh_c)
    do = dh * tanh_c
    # c = f * c_prev + i * g
    di, df, dg = dc * g, dc * c_prev, dc * i
    da = xp_of(dh).empty_like(gates)
    # i, f, o = sigmoid(a_.), g = tanh(a_g): sigmoid' = s (1 - s), tanh' = 1 - t^2
    da[:, :hd] = di * i * (1 - i)
    da[:, hd: 2 * hd] = df * f * (1 - f)
    da[:, 2 * hd: 3 * hd] = dg * (1 - g * g)
    da[:, 3 * hd:] = do * o * (1 - o)
    return da, dh_carry, dc * f + dc_carry


class LSTM(Layer):
    """One LSTM layer over a whole sequence: x [B, L, I] -> h [B, L, R] (`reverse`: right to left)."""

    def __init__(self, d_in, d_hidden, rng, reverse=False):
        super().__init__()
        self.d_hidden, self.reverse = d_hidden, reverse
        limit = 1.0 / np.sqrt(d_hidden)   # uniform(-1/sqrt(d_hidden), 1/sqrt(d_hidden)), as torch.nn.LSTM
        self.params["w_x"] = rng.uniform(-limit, limit, size=(d_in, 4 * d_hidden))
        self.params["w_h"] = rng.uniform(-limit, limit, size=(d_hidden, 4 * d_hidden))
        b = np.zeros(4 * d_hidden)
        b[d_hidden: 2 * d_hidden] = 1.0   # forget gate open at first (Jozefowicz et al. 2015)
        self.params["b"] = b

    def step(self, x_t, h, c):
        """Inference, one position: x_t [rows, I], state (h, c) [rows, R] -> new (h, c). No cache."""
        a = x_t @ self.params["w_x"] + self.params["b"] + h @ self.params["w_h"]
        h, c, _ = cell_forward(a, h, c)
        return h, c

    def forward(self, x, mask=None, h0=None, c0=None):
        """x [B, L, I], mask [B, L] bool (False: padding) -> (h [B, L, R], (h_last, c_last) [B, R]).
        `reverse` runs the same loop over the flipped sequence and flips the output back."""
        xp = xp_of(x)
        if self.reverse:
            x, mask = x[:, ::-1], None if mask is None else mask[:, ::-1]
        b, length, _ = x.shape
        xw = x.reshape(b * length, -1) @ self.params["w_x"] + self.params["b"]
        xw = xp.ascontiguousarray(xw.reshape(b, length, -1).transpose(1, 0, 2))   # [L, B, 4R] time-major
        hs = xp.empty((length + 1, b, self.d_hidden), dtype=x.dtype)               # hs[t + 1] = h_t, hs[0] = h0
        hs[0] = 0.0 if h0 is None else h0
        c = xp.zeros((b, self.d_hidden), dtype=x.dtype) if c0 is None else c0
        keep = None if mask is None else mask.T[:, :, None].astype(x.dtype)         # [L, B, 1]
        caches = [None] * length
        for t in range(length):
            hs[t + 1], c, caches[t] = cell_forward(xw[t] + hs[t] @ self.params["w_h"], hs[t], c,
                                                   None if keep is None else keep[t])
        self.cache = (x, hs, caches)
        out = hs[1:].transpose(1, 0, 2)
        return xp.ascontiguousarray(out[:, ::-1] if self.reverse else out), (hs[-1], c)

    def backward(self, dout, dh_last=None, dc_last=None):
        """dout [B, L, R] (and the last state's gradients) -> (dx [B, L, I], dh0, dc0)."""
        x, hs, caches = self.take_cache()
        xp = xp_of(dout)
        b, length, _ = x.shape
        dout_t = (dout[:, ::-1] if self.reverse else dout).transpose(1, 0, 2)
        dh = xp.zeros((b, self.d_hidden), dtype=dout.dtype) if dh_last is None else dh_last
        dc = xp.zeros_like(dh) if dc_last is None else dc_last
        da = xp.empty((length, b, 4 * self.d_hidden), dtype=dout.dtype)
        w_h = self.params["w_h"]
        for t in range(length - 1, -1, -1):
            da[t], dh_carry, dc = cell_backward(dh + dout_t[t], dc, caches[t])
            # a = xw[t] + hs[t] @ w_h
            dh = da[t] @ w_h.T + dh_carry
        da2 = da.reshape(length * b, -1)
        x2 = x.transpose(1, 0, 2).reshape(length * b, -1)                           # time-major, as da
        self.accumulate_grads(x2, hs[:-1].reshape(length * b, -1), da2)
        dx = (da2 @ self.params["w_x"].T).reshape(length, b, -1).transpose(1, 0, 2)
        return xp.ascontiguousarray(dx[:, ::-1] if self.reverse else dx), dh, dc

    def accumulate_grads(self, x2, h_prev2, da2):
        """The parameter gradients of all steps at once, rows = (step, sentence): x2 [rows, I] the
        inputs, h_prev2 [rows, R] the previous states, da2 [rows, 4R] the pre-activation gradients."""
        # a = x @ w_x + b + h_prev @ w_h, summed over the steps
        self.grads["w_x"] += x2.T @ da2
        self.grads["w_h"] += h_prev2.T @ da2
        self.grads["b"] += da2.sum(axis=0)


class BiLSTM(Layer):
    """Bidirectional layer (Bahdanau et al. 2015, 3.2): [forward h_t ; backward h_t], so the
    annotation of position t summarises the words before AND after it. x [B, L, I] -> [B, L, 2 d_hidden]
    (the recurrent baseline's encoder: d_hidden = R', so [B, L, 2R'] = [B, L, R])."""

    def __init__(self, d_in, d_hidden, rng):
        super().__init__()
        self.fwd = self.add("fwd", LSTM(d_in, d_hidden, rng))
        self.bwd = self.add("bwd", LSTM(d_in, d_hidden, rng, reverse=True))

    def forward(self, x, mask=None):
        hf, _ = self.fwd.forward(x, mask)
        hb, _ = self.bwd.forward(x, mask)
        return xp_of(x).concatenate([hf, hb], axis=-1)

    def backward(self, dout):
        hd = self.fwd.d_hidden
        dx, _, _ = self.fwd.backward(dout[..., :hd])
        dxb, _, _ = self.bwd.backward(dout[..., hd:])
        dx += dxb
        return dx
