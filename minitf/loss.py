"""Label-smoothed cross-entropy over non-pad target tokens (paper 5.4, eps_ls = 0.1).

Per token: (1 - eps) * (-log p[gold]) + eps * mean_v(-log p[v]); averaged over the N
non-pad tokens. With q = (1 - eps) * onehot(gold) + eps / V_o (which sums to 1; V_o, the logits' width, is V without an output vocabulary), the
gradient is dlogits = (softmax(logits) - q) / N on non-pad rows and 0 on pad rows.
"""
from typing import NamedTuple

from . import kernels
from .backend import xp_of
from .functional import as_float32_if_half


class LossCache(NamedTuple):
    """What label_smoothed_nll_backward needs: the softmax p [rows, V_o] (overwritten by the
    backward), targets [rows], weights w [rows] (1 on non-pad), the count, eps, the logits' dtype."""
    p: object
    tgt: object
    w: object
    n_safe: object
    eps: float
    out_dtype: object
    spent: list           # [True] once the backward has used p: a second backward is refused (p is its output)


class FusedLossCache(NamedTuple):
    """The fused GPU path keeps the logits [rows, V_o] and each row's logsumexp [rows] instead of p."""
    logits: object
    tgt: object
    lse: object
    w: object          # per-row weights, or None: every row weighs 1
    n_safe: object
    eps: float
    loss_sum: object = None   # the loss times the token count ([] on the device; w None only)
    grad_for: tuple = None    # (dloss, dscale): the gradient is already in `logits` (label_smoothed_nll's grad)


def log_softmax(logits):
    """Stable log-softmax over the last axis: x - max - log(sum(exp(x - max)))."""
    xp = xp_of(logits)
    logits = as_float32_if_half(logits)
    z = logits - logits.max(axis=-1, keepdims=True)
    z -= xp.log(xp.exp(z).sum(axis=-1, keepdims=True))
    return z


def label_smoothed_nll(logits, target, eps, pad_id, grad=None):
    """logits [rows, V_o] (or [B, T, V_o]), target [rows] (or [B, T]) int: N rows when the caller has
    dropped the pad rows (Seq2Seq.loss_head), pad_id None.

    Returns (loss, nll_sum, n_tokens, cache), the first three 0-d device arrays (no host
    sync): the smoothed loss averaged over non-pad tokens, the summed plain NLL (for
    perplexity) and the non-pad token count. The cache holds the softmax p [rows, V_o] (on the fused GPU path the
    logits and their logsumexp instead); log p is
    never materialized: log p[v] = z[v] - log(sum(exp(z))) with z = logits - max.
    pad_id None: every target has a loss (the caller took the pad rows out); on the fused GPU path
    n_tokens is then the host's count.
    grad (dloss, dscale): the arguments label_smoothed_nll_backward will be called with. On the fused
    GPU path with pad_id None (unless MINITF_FUSED_LOSS=0), the forward then writes the gradient over
    the logits (kernels.smoothed_nll_rows' grad: in the launch that reads them, where the 16-byte loads
    apply) and the backward only hands it out; elsewhere it changes nothing.
    """
    xp = xp_of(logits)
    v, out_dtype = logits.shape[-1], logits.dtype
    if kernels.enabled(logits):
        return _fused_label_smoothed_nll(logits.reshape(-1, v), target.reshape(-1), eps, pad_id, grad)
    pad_id = -1 if pad_id is None else pad_id
    l2 = as_float32_if_half(logits.reshape(-1, v))                                   # 16-bit -> float32
    z = l2 - l2.max(axis=-1, keepdims=True)                                          # [rows, V_o]
    p = xp.exp(z)
    s = p.sum(axis=-1, keepdims=True)
    log_s = xp.log(s)[:, 0]                                                          # [rows]
    tgt = target.reshape(-1)
    gold = z[xp.arange(tgt.shape[0]), tgt] - log_s                                   # log p[gold]
    mean_logp = z.mean(axis=-1) - log_s                                              # mean_v log p[v]
    p /= s
    per_tok = (1.0 - eps) * -gold - eps * mean_logp
    w = (tgt != pad_id).astype(z.dtype)
    n = w.sum()
    n_safe = xp.maximum(n, 1.0)
    loss = (per_tok * w).sum() / n_safe
    nll_sum = (-gold * w).sum()
    return loss, nll_sum, n, LossCache(p, tgt, w, n_safe, eps, out_dtype, [False])


def _fused_label_smoothed_nll(logits, tgt, eps, pad_id, grad=None):
    """GPU: one kernel (a block per row) gives logsumexp, -log p[gold] and mean_v -log p[v]
    (kernels.smoothed_nll_rows); the softmax is never stored: backward recomputes it. pad_id None
    (every row has a loss, the count known on the host): one more launch gives the loss, the
    NLL sum and the loss times the count (kernels.loss_totals), and the token count is a host number;
    given grad too (unless MINITF_FUSED_LOSS=0), the forward writes the gradient over the logits
    (kernels.smoothed_nll_rows) and the backward hands it out."""
    xp = xp_of(logits)
    logits = xp.ascontiguousarray(logits)   # the array the cache holds is the one the kernels read and write
    if not kernels.fused(logits, "loss"):   # MINITF_FUSED_LOSS=0: the backward computes the gradient
        grad = None
    if pad_id is None:
        n = float(len(tgt))
        n_safe = max(n, 1.0)
        # the gradient of dloss * loss: every row weighs dloss / n (label_smoothed_nll_backward's w_scale)
        row_grad = None if grad is None else (grad[0] / n_safe, grad[1], eps)
        lse, nll, smooth = kernels.smoothed_nll_rows(logits, tgt, grad=row_grad)
        totals = kernels.loss_totals(nll, smooth, eps, 1.0 / n_safe, logits.dtype, count=n)
        return totals[0], totals[1], n, FusedLossCache(logits, tgt, lse, None, n_safe, eps, totals[2],
                                                       None if grad is None else tuple(grad))
    lse, nll, smooth = kernels.smoothed_nll_rows(logits, tgt)
    w = (tgt != pad_id).astype(lse.dtype)
    n = w.sum()
    n_safe = xp.maximum(n, 1.0)
    loss = (((1.0 - eps) * nll + eps * smooth) * w).sum() / n_safe
    return loss, (nll * w).sum(), n, FusedLossCache(logits, tgt, lse, w, n_safe, eps)


def label_smoothed_nll_backward(cache, dloss=1.0, dscale=None):
    """dlogits [rows, V_o] (reshape to the logits' shape) for label_smoothed_nll: the gradient of
    dloss * loss, times dscale[0] when given (a [1] device array: the loss scale kept on the
    device, optim.UpdateCheck.loss_scale).

    Reuses (overwrites) the cached softmax (the logits on the fused GPU path): call it once
    per forward. Where the forward wrote the gradient (given `grad` on the fused GPU path with pad_id
    None, unless MINITF_FUSED_LOSS=0: label_smoothed_nll), returns it, after checking that dloss and
    dscale are the ones it was written for."""
    if isinstance(cache, FusedLossCache):
        c = cache
        if c.grad_for is not None:
            if c.grad_for[0] != dloss or c.grad_for[1] is not dscale:
                raise ValueError(f"label_smoothed_nll_backward(dloss={dloss!r}, dscale=...): the forward wrote the "
                                 f"gradient for dloss={c.grad_for[0]!r}"
                                 f"{'' if c.grad_for[1] is dscale else ' and another dscale array'}: pass both the same")
            return c.logits
        if c.w is None:      # every row has a loss: one scalar weight, passed to the kernel as is
            return kernels.smoothed_nll_backward(c.logits, c.tgt, c.lse, None, c.eps, out=c.logits,
                                                 w_scale=dloss / c.n_safe, dscale=dscale)
        return kernels.smoothed_nll_backward(c.logits, c.tgt, c.lse, c.w * (dloss / c.n_safe), c.eps, out=c.logits,
                                             dscale=dscale)
    p, tgt, w, n_safe, eps, out_dtype, spent = cache
    if spent[0]:   # p now holds the last backward's result: a second one would start from it
        raise ValueError("label_smoothed_nll_backward: this forward's cache was used by a backward already (it "
                         "overwrites the softmax it keeps): run label_smoothed_nll again for another backward")
    spent[0] = True
    xp = xp_of(p)
    v = p.shape[-1]
    # loss = sum_rows w * ((1-eps) * -logp[gold] - eps * mean_v logp) / N
    # d/dlogits of one row: softmax - q with q = (1-eps) onehot + eps/V_o (v = V_o columns)
    d = p
    d -= eps / v
    d[xp.arange(tgt.shape[0]), tgt] -= 1.0 - eps
    d *= (w * (dloss / n_safe))[:, None]
    if dscale is not None:
        d *= dscale
    return d.astype(out_dtype, copy=False)
