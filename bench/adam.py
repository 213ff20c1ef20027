"""One Adam update on the CPU: cache-sized blocks (minitf.optim._BLOCK, the default) against one
pass over the whole flat buffer, rounds alternating in the same process.

    python bench/adam.py --preset small --rounds 5

BLAS plays no part (elementwise NumPy); the update runs in one thread, as in each MPI rank's
share of a 2-core machine (the multi-core split of optim._chunks is turned off here).
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf import optim  # noqa: E402
from bench.shape import add_shape_flags, shape_overrides  # noqa: E402
from bench.flags import parser  # noqa: E402


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--preset", default="small", choices=sorted(minitf.PRESETS))
    add_shape_flags(ap)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps-per-round", type=int, default=5)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1:
        ap.error("--rounds and --steps-per-round must be positive")
    cfg = minitf.Config.preset(args.preset, vocab_size=args.vocab, **shape_overrides(args))
    model = minitf.Transformer(cfg, seed=0)
    model.flat_grads[...] = np.random.default_rng(0).standard_normal(model.flat_grads.size) * 1e-3
    opt = minitf.Adam(model, lr=1e-4)
    optim._chunks = lambda xp, n, min_chunk=None: [slice(0, n)]   # one thread
    default = optim._BLOCK
    times = {"one pass": [], f"blocks of {default}": []}
    for _ in range(args.rounds):
        for name, block in (("one pass", 1 << 62), (f"blocks of {default}", default)):
            optim._BLOCK = block
            t0 = time.perf_counter()
            for _ in range(args.steps_per_round):
                opt.step()
            times[name].append((time.perf_counter() - t0) / args.steps_per_round * 1000)
    print(f"Adam update, preset {args.preset}: {model.num_parameters():,} parameters, one thread, "
          f"{args.rounds} alternating rounds of {args.steps_per_round} updates")
    for name, ts in times.items():
        print(f"  {name:>16}: median {statistics.median(ts):6.1f} ms  ({', '.join(f'{t:.1f}' for t in ts)})")


if __name__ == "__main__":
    main()
