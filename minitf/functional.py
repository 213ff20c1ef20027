"""Pure forward/backward pairs. No state; arrays are made with `xp` taken from the inputs (NumPy
or CuPy), `np` only names dtypes and builds the CPU dropout masks.

Each `*_backward` takes the upstream gradient first, then what the forward cached, and
ACCUMULATES parameter gradients into the buffers it is given (`dw += ...`), returning the
input gradient(s). The comment above each backward line quotes the forward line it
differentiates. Derivations: docs/derivations/.

On a GPU, softmax, LayerNorm, dropout + residual (and the loss, loss.py) run as fused CUDA
kernels (kernels.py) computing the same formulas in one pass; the code here is the
reference they are tested against.
"""
from typing import NamedTuple

import numpy as np

from . import kernels
from .backend import xp_of


def as_float32_if_half(x):
    """Mixed precision: reductions (softmax, LayerNorm, the loss) run in float32 when the
    activations are float16; a no-op for float32/float64."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


# ----------------------------------------------------------------------------- linear
def linear_forward(x, w, b):
    """y = x @ w + b.  x [..., I], w [I, O], b [O] -> y [..., O]."""
    y = x.reshape(-1, x.shape[-1]) @ w
    y += b
    return y.reshape(*x.shape[:-1], w.shape[1])


def linear_backward(dy, x, w, dw, db):
    """Accumulates dw [I, O], db [O]; returns dx [..., I]."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    # y = x @ w + b
    dw += x2.T @ dy2
    db += dy2.sum(axis=0)
    return (dy2 @ w.T).reshape(x.shape)


# ----------------------------------------------------------------------------- relu
def relu_forward(x):
    """y = max(x, 0); backward needs only y (y > 0 exactly where x > 0)."""
    xp = xp_of(x)
    return xp.maximum(x, 0)


def relu_backward(dy, y):
    # y = max(x, 0)
    return dy * (y > 0)


# ----------------------------------------------------------------------------- softmax
def softmax_forward(x):
    """Softmax over the last axis, max-subtracted for stability; returns p (same shape)."""
    xp = xp_of(x)
    x32 = as_float32_if_half(x)
    p = x32 - x32.max(axis=-1, keepdims=True)
    xp.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)
    return p.astype(x.dtype, copy=False)


def softmax_backward(dp, p):
    """dx = p * (dp - sum(dp * p)) over the last axis."""
    # p = exp(x - max) / sum(exp(x - max))
    p32 = as_float32_if_half(p)
    dx = as_float32_if_half(dp) * p32
    s = dx.sum(axis=-1, keepdims=True)
    dx -= p32 * s
    return dx.astype(dp.dtype, copy=False)


# ----------------------------------------------------------------------------- layernorm
class LayerNormCache(NamedTuple):
    """What layernorm_backward needs: xhat [..., D] (the normalized input) and rstd [..., 1]."""
    xhat: object
    rstd: object


def layernorm_forward(x, g, b, eps):
    """y = (x - mean) / sqrt(var + eps) * g + b over the last axis (biased variance).

    Returns y and the LayerNormCache (xhat, rstd) backward needs.
    """
    if kernels.enabled(x):
        y, (xhat, rstd) = kernels.layernorm_forward(x, g, b, eps)
        return y, LayerNormCache(xhat, rstd)
    xp = xp_of(x)
    x32 = as_float32_if_half(x)
    mean = x32.mean(axis=-1, keepdims=True)
    xhat = x32 - mean
    var = (xhat * xhat).mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat *= rstd
    y = xhat * g
    y += b
    return y.astype(x.dtype, copy=False), LayerNormCache(xhat, rstd)


def layernorm_backward(dy, cache, g, dg, db):
    """Accumulates dg, db [D]; returns dx with the compact form
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))."""
    xhat, rstd = cache
    fused = kernels.layernorm_backward_input(dy, xhat, rstd, g) if kernels.enabled(dy) else None
    out_dtype, dy = dy.dtype, as_float32_if_half(dy)
    d = dy.shape[-1]
    dy2 = dy.reshape(-1, d)
    # y = xhat * g + b
    dg += (dy2 * xhat.reshape(-1, d)).sum(axis=0)
    db += dy2.sum(axis=0)
    if fused is not None:
        return fused
    dxhat = dy * g
    # xhat = (x - mean) * rstd, rstd = (var + eps)^-1/2
    dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
    dx -= xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd
    return dx.astype(out_dtype, copy=False)


# ----------------------------------------------------------------------------- dropout
def dropout_mask(rng, shape, p, dtype):
    """Inverted-dropout mask: 0 with probability p, else 1/(1-p) (so E[mask] = 1).

    NumPy: 16-bit uniform integers u, kept where u >= round(p * 65536) (p to 1/65536; 2-3x
    cheaper to draw than floats). CuPy (generic path): float uniforms, built in place:
    floor(u + 1 - p) is 1 exactly when u >= p.
    """
    if isinstance(rng, np.random.Generator):
        u = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        mask = np.empty(shape, dtype=dtype)
        np.greater_equal(u, round(p * (1 << 16)), out=mask, casting="unsafe")
        mask *= 1.0 / (1.0 - p)
        return mask
    u = rng.random(shape, dtype=np.float32 if dtype == np.float16 else dtype)
    u += 1.0 - p
    xp_of(u).floor(u, out=u)
    u *= 1.0 / (1.0 - p)
    return u.astype(dtype, copy=False)


def dropout_forward(x, mask, inplace=False):
    """y = x * mask; `inplace` overwrites x (when nothing else holds it)."""
    if inplace:
        x *= mask
        return x
    return x * mask


def dropout_add_forward(rng, y, x, p):
    """(out, mask): out = y * mask + x with a fresh inverted-dropout mask, written into y
    (a sublayer output nothing else holds): the residual sum x + Dropout(Sublayer(x))."""
    if kernels.enabled(y):
        return kernels.dropout_add(rng.random(y.shape, dtype=np.float32), y, x, p)
    mask = dropout_mask(rng, y.shape, p, y.dtype)
    out = dropout_forward(y, mask, inplace=True)
    out += x
    return out, mask


def dropout_backward(dy, mask):
    # y = x * mask
    return dy * mask


# ----------------------------------------------------------------------------- attention
def attention_forward(q, k, v, bias, scale):
    """Scaled dot-product attention (paper 3.2.1): softmax(q k^T * scale + bias) v.

    q [B, H, T, K], k and v [B, H, S, K], bias broadcastable to [B, H, T, S] (0 where
    attending is allowed, a large negative number where it is masked).
    Returns out [B, H, T, K] and p [B, H, T, S] (the softmax output, kept for backward).
    """
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if kernels.enabled(scores):
        p = kernels.masked_softmax(scores, bias, out=scores)   # one pass: + bias, softmax
    else:
        scores += bias
        p = softmax_forward(scores)
    return p @ v, p


def attention_backward(dout, q, k, v, p, scale):
    """Returns dq, dk, dv for attention_forward."""
    # out = p @ v
    dv = p.swapaxes(-1, -2) @ dout
    dp = dout @ v.swapaxes(-1, -2)
    # p = softmax(scores)
    ds = kernels.softmax_backward(dp, p, out=dp) if kernels.enabled(dp) else softmax_backward(dp, p)
    # scores = (q * scale) @ k^T + bias
    dq = (ds @ k) * scale
    dk = ds.swapaxes(-1, -2) @ (q * scale)
    return dq, dk, dv


def split_heads(x, n_heads):
    """[B, T, H*K] -> [B, H, T, K]."""
    b, t, hk = x.shape
    return x.reshape(b, t, n_heads, hk // n_heads).transpose(0, 2, 1, 3)


def split_last(x, n):
    """[..., n*M] -> n views [..., M] (e.g. q, k, v of one fused projection)."""
    m = x.shape[-1] // n
    return [x[..., i * m: (i + 1) * m] for i in range(n)]


def merge_heads(x):
    """[B, H, T, K] -> [B, T, H*K] (contiguous)."""
    b, h, t, k = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * k)
