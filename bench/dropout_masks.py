#!/usr/bin/env python
"""What position-keyed dropout masks cost on the CPU: the `small` preset's training step (one
fixed padded batch, its dropout or --dropout; the shape flags of bench/shape.py) with minitf's masks (a PCG64 stream per site over the padded
[B*L, D] rows, the packed rows kept: functional.dropout_bits) against one generator per forward
drawing only the packed rows (the cheapest NumPy draw, whose masks depend on the packing).

    python bench/dropout_masks.py --rounds 21
    python bench/dropout_masks.py --rounds 21 --d-model 256 --d-ff 1024 --layers 3 --dropout 0.05   # small of 2026-11-24

Rounds alternate in one process (2 steps each, the first 2 rounds dropped); medians and the ratio.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf import functional as F  # noqa: E402
from bench.shape import add_shape_flags, shape_overrides  # noqa: E402
from bench.train_step import make_batch  # noqa: E402
from bench.flags import parser  # noqa: E402


def packed_only(stream, xp, shape, rows=None):
    """One generator per forward, seeded once, drawing the (packed) shape of each site."""
    if not hasattr(stream, "generator"):
        stream.generator = np.random.default_rng([stream.seed, stream.forward_index])
    stream.next_site()
    return stream.generator.integers(0, 1 << 16, size=shape, dtype=np.uint16)


def main():
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--dropout", type=float, help="the dropout rate (default: the preset's)")
    add_shape_flags(p)
    args = p.parse_args()
    extra = shape_overrides(args) | ({} if args.dropout is None else {"dropout": args.dropout})
    cfg = minitf.Config.preset("small", vocab_size=8000, **extra)
    model = minitf.Transformer(cfg, seed=0)
    opt = minitf.Adam(model, lr=1e-4)
    batch = make_batch(cfg, 64, 24, 24)

    def step():
        model.zero_grad()
        model.forward_loss(*batch)
        model.backward()
        opt.step()
    times = {"position-keyed": [], "packed-only": []}
    real = F.dropout_bits
    try:
        for _ in range(args.rounds):
            for name, fn in (("position-keyed", real), ("packed-only", packed_only)):
                F.dropout_bits = fn
                t0 = time.perf_counter()
                step()
                step()
                times[name].append((time.perf_counter() - t0) / 2)
    finally:
        F.dropout_bits = real
    med = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
          + f"; ratio {med['position-keyed'] / med['packed-only']:.3f}")


if __name__ == "__main__":
    main()
