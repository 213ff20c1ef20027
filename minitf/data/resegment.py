"""BPE-dropout on the training pairs: every epoch segments the sentences anew (Provilkov et al. 2020).

The binarized cache holds every sentence segmented once, by plain BPE: the merges applied in the order
they were learnt until none applies. BPE-dropout leaves each possible merge out of each step with
probability p (`segment`), so a word comes out in smaller pieces now and then (`▁truck` in one epoch,
`▁tr uck` in another) and the model learns the pieces' composition. `BPEDropout` does this from the
cache's ids alone: it splits a side's sentences into words (a piece that starts with `▁` starts a word),
draws POOL segmentations of every distinct word once, and for epoch e gives each occurrence of a word
one of its word's POOL segmentations at random, vectorized. The draws come from (the run's seed, the
side) and (seed, e, side): an epoch's pieces depend on nothing else, so a resumed run sees the pieces
an uninterrupted one would, and every MPI rank plans the same batches.

Drawing from a pool of POOL segmentations per distinct word rather than afresh for every occurrence
is this module's shortcut (it keeps an epoch's resegmentation to NumPy gathers): each occurrence's
segmentation has BPE-dropout's distribution, but two occurrences may share a pool entry (1 in POOL a pair),
the POOL segmentations are the same in every epoch, and a frequent word shows at most POOL of them. Validation, test and translation keep plain BPE.
"""
import random

import numpy as np

from minitf.data.binarized import TokenPairs

POOL = 16          # segmentations drawn per distinct word (see above)
SIDES = ("source", "target")
WORD_START = "\u2581"   # SentencePiece's mark of a word's first piece


def segment(chars, merges, p, draw):
    """BPE-dropout of one word (Provilkov et al. 2020, Algorithm 1): start from its characters; at every
    step, among the adjacent pairs whose concatenation is a merge, each is left out of this step with
    probability p (`draw()`: uniform in [0, 1)), and the one of lowest rank (`merges[piece]`; the
    leftmost among equals) is merged; stop when no pair is left. p = 0 is plain BPE: SentencePiece's
    own segmentation (tested on every word of a corpus). Returns the list of pieces."""
    symbols = list(chars)
    while len(symbols) > 1:
        best, where = None, None
        for i in range(len(symbols) - 1):
            rank = merges.get(symbols[i] + symbols[i + 1])
            if rank is not None and (best is None or rank < best) and (p == 0 or draw() >= p):
                best, where = rank, i
        if where is None:
            break
        symbols[where:where + 2] = [symbols[where] + symbols[where + 1]]
    return symbols


def _resegment(ids, atomic, piece_of, piece_ids, merges, p, draw):
    """One word's ids segmented anew (`segment`), its `atomic` ids kept as they are and the runs between them
    segmented each on its own."""
    out, run = [], []
    for i in ids + [None]:
        if i is None or i in atomic:
            if run:
                out += [piece_ids[piece] for piece in segment("".join(piece_of[j] for j in run), merges, p, draw)]
                run = []
            if i is not None:
                out.append(i)
        else:
            run.append(i)
    return out


def _seed(*key):
    """An integer seed from integers (a hash: neighbouring keys give unrelated streams)."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


class _Words:
    """One side's sentences as words: `word_type` [n_words] (the distinct word of each occurrence),
    `first_word` [sentences] (each sentence's first word), and per distinct word POOL segmentations, flat:
    entry t * POOL + j spans `pool_tokens[pool_start[entry] : + pool_len[entry]]`."""

    def __init__(self, tokens, offsets, lens, tokenizer, p, rnd):
        merges, piece_ids = tokenizer.merges()
        piece_of = {i: piece for piece, i in piece_ids.items()}
        tokens = np.asarray(tokens, dtype=np.int64)
        offsets, lens = np.asarray(offsets, dtype=np.int64), np.asarray(lens, dtype=np.int64)
        is_start = np.zeros(tokenizer.vocab_size, dtype=bool)   # unknown and control ids start no word
        is_start[[i for i, piece in piece_of.items() if piece.startswith(WORD_START)]] = True
        starts = is_start[tokens]
        starts[offsets[:-1][lens > 0]] = True        # a sentence's first piece starts a word
        word_pos = np.flatnonzero(starts)
        self.first_word = np.searchsorted(word_pos, offsets[:-1])
        ends = np.append(word_pos[1:], tokens.size)
        raw = tokens.astype("<i4").tobytes()
        types, word_type = {}, []
        for a, b in zip(word_pos.tolist(), ends.tolist()):
            word_type.append(types.setdefault(raw[4 * a:4 * b], len(types)))
        self.word_type = np.array(word_type, dtype=np.int64)
        # a model's user-defined symbols (a <2de> tag, or "ing"; no merges): SentencePiece matches them whole before
        # BPE, so they stay whole here too (rebuilt from their characters, they had been lost)
        atomic = {i for i in tokenizer.user_defined_ids() if len(piece_of.get(i, "")) > 1}
        pool = []
        for key in types:   # in order of first occurrence: the draws do not depend on a dict's hashing
            ids = np.frombuffer(key, dtype="<i4").tolist()
            text = "".join(piece_of.get(i, "\0") for i in ids)
            if "\0" in text or any(c not in piece_ids for c in text):   # an unknown piece: kept as it is
                pool.extend([ids] * POOL)
                continue
            for _ in range(POOL):
                pool.append(_resegment(ids, atomic, piece_of, piece_ids, merges, p, rnd.random))
        self.pool_len = np.fromiter(map(len, pool), dtype=np.int64, count=len(pool))
        self.pool_start = np.zeros(len(pool), dtype=np.int64)
        np.cumsum(self.pool_len[:-1], out=self.pool_start[1:])
        self.pool_tokens = np.fromiter((i for ids in pool for i in ids), dtype=np.int64,
                                       count=int(self.pool_len.sum()))

    def draw(self, rng):
        """(tokens, offsets, lens) of the sentences with each word's segmentation drawn from its pool."""
        entry = self.word_type * POOL + rng.integers(0, POOL, size=self.word_type.size)
        n = self.pool_len[entry]
        within = np.zeros(n.size, dtype=np.int64)
        np.cumsum(n[:-1], out=within[1:])
        total = int(n.sum())
        tokens = self.pool_tokens[np.repeat(self.pool_start[entry] - within, n) + np.arange(total)]
        lens = np.add.reduceat(n, self.first_word) if n.size else n
        offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        return tokens, offsets, lens


class BPEDropout:
    """`pairs` (TokenPairs, plain BPE) segmented anew each epoch: `epoch(e)` -> TokenPairs.

    `p`: (source p, target p); a side with p 0 keeps the cache's ids (memory-mapped as they are). `longest`: the
    most pieces a sentence may have (a batch's tokens less its EOS or BOS): a sentence whose draw has more keeps
    its plain segmentation in that epoch (`kept_plain[epoch]` counts them), so that a later epoch's draw cannot
    stop the run (a sentence drawn longer than a batch had ended it epochs in, and every resume again)."""

    def __init__(self, pairs, tokenizer, p, seed, longest=None):
        self.pairs, self.seed, self.longest, self.kept_plain = pairs, int(seed), longest, {}
        self.p = tuple(float(x) for x in p)
        if len(self.p) != 2 or not all(0.0 <= x < 1.0 for x in self.p) or not any(self.p):
            raise ValueError(f"BPEDropout: p must be (source, target) in [0, 1), one of them > 0, got {p}")
        self.words = [_Words(*side, tokenizer, q, random.Random(_seed(self.seed, k))) if q else None
                      for k, (side, q) in enumerate(zip(pairs.sides(), self.p))]
        self._kept = (None, None)   # (epoch, TokenPairs) of the last epoch asked for

    def epoch(self, epoch):
        """The training pairs as epoch `epoch` segments them (the last epoch asked for is kept: the
        batches of an epoch are planned and collated from one TokenPairs)."""
        kept_epoch, kept = self._kept
        if kept_epoch != epoch:
            sides, self.kept_plain[epoch] = [], 0
            for k, (side, words) in enumerate(zip(self.pairs.sides(), self.words)):
                if words is not None:
                    side = self._within(words.draw(np.random.default_rng([self.seed, int(epoch), k])), side, epoch)
                sides.append(side)
            kept = TokenPairs(*sides)
            self._kept = (epoch, kept)
        return kept

    def _within(self, drawn, plain, epoch):
        """`drawn` (tokens, offsets, lens of a side), but for the sentences longer than `longest`: their `plain`
        segmentation (read with TokenPairs.rows_of)."""
        tokens, offsets, lens = drawn
        over = np.flatnonzero(lens > self.longest) if self.longest is not None else ()
        if not len(over):
            return drawn
        extra, extra_offsets = self.pairs.rows_of(*plain, over)
        self.kept_plain[epoch] += int((np.diff(extra_offsets) <= self.longest).sum())   # (a longer one stops the run)
        lens = lens.copy()
        lens[over] = np.diff(extra_offsets)
        starts = offsets[:-1].copy()                        # where each sentence's pieces lie in tokens + extra
        starts[over] = tokens.size + extra_offsets[:-1]
        new_offsets = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=new_offsets[1:])
        both = np.concatenate([tokens, np.asarray(extra, dtype=tokens.dtype)])
        return both[np.repeat(starts - new_offsets[:-1], lens) + np.arange(int(new_offsets[-1]))], new_offsets, lens

    def lengths(self, epoch):
        """(src_lens, tgt_lens) of `epoch`: what the batches of that epoch are planned with."""
        pairs = self.epoch(epoch)
        return pairs.src_lens, pairs.tgt_lens

    def growth(self, epoch):
        """{side: pieces in `epoch` / pieces of plain BPE} of the resegmented sides."""
        pairs = self.epoch(epoch)
        now, was = (pairs.src_lens, pairs.tgt_lens), (self.pairs.src_lens, self.pairs.tgt_lens)
        return {SIDES[k]: float(now[k].sum()) / max(1.0, float(was[k].sum())) for k in range(2) if self.p[k]}
