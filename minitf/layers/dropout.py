"""Dropout (paper 5.4): on every sublayer output and on the embedding + positional sums.

One instance per call site, so each keeps its own mask. The model passes in the forward
pass's `functional.DropoutSites` (a mask is a function of the seed, the forward index, the
site and the position in the padded [B*L, d] batch, d the activation's last width, so a run resumes
exactly and the packed layout draws the padded layout's masks: `rows` says which positions a packed [N_t, D] or [N_s, D] holds);
`mask=` fixes the mask (gradient checks).
"""
from .. import functional as F
from .base import Layer


NOT_DROPPED = "not dropped"   # a forward's cache when it dropped nothing (no cache at all: no forward to go back through)


class Dropout(Layer):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def active(self, sites):
        """Whether this forward drops: training, p > 0 and dropout sites (otherwise no site is spent)."""
        return self.training and self.p != 0.0 and sites is not None

    def draw(self, sites, shape, dtype, xp, rows=None):
        """The next mask of `sites` for an activation of `shape`, or None when not active (for a
        layer that applies the mask itself: the attention weights)."""
        return F.dropout_mask(sites, shape, self.p, dtype, xp, rows) if self.active(sites) else None

    def forward(self, x, sites=None, mask=None, rows=None):
        """x * mask (the next mask of `sites` unless `mask` is given); without a `mask`, identity in eval mode."""
        if mask is None:
            mask = self.draw(sites, x.shape, x.dtype, F.xp_of(x), rows)
            if mask is None:
                self.cache = NOT_DROPPED
                return x
        self.cache = mask
        return F.dropout_forward(x, mask)

    def forward_add(self, x, residual, sites=None, rows=None):
        """residual + Dropout(x), written into x (the dropout's input: a sublayer output nothing
        else holds); backward returns the gradient of x (the residual's is the sum's own)."""
        if not self.active(sites):
            self.cache = NOT_DROPPED
            x += residual
            return x
        out, self.cache = F.dropout_add_forward(sites, x, residual, self.p, rows)
        return out

    def hold(self, mask):
        """Keep `mask` (an array, or a kernels.KeyedMask; None: nothing was dropped) as this forward's,
        drawn and applied by a caller that fuses the dropout into its own pass (LayerNorm.forward_residual, the
        embedding's kernel)."""
        self.cache = NOT_DROPPED if mask is None else mask

    def take_mask(self):
        """The forward's mask (None when it did not drop), handed to a caller that applies it
        itself (LayerNorm.backward, Transformer._embed_backward): this layer's backward is then done."""
        mask = self.take_cache()
        return None if mask is NOT_DROPPED else mask

    def backward(self, dy):
        # y = x * mask  (identity where the forward dropped nothing); a backward without a forward is a RuntimeError
        mask = self.take_cache()
        if mask is NOT_DROPPED:
            return dy
        return F.dropout_backward(dy, F.mask_array(mask, dy))
