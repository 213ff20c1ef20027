#!/usr/bin/env python
"""BPE-dropout on a binarized cache: what it costs and how much longer the sentences get.

For the cache folder given (one `python -m minitf prepare` or a training run wrote; see docs/data.md):
  check    plain BPE through `minitf.data.resegment.segment` (p 0) against the cache's ids, every
           word of both sides: True when they are the same pieces
  tables   seconds to build the word tables (both sides, p > 0), as every rank does at a run's start
  epoch    seconds to resegment one epoch (median of --rounds epochs)
  growth   pieces per side in an epoch / pieces of plain BPE, for each p

usage: python bench/bpe_dropout.py --cache ~/.cache/minitf/bin/multi30k.XXXXXXXX.en-de --src en --tgt de --p 0.05 0.1
(a BPE cache: Multi30k's default tokenizer is unigram, so prepare it with
`python -m minitf prepare --dataset multi30k --subword bpe`)
"""
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minitf.data.binarized import open_cache            # noqa: E402
from minitf.data.resegment import POOL, BPEDropout, _Words   # noqa: E402
from minitf.flags import Number                         # noqa: E402
from bench.flags import count, parser, run              # noqa: E402
from bench.train_step import cpu_model                  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--cache", required=True, help="a binarized cache folder of a BPE tokenizer")
    ap.add_argument("--src", default="en")
    ap.add_argument("--tgt", default="de")
    ap.add_argument("--p", type=Number(float, above=0, below=1), nargs="+", default=[0.05, 0.1], metavar="PROB")
    ap.add_argument("--rounds", type=count(), default=5)
    args = ap.parse_args()
    corpus = open_cache(args.cache)
    pairs, tok = corpus.pairs(args.src, args.tgt), corpus.tokenizer
    print(f"{cpu_model()}, {os.cpu_count()} cores; {len(pairs):,} pairs")
    for name, side in zip((args.src, args.tgt), pairs.sides()):
        words = _Words(*side, tok, 0.0, random.Random(0))
        tokens, _, lens = words.draw(np.random.default_rng(0))
        same = np.array_equal(tokens, np.asarray(side[0])) and np.array_equal(lens, side[2])
        print(f"{name}: {words.word_type.size:,} words, {words.pool_len.size // POOL:,} distinct; "
              f"plain BPE through segment() equals the cache: {same}")
    for p in args.p:
        t = time.perf_counter()
        drop = BPEDropout(pairs, tok, (p, p), seed=1)
        tables = time.perf_counter() - t
        times = []
        for e in range(args.rounds):
            t = time.perf_counter()
            drop.epoch(e)
            times.append(time.perf_counter() - t)
        growth = ", ".join(f"{side} {g:.3f}x" for side, g in drop.growth(args.rounds - 1).items())
        print(f"p {p}: tables {tables:.2f} s, an epoch {statistics.median(times) * 1000:.0f} ms (median of "
              f"{args.rounds}); {growth} the pieces of plain BPE")


if __name__ == "__main__":
    run(main)
