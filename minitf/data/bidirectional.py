"""Bidirectional training: the first epochs on the pairs in both directions (Ding et al. 2021).

"Improving Neural Machine Translation by Bidirectional Training" (Ding, Wu and Tao, 2021)
trains the model on the training pairs AND on the same pairs reversed (target -> source) for the first
part of the run, then on the source -> target pairs alone. The shared vocabulary and the tied
embeddings (paper 3.4) let one model read and write both languages; nothing tells it the direction but
the language of its input. The reversed pairs teach the encoder the target language and the decoder the
source language from the same data: no new data, no new parameters.

`Bidirectional(pairs, epochs).epoch(e)` is what epoch e trains on: `BothWays(pairs)` (2n pairs, the n
pairs then the n reversed, planned into batches together, so a batch may mix the directions) for
e < epochs, `pairs` itself after. It depends on the epoch alone, so a resumed run and every MPI rank
see the same pairs. The output layer must score the source side's pieces too (recipe.build_config
widens `--output-vocab target` to both sides' pieces, recipe.target_pieces).
"""
import numpy as np

from minitf.data.binarized import TokenPairs


class BothWays:
    """`pairs` (n source -> target pairs) followed by the same pairs reversed: 2n pairs, with the
    batcher's view (`src_lens`, `tgt_lens`, `collate`) of TokenPairs. Pair i < n is pair i;
    pair n + i is pair i's target as the source and its source as the target. Nothing is copied
    but the lengths: the rows are read from `pairs` (memory-mapped or not) batch by batch."""

    def __init__(self, pairs):
        self.pairs = pairs
        self.reverse = TokenPairs(*reversed(pairs.sides()), vocab_size=pairs.vocab_size, files=pairs.files)
        self.src_lens = np.concatenate([pairs.src_lens, pairs.tgt_lens])
        self.tgt_lens = np.concatenate([pairs.tgt_lens, pairs.src_lens])

    def __len__(self):
        return int(self.src_lens.size)

    def collate(self, idx, pad_id=0, bos_id=2, eos_id=3):
        """(src [B, S], tgt_in [B, T], tgt_out [B, T]) of the pairs `idx`, in idx's order, exactly as
        TokenPairs.collate makes them."""
        idx = np.asarray(idx, dtype=np.int64)
        n = len(self.pairs)
        back = idx >= n
        src, tgt = [None] * idx.size, [None] * idx.size
        for pairs, where in ((self.pairs, np.flatnonzero(~back)), (self.reverse, np.flatnonzero(back))):
            if where.size == 0:
                continue
            rows = idx[where] % n
            for side, out in zip(pairs.sides(), (src, tgt)):
                tokens, local = pairs.rows_of(*side, rows)
                for k, i in enumerate(where):
                    out[i] = tokens[local[k]: local[k + 1]]
        return TokenPairs.from_lists(src, tgt).collate(np.arange(idx.size), pad_id, bos_id, eos_id)


class Bidirectional:
    """The training pairs of each epoch: both directions for the first `epochs`, then `pairs`
    (the `epoch(e)` / `lengths(e)` interface feed.py plans and collates with, as BPEDropout's)."""

    def __init__(self, pairs, epochs):
        if int(epochs) < 1:
            raise ValueError(f"Bidirectional: epochs must be >= 1, got {epochs}")
        self.pairs, self.epochs = pairs, int(epochs)
        self.both = BothWays(pairs)

    def epoch(self, epoch):
        return self.both if epoch < self.epochs else self.pairs

    def lengths(self, epoch):
        pairs = self.epoch(epoch)
        return pairs.src_lens, pairs.tgt_lens
