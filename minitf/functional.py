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

from . import gemm, kernels
from .kernels import keep_threshold  # the dropout masks: kept where u >= this
from .backend import half_dtype, xp_of


def as_float32_if_half(x):
    """Mixed precision: reductions (softmax, LayerNorm, the loss) run in float32 when the
    activations are float16 or bfloat16; a no-op for float32/float64."""
    return x.astype(np.float32) if half_dtype(x.dtype) else x


def column_sum(x2, y2=None):
    """The sum over the rows of x2 [rows, d] (d: a Linear's output width, D, F or H*K, a LayerNorm's D, or V_o for the output bias;
    of x2 * y2 when given): a bias's or a LayerNorm
    parameter's gradient. On a GPU two deterministic launches (kernels.column_sums: slab partials,
    then the slabs added in order) in the accumulation dtype."""
    if kernels.enabled(x2):
        return kernels.column_sums(x2, y2)
    return (x2 if y2 is None else x2 * y2).sum(axis=0)


# ----------------------------------------------------------------------------- linear
def linear_forward(x, w, b):
    """y = x @ w + b.  x [..., I], w [I, O], b [O] (None: no bias) -> y [..., O]."""
    y = gemm.product(x.reshape(-1, x.shape[-1]), w)
    if b is not None:
        y += b
    return y.reshape(*x.shape[:-1], w.shape[1])


def linear_backward(dy, x, w, dw, db, dx_into=None):
    """Accumulates dw [I, O], db [O] (None: the caller takes the bias gradient); returns dx [..., I],
    or, with `dx_into` (x's shape, the caller's own), adds dx into it and returns it (on a GPU the
    product's beta = 1: no add)."""
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    # y = x @ w + b
    gemm.accumulate_xt_dy(dw, x2, dy2)          # dw += x2^T @ dy2 (on a GPU one GEMM with beta = 1: no temporary)
    if db is not None:
        if kernels.sums_into(dy2, db):
            kernels.column_sums(dy2, out=db)    # the sum added into db by the kernel: no separate add
        else:
            db += column_sum(dy2)
    if dx_into is None:
        return gemm.product(dy2, w, trans_b=True).reshape(x.shape)
    if gemm.fits(dx_into, dy2, w):
        gemm.matmul(dy2, w, dx_into.reshape(-1, w.shape[0]), trans_b=True, beta=1.0)
    else:
        dx_into += gemm.host_matmul(dy2, w.T).reshape(x.shape)
    return dx_into


# ----------------------------------------------------------------------------- relu
def relu_forward(x):
    """y = max(x, 0); backward needs only y (y > 0 exactly where x > 0)."""
    xp = xp_of(x)
    return xp.maximum(x, 0)


def relu_backward(dy, y):
    # y = max(x, 0)
    return dy * (y > 0)


def swish_forward(x):
    """y = x * sigmoid(x) (swish, or SiLU: Marian's --transformer-ffn-activation swish). The
    sigmoid as 0.5 * (1 + tanh(x / 2)): the same function, with no overflow for large |x|. 16-bit x
    is computed in float32 and y rounded to x's dtype (CuPy 14 makes a bfloat16 array times a Python
    float a float32 array: `scaled`)."""
    xp = xp_of(x)
    x32 = as_float32_if_half(x)
    return (x32 * (0.5 * (1.0 + xp.tanh(0.5 * x32)))).astype(x.dtype, copy=False)


def swish_backward(dy, x):
    # y = x * s, s = sigmoid(x): dy/dx = s + x * s * (1 - s)   (16 bits: in float32, dx in dy's dtype)
    xp = xp_of(x)
    x32 = as_float32_if_half(x)
    s = 0.5 * (1.0 + xp.tanh(0.5 * x32))
    return (dy * (s + x32 * s * (1.0 - s))).astype(dy.dtype, copy=False)


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


def layernorm_backward(dy, cache, g, dg, db, dy_residual=None, mask=None, d_sublayer_bias=None):
    """Accumulates dg, db [D]; returns dx with the compact form
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).

    dy_residual: a second gradient of the same output (the residual branch's, in a post-norm
    block y = LN(s) whose y also feeds the next sum): the upstream gradient is dy + dy_residual.
    mask: the dropout mask of the sublayer output inside s = x + dropout(sublayer(x)): returns
    (dx, dx * mask), the gradients of s (= of the residual x) and of the sublayer's output.
    d_sublayer_bias: the gradient buffer of the bias of the sublayer's last Linear, which then
    takes the column sums of the sublayer output's gradient here (on a GPU in the same launch as
    dg and db), not in its own backward (the post-norm blocks of blocks.py)."""
    if d_sublayer_bias is not None and not kernels.fused(dy, "grads"):   # the CPU, or the passes apart
        out = layernorm_backward(dy, cache, g, dg, db, dy_residual, mask)
        # sublayer(x) = h @ W + b_sublayer, its output's gradient out (or out[1] behind the dropout)
        d_sublayer_bias += column_sum((out if mask is None else out[1]).reshape(-1, dy.shape[-1]))
        return out
    d = dy.shape[-1]
    if kernels.enabled(dy) and not kernels.fused(dy, "grads"):   # the kernels as separate passes (comparisons)
        dy = dy if dy_residual is None else dy + dy_residual
        dy2 = dy.reshape(-1, d)
        dg += kernels.column_sums(dy2, kernels.xhat_of(cache).reshape(-1, d))
        db += kernels.column_sums(dy2)
        dx = kernels.layernorm_backward_input(dy, cache, g)
        return dx if mask is None else (dx, dx * mask_array(mask, dx))
    if kernels.enabled(dy):   # the same lines as below, fused (dy read in its own dtype; the cache (xhat, rstd),
        # or a kernels.NormCache, whose xhat the kernels compute again)
        own = dy_residual is not None and dy.flags.c_contiguous
        if dy_residual is not None and not own:
            dy = dy + dy_residual
        out = kernels.layernorm_backward_input(dy, cache, g, dy_residual if own else None, mask)
        sub = None if d_sublayer_bias is None else (out if mask is None else out[1])   # the sublayer's output gradient
        xhat = cache if type(cache) is kernels.NormCache else cache[0].reshape(-1, d)
        kernels.column_sums_pair(dy.reshape(-1, d), xhat, dg, db, sub, d_sublayer_bias)   # dy: the sum
        return out
    xhat, rstd = cache
    if dy_residual is not None:
        dy = dy + dy_residual
    out_dtype, dy = dy.dtype, as_float32_if_half(dy)
    dy2 = dy.reshape(-1, d)
    # y = xhat * g + b
    dg += (dy2 * xhat.reshape(-1, d)).sum(axis=0)
    db += dy2.sum(axis=0)
    dxhat = dy * g
    # xhat = (x - mean) * rstd, rstd = (var + eps)^-1/2
    dx = dxhat - dxhat.mean(axis=-1, keepdims=True)
    dx -= xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    dx *= rstd
    dx = dx.astype(out_dtype, copy=False)
    # s = x + dropout(sublayer(x)) = x + mask * sublayer(x)
    return dx if mask is None else (dx, dx * mask)


# ----------------------------------------------------------------------------- dropout
# A mask is a function of (seed, forward index, site, position in the padded [B*L, d] batch, d the
# activation's last width): the same in the padded and the packed (pad-free rows) layout, and on resume. NumPy draws each
# site's 16-bit uniforms from a PCG64 stream keyed by (seed, forward index, site) over the
# padded [B*L, d] positions, then keeps the packed rows; CuPy hashes each position with a
# counter-based generator (splitmix64 of key + word), inside the fused kernel or with xp ops:
# no generator state to set up, nothing drawn for pad rows.
M64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z):
    """splitmix64's output function on a Python int (mod 2^64)."""
    z = ((z ^ (z >> 30)) * MIX1) & M64
    z = ((z ^ (z >> 27)) * MIX2) & M64
    return z ^ (z >> 31)


class DropoutSites:
    """The masks of one training forward pass: forward `forward_index` of a model seeded
    `seed`. Each call of `next_site` names the next dropout site (sites are visited in the
    same order by every layout of the same batch)."""

    def __init__(self, seed, forward_index):
        self.seed, self.forward_index, self.site = int(seed), int(forward_index), 0

    def next_site(self):
        """(seed, forward index, site) of the next dropout site, and its 64-bit hash key."""
        site, self.site = self.site, self.site + 1
        key = mix64((mix64((mix64(self.seed + GOLDEN) ^ self.forward_index) + GOLDEN) ^ site) + GOLDEN)
        return (self.seed, self.forward_index, site), key


def hash_bits(xp, key, rowpos, n_rows, d):
    """uint16 [n_rows, d]: row r's uniforms at position rowpos[r] of [B*L, d] (rowpos None: r).
    Word w = rowpos * ceil(d / 4) + c // 4 + 1 of the row is splitmix64(key + w * GOLDEN);
    column c takes its 16 bits (c % 4) (what kernels.dropout_add computes per element)."""
    words = (d + 3) // 4
    pos = xp.arange(n_rows, dtype=np.uint64) if rowpos is None else rowpos.astype(np.uint64)
    z = pos.reshape(-1, 1) * np.uint64(words) + xp.arange(1, words + 1, dtype=np.uint64)    # [rows, words]
    z *= np.uint64(GOLDEN)
    z += np.uint64(key)
    for shift, mult in ((30, MIX1), (27, MIX2)):
        z ^= z >> np.uint64(shift)
        z *= np.uint64(mult)
    z ^= z >> np.uint64(31)
    return z.view(np.uint16).reshape(n_rows, 4 * words)[:, :d]


def dropout_bits(sites, xp, shape, rows=None):
    """The next site's 16-bit uniforms for an activation of `shape`: [..., d] in the padded
    layout (d its last width: D, F, or the keys of attention weights), or [N_t, d] / [N_s, d] packed with `rows` (packing.Rows). Same bits in both layouts."""
    (seed, forward_index, site), key = sites.next_site()
    d = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    if xp is np:
        full = n_rows if rows is None else int(np.prod(rows.shape))
        u = np.random.default_rng([seed, forward_index, site]).integers(0, 1 << 16, size=(full, d), dtype=np.uint16)
        return (u if rows is None else u[rows.host_index]).reshape(shape)
    return hash_bits(xp, key, None if rows is None else rows.index, n_rows, d).reshape(shape)


def dropout_mask(sites, shape, p, dtype, xp=np, rows=None):
    """Inverted-dropout mask: 0 with probability p, else 1/(1-p) (so the mask's expected value is 1), from the
    next site of `sites` (a DropoutSites)."""
    return _mask_of_bits(dropout_bits(sites, xp, shape, rows), p, dtype, xp)


def _mask_of_bits(u, p, dtype, xp):
    """The inverted-dropout mask of 16-bit uniforms u: 1/(1-p) where u >= keep_threshold(p), else 0."""
    mask = xp.empty(u.shape, dtype=dtype)
    xp.greater_equal(u, keep_threshold(p), out=mask, casting="unsafe")
    mask *= 1.0 / (1.0 - p)
    return mask


def mask_array(mask, like):
    """A dropout mask as an array shaped and typed as `like` ([rows, d] or [..., d]): `mask` itself, or
    the array a kernels.KeyedMask stands for (the bits kernels.residual_layernorm drew)."""
    if type(mask) is not kernels.KeyedMask:
        return mask
    xp, d = xp_of(like), like.shape[-1]
    return _mask_of_bits(hash_bits(xp, mask.key, mask.rowpos, like.size // d, d).reshape(like.shape), mask.p,
                         like.dtype, xp)


def dropout_forward(x, mask, inplace=False):
    """y = x * mask; `inplace` overwrites x (when nothing else holds it)."""
    if inplace:
        x *= mask
        return x
    return x * mask


def dropout_add_forward(sites, x, residual, p, rows=None):
    """(out, mask): out = x * mask + residual with the next site's inverted-dropout mask, x the
    dropout's input (a sublayer output nothing else holds, overwritten with out): the residual
    sum r + Dropout(Sublayer(r)) of 3.1 with x = Sublayer(r)."""
    if kernels.enabled(x):
        _, key = sites.next_site()
        return kernels.dropout_add(key, None if rows is None else rows.index, x, residual, p)
    mask = dropout_mask(sites, x.shape, p, x.dtype, xp_of(x), rows)
    out = dropout_forward(x, mask, inplace=True)
    out += residual
    return out, mask


def residual_layernorm_fused(y):
    """Whether residual_layernorm_forward runs for a sublayer output y: CuPy arrays on the fused
    path, unless MINITF_FUSED_NORM=0 (then the sum and the LayerNorm are two passes)."""
    return kernels.fused(y, "norm")


def residual_layernorm_forward(sites, x, y, p, g, b, eps, rows=None, y_bias=None):
    """LayerNorm(x + Dropout(y + y_bias)), a post-norm block's output (3.1; y_bias: the bias of the
    sublayer's last Linear, when it left it out), in one kernel: (out, mask, cache), the mask drawn
    from the next site of `sites` as dropout_add_forward draws it (sites None: no dropout, mask
    None; on the GPU a kernels.KeyedMask, drawn again by the backward), the cache a kernels.NormCache (the
    sum y, each row's mean and rstd: no xhat, which the backward computes again); the sum is written into y."""
    key = None if sites is None else sites.next_site()[1]
    return kernels.residual_layernorm(key, None if rows is None else rows.index, y, x, p, g, b, eps, y_bias)


def dropout_backward(dy, mask):
    # y = x * mask
    return dy * mask


# ----------------------------------------------------------------------------- attention
def check_attention_bias(bias):
    """ValueError unless bias has the four axes of [B, H, T, S] (each 1 or its length): a [B, S] padding bias (as
    the recurrent attention takes) would broadcast as [1, 1, B, S] and mask query b of every sentence by row b's
    padding, without an error, wherever B equals T."""
    if getattr(bias, "ndim", 4) != 4:
        raise ValueError(f"attention bias of shape {tuple(bias.shape)}: expected 4 axes, [B, H, T, S] with 1 for "
                         f"those it is the same along (a padding bias [B, S] is bias[:, None, None, :]: "
                         f"masks.padding_bias)")


QUERY_BLOCK = 256   # attention_forward without p: this many queries' weights [B, H, QUERY_BLOCK, S] at a time


def attention_forward(q, k, v, bias, scale, drop_mask=None, keep_p=True):
    """Scaled dot-product attention (paper 3.2.1): softmax(q k^T * scale + bias) v.

    q [B, H, T, K], k and v [B, H, S, K] (T, S: the query and key lengths, as cross-attention's;
    S = T = L in self-attention), bias broadcastable to [B, H, T, S] (0 where
    attending is allowed, a large negative number where it is masked). `drop_mask` [B, H, T,
    S] (an inverted-dropout mask, dropout_mask): attention dropout, (p * drop_mask) v, not in
    the paper (docs/deviations.md).
    Returns out [B, H, T, K] and p [B, H, T, S] (the softmax output, kept for backward). keep_p=False (a forward
    without a backward: decoding, a loss alone): p is None, and over QUERY_BLOCK queries the weights are made a block
    of queries at a time (each query's softmax is its own row), so memory grows with T * S by one block, not all.
    """
    check_attention_bias(bias)
    if not keep_p and drop_mask is None and q.shape[-2] > QUERY_BLOCK:
        return _attention_in_blocks(q, k, v, bias, scale), None
    scores = batched_matmul(scaled(q, scale), k.swapaxes(-1, -2))
    if kernels.enabled(scores):
        p = kernels.masked_softmax(scores, bias, out=scores)   # one pass: + bias, softmax
    else:
        scores += bias
        p = softmax_forward(scores)
    return batched_matmul(p if drop_mask is None else p * drop_mask, v), p


def _attention_in_blocks(q, k, v, bias, scale):
    """attention_forward's out, QUERY_BLOCK queries at a time (bias [.., T or 1, S] taken along)."""
    out = xp_of(q).empty(q.shape[:-1] + v.shape[-1:], dtype=v.dtype)
    for a in range(0, q.shape[-2], QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, q.shape[-2])
        out[..., a:b, :] = attention_forward(q[..., a:b, :], k, v, bias[..., a:b, :] if bias.shape[-2] > 1 else bias,
                                             scale)[0]
    return out


def attention_backward(dout, q, k, v, p, scale, drop_mask=None):
    """Returns dq, dk, dv for attention_forward (the same drop_mask)."""
    # out = p @ v, or (p * drop_mask) @ v
    dv = batched_matmul((p if drop_mask is None else p * drop_mask).swapaxes(-1, -2), dout)
    dp = batched_matmul(dout, v.swapaxes(-1, -2))
    if drop_mask is not None:
        dp *= drop_mask
    # p = softmax(scores)
    ds = kernels.softmax_backward(dp, p, out=dp) if kernels.enabled(dp) else softmax_backward(dp, p)
    # scores = (q * scale) @ k^T + bias
    dq = batched_matmul(ds, k)
    dq *= scale
    dk = batched_matmul(ds.swapaxes(-1, -2), scaled(q, scale))
    return dq, dk, dv


def scaled(x, s):
    """x * s (s a Python number) as a new array of x's dtype. CuPy 14 computes a bfloat16 array times a Python
    float in float32 and returns float32 where numpy.result_type(0.0, bfloat16) is float64 (ml_dtypes before 0.7:
    it takes float32's loop), in bfloat16 where it is bfloat16 (0.7 on); written into an array of x's dtype, the
    product has x's dtype either way, rounded back as NumPy rounds float16's."""
    xp = xp_of(x)
    return xp.multiply(x, s, out=xp.empty(x.shape, dtype=x.dtype))


def batched_matmul(a, b):
    """a @ b over the leading axes (gemm.host_matmul: in float32 where the array module has no product of the dtype's
    own, NumPy's float16 and CuPy's bfloat16)."""
    return gemm.host_matmul(a, b)


def split_heads(x, n_heads):
    """[B, L, H*K] -> [B, H, L, K]."""
    b, length, hk = x.shape
    return x.reshape(b, length, n_heads, hk // n_heads).transpose(0, 2, 1, 3)


def split_last(x, n):
    """[..., n*m] -> n views [..., m] (e.g. q, k, v of one fused projection)."""
    m = x.shape[-1] // n
    return [x[..., i * m: (i + 1) * m] for i in range(n)]


def merge_heads(x):
    """[B, H, L, K] -> [B, L, H*K] (contiguous)."""
    b, h, length, k = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, length, h * k)
