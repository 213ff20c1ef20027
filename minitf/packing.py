"""Pad-free rows: in training, the position-wise layers skip the pad positions.

Everything in the Transformer except attention works on one position at a time (Linear, the
FFN, LayerNorm, dropout, the residual sums: paper 3.1-3.3, 5.4). In a padded batch [B, L] the
pad positions' rows are pure waste there: they carry no loss, and since every pad key is
masked out, no other position reads them (their gradient is exactly 0). `Rows` keeps the
flat indices of the positions that matter; activations travel as [N_s, D] and [N_t, D] (the
kept positions) and only attention unpacks them to [B, L, .] (zeros at the pads, which the
masks hide) and packs its output back. Loss and gradients are those of the padded
computation; only the (unused) activations at pad positions are no longer computed.
Used by `Transformer.forward_loss`; `Transformer.forward` (logits at every position) and
decoding keep the padded layout. The unpacked version, every layer on [B, L, D]:
`Transformer.forward_loss(..., packed=False)`, with the same loss and gradients, dropout on
or off (a dropout mask is a function of the position in the padded batch, so the packed rows
get the padded rows' masks): tests/test_engine.py. The whole step written plainly is
reference.py (tests/test_reference.py).
"""
from typing import NamedTuple

import numpy as np

from .backend import to_device, to_numpy, xp_of


class Spans(NamedTuple):
    """Where each sentence's rows lie among the kept rows, when they are its first positions (a batch
    padded at the end): sentence b is rows start[b] .. start[b] + length[b] - 1 (int32 [B] arrays on the
    rows' device), `count` sentences, the longest `most` rows long. What kernels.attention_rows reads."""
    start: object
    length: object
    count: int
    most: int


class Rows:
    """The kept positions of a [B, L] batch: keep [B, L] bool, best a host (NumPy) array, as
    batches come from the host: the index is then found there and copied to the device, so
    a GPU step never waits for the GPU to learn how many rows it has. `keys`: whether the kept
    positions are exactly those an attention over them may look at (the keys its padding bias keeps);
    only then are `spans` given."""

    def __init__(self, keep, xp=np, keys=True):
        keep = to_numpy(keep)
        self.shape = keep.shape
        self.host_index = np.flatnonzero(keep.reshape(-1))      # [rows] positions b * L + l
        self.index = to_device(self.host_index, xp)
        self._inverse = None
        self._keep, self._keys, self._spans = keep, keys, False

    @property
    def spans(self):
        """Spans of the kept rows (built on the host once per batch), or None: unless `keys`, or where a
        sentence's kept positions are not its first ones, a sentence keeps none, or the batch is empty."""
        if self._spans is False:
            keep, self._spans = self._keep, None
            length = keep.sum(axis=1)
            if (self._keys and length.size and length.min() > 0
                    and (keep == (np.arange(keep.shape[1]) < length[:, None])).all()):
                start = np.concatenate([[0], np.cumsum(length)[:-1]])
                xp = xp_of(self.index)
                self._spans = Spans(to_device(start.astype(np.int32), xp), to_device(length.astype(np.int32), xp),
                                    len(length), int(length.max()))
        return self._spans

    @property
    def inverse(self):
        """int32 [B*L] on the device: position p's row in the packed layout, -1 where dropped
        (what kernels.unpack_heads reads); built on the host once per batch."""
        if self._inverse is None:
            inv = np.full(int(np.prod(self.shape)), -1, dtype=np.int32)
            inv[self.host_index] = np.arange(len(self.host_index), dtype=np.int32)
            self._inverse = to_device(inv, xp_of(self.index))
        return self._inverse

    def pack(self, x):
        """x [B, L, c] -> [rows, c] (a copy; c any width, rows the kept positions)."""
        return x.reshape(-1, x.shape[-1])[self.index]

    def unpack(self, x):
        """x [rows, c] -> [B, L, c], zeros at the dropped positions."""
        xp = xp_of(x)
        b, l = self.shape
        out = xp.zeros((b * l, x.shape[-1]), dtype=x.dtype)
        out[self.index] = x
        return out.reshape(b, l, x.shape[-1])


def unpack(rows, x):
    """`rows.unpack(x)`, or x itself when nothing was packed (rows None)."""
    return x if rows is None else rows.unpack(x)


def pack(rows, x):
    """`rows.pack(x)`, or x itself when nothing is packed (rows None)."""
    return x if rows is None else rows.pack(x)


def make_rows(keep, xp=np, keys=True, whole=False):
    """Rows(keep, xp, keys), or None when every position is kept (a batch without padding): then the
    [B, L, D] layout is used as it is, with no copies. `whole`: Rows even then (every position a row, in
    order: the same memory as [B, L, D]), for the attention on packed rows (Rows.spans)."""
    keep = to_numpy(keep)
    return None if keep.all() and not whole else Rows(keep, xp, keys)
