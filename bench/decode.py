"""Decoding speed: sentences/s of batched beam search with and without the KV cache.

    python bench/decode.py --preset small --beam 4                       # random weights
    python bench/decode.py --checkpoint runs/m30k/averaged.npz \\
        --src ../shared/data/multi30k/test_2016_flickr.en.gz --n 200     # a trained model

With the cache, each step feeds only the newest token and reuses the earlier positions'
keys/values (and the encoder output's, computed once); without it, every step recomputes
the decoder over the whole prefix. Both produce the same translations (checked here).
Rounds alternate between the two; medians are reported with the ratio.
"""
import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf.backend import synchronize  # noqa: E402
from minitf.decode import beam_search  # noqa: E402


def load(args):
    if args.checkpoint:
        from minitf.translate import load_for_inference
        model, tok = load_for_inference(args.checkpoint, args.device)
        if args.src:
            from minitf.data import read_lines
            ids = tok.encode(read_lines(args.src)[: args.n])
            return model, [s + [tok.eos_id] for s in ids]
    else:
        cfg = minitf.TransformerConfig.preset(args.preset, vocab_size=args.vocab)
        model = minitf.Transformer(cfg, device=args.device, seed=0).eval()
    rng = np.random.default_rng(0)   # random sources of Multi30k-like lengths (8..20 pieces)
    return model, [list(rng.integers(4, model.cfg.vocab_size, rng.integers(8, 21))) + [3] for _ in range(args.n)]


def batches(src_ids, size, pad):
    for i in range(0, len(src_ids), size):
        chunk = src_ids[i: i + size]
        out = np.full((len(chunk), max(map(len, chunk))), pad, dtype=np.int64)
        for r, s in enumerate(chunk):
            out[r, : len(s)] = s
        yield out


def run(model, src_ids, args, use_cache):
    t0 = time.perf_counter()
    out = []
    for src in batches(src_ids, args.batch_size, model.cfg.pad_id):
        out += beam_search(model, src, args.beam, args.alpha, max_len_b=args.max_len_b, use_cache=use_cache)
    synchronize(model.xp)
    return time.perf_counter() - t0, out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--checkpoint")
    p.add_argument("--src", help="raw source sentences (with --checkpoint)")
    p.add_argument("--n", type=int, default=100, help="sentences")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    args = p.parse_args()
    model, src_ids = load(args)
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  machine {platform.processor() or platform.machine()}"
          f"  numpy {np.__version__}  device {args.device}")
    print(f"model d_model={model.cfg.d_model} layers={model.cfg.n_layers} V={model.cfg.vocab_size}; {len(src_ids)} sentences, "
          f"beam {args.beam}, alpha {args.alpha}, max length input+{args.max_len_b}, batch {args.batch_size}")
    times = {True: [], False: []}
    outs = {}
    for _ in range(args.rounds):
        for use_cache in (True, False):
            dt, outs[use_cache] = run(model, src_ids, args, use_cache)
            times[use_cache].append(dt)
    assert outs[True] == outs[False], "cached and uncached decoding disagree"
    mean_len = np.mean([len(o) for o in outs[True]])
    for use_cache in (True, False):
        med = statistics.median(times[use_cache])
        print(f"{'cached  ' if use_cache else 'uncached'}  median {med:7.2f} s  {len(src_ids) / med:7.1f} sentences/s  "
              f"(runs: {', '.join(f'{t:.2f}' for t in times[use_cache])})")
    print(f"mean output length {mean_len:.1f} tokens; speed-up cached/uncached: "
          f"{statistics.median(times[False]) / statistics.median(times[True]):.2f}x")


if __name__ == "__main__":
    main()
