"""Decoding speed: sentences/s and tokens/s of batched greedy and beam search.

    # minitf against a PyTorch KV-cached beam search of the same algorithm (bench/torch_decode.py; a model
    # scoring the joint vocabulary: trained with --output-vocab joint)
    python bench/decode.py --vs-torch --checkpoint runs/m30k/averaged.npz \\
        --src $MULTI30K/test_2016_flickr.en.gz --beams 1 4
    # where minitf's step spends its time (one stream)
    python bench/decode.py --profile --checkpoint runs/m30k/averaged.npz --src ...
    # minitf with and without the KV cache
    python bench/decode.py --vs-uncached --checkpoint runs/m30k/averaged.npz --src ... --n 100

Every run decodes the way `python -m minitf translate` does (`translate_ids`): sentences
sorted by length, continuous batching of at most --batch-size at a time, max length input + 50,
alpha --alpha (default 0.6; translate uses the checkpoint preset's), in `translate_ids`'s streams
(up to one per core, at most 8, 16+ sentences each; --streams 1 for one search).
PyTorch runs one search on its own op threads; --torch-streams n gives it n searches side
by side with one op thread each (the same split).
Measure on a trained checkpoint and real sentences: random weights rarely emit EOS and so
time a different workload. Rounds alternate between the contenders in one process; medians
are reported with their ratio. The hypotheses are compared: greedy must match exactly, a
beam hypothesis may differ only where two candidates' scores tie to float32 rounding
(both are rescored in float64 to show it).
"""
import concurrent.futures
import cProfile
import datetime
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf.backend import synchronize  # noqa: E402
from minitf.data.batching import pad_ids  # noqa: E402
from minitf.decode import length_penalty  # noqa: E402
from minitf.translate import search_threads, translate_ids  # noqa: E402
from minitf.loss import log_softmax  # noqa: E402
from bench.flags import count, need_torch, parser, run  # noqa: E402
from bench.train_step import cpu_model  # noqa: E402
from minitf.flags import MAX_ALPHA, Number  # noqa: E402


def load(args):
    if args.checkpoint:
        from minitf.translate import load_for_inference
        model, tok = load_for_inference(args.checkpoint, args.device)
        if args.src:
            from minitf.data import read_lines
            lines = read_lines(args.src)
            ids = tok.encode(lines[: args.n] if args.n else lines)
            return model, [s + [tok.eos_id] for s in ids]
    else:
        cfg = minitf.Config.preset(args.preset, vocab_size=args.vocab)
        model = minitf.Transformer(cfg, device=args.device, seed=0).eval()
    print("note: random sources (no --checkpoint/--src): timings of a workload unlike real translation")
    rng = np.random.default_rng(0)   # random sources of Multi30k-like lengths (8..20 pieces)
    return model, [list(rng.integers(4, model.cfg.vocab_size, rng.integers(8, 21))) + [3] for _ in range(args.n or 100)]


def sorted_batches(src_ids, size, pad):
    """Fixed batches of the length-sorted sentences (the PyTorch baseline's batching, fairseq's)
    -> (indices, [B, S] array)."""
    order = np.argsort([len(s) for s in src_ids], kind="stable")
    for start in range(0, len(order), size):
        idx = order[start: start + size]
        yield idx, pad_ids([src_ids[i] for i in idx], pad)


def run_minitf(model, src_ids, beam, args, use_cache=True):
    """`translate`'s path: length-sorted, continuous batching of --batch-size sentences."""
    t0 = time.perf_counter()
    out = translate_ids(model, src_ids, beam, args.alpha, args.batch_size, args.max_len_b, use_cache=use_cache,
                        threads=args.streams)
    synchronize(model.xp)
    return time.perf_counter() - t0, out


def run_torch(tm, src_ids, beam, args):
    """Fixed length-sorted batches; with --torch-streams n, n Python threads side by side, each on
    every n-th sentence (torch runs each op on one thread then: set in vs_torch)."""
    import torch
    from bench import torch_decode
    t0 = time.perf_counter()
    out = [None] * len(src_ids)

    def stream(ids):
        for idx, src in sorted_batches([src_ids[i] for i in ids], args.batch_size, tm.cfg.pad_id):
            src = torch.from_numpy(src)
            res = (torch_decode.greedy_search(tm, src, max_len_b=args.max_len_b) if beam == 1 else
                   torch_decode.beam_search(tm, src, beam, args.alpha, max_len_b=args.max_len_b))
            for r, i in enumerate(idx):
                out[ids[i]] = res[r]

    order = np.argsort([len(s) for s in src_ids], kind="stable")
    parts = [order[i::args.torch_streams] for i in range(args.torch_streams)]
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        for f in [pool.submit(stream, part) for part in parts]:
            f.result()
    return time.perf_counter() - t0, out


def rescore(model64, src, hyp, alpha):
    """log p(hyp + EOS | src) / lp under a float64 copy of the model: the search's objective."""
    cfg = model64.cfg
    tgt = np.array([[cfg.bos_id] + hyp + [cfg.eos_id]])
    logp = log_softmax(model64.forward(np.array([src]), tgt[:, :-1]))[0]
    return float(logp[np.arange(len(hyp) + 1), tgt[0, 1:]].sum()) / length_penalty(len(hyp) + 1, alpha)


def compare(model, src_ids, a, b, beam, alpha):
    """How many hypotheses agree; for beam search, the largest float64 score gap of those that do not."""
    differ = [i for i in range(len(a)) if a[i] != b[i]]
    line = f"identical {len(a) - len(differ)}/{len(a)}"
    if differ and beam > 1:
        m64 = minitf.Transformer(model.cfg, dtype="float64", seed=0).eval()
        m64.load_state_dict(model.state_dict())
        gaps = [abs(rescore(m64, src_ids[i], a[i], alpha) - rescore(m64, src_ids[i], b[i], alpha)) for i in differ]
        line += f"; the {len(differ)} others tie: largest float64 score gap {max(gaps):.2e}"
    return line, differ


def header(model, src_ids, args):
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  machine {cpu_model()}"
          f" ({os.cpu_count()} cores)  numpy {np.__version__}  device {args.device}")
    cfg = model.cfg
    print(f"model D={cfg.d_model} H={cfg.n_heads} F={cfg.d_ff} layers={cfg.n_layers}+{cfg.n_decoder_layers} V={cfg.vocab_size}; {len(src_ids)} sentences "
          f"({args.src or 'random'}), alpha {args.alpha}, max length input+{args.max_len_b}, batch {args.batch_size}")


def report(name, times, n_sent, n_tok):
    med = statistics.median(times)
    print(f"  {name:9s} median {med:7.2f} s  {n_sent / med:7.1f} sentences/s  {n_tok / med:8.1f} tokens/s  "
          f"(runs: {', '.join(f'{t:.2f}' for t in times)})")
    return med


def vs_torch(model, src_ids, args):
    import torch
    from bench.torch_model import from_minitf_state
    tm = from_minitf_state(model.state_dict(), model.cfg, dtype="float32").eval()
    if args.torch_streams > 1:
        torch.set_num_threads(1)
    streams = args.streams or search_threads(model, len(src_ids))
    print(f"torch {torch.__version__}: {args.torch_streams} stream(s) of {torch.get_num_threads()} thread(s); "
          f"minitf: {streams} stream(s) (`translate_ids`'s streams), "
          f"{'1 BLAS thread each' if streams > 1 else 'BLAS on every core'}")
    failed = False
    for beam in args.beams:
        times = {"minitf": [], "torch": []}
        outs = {}
        for _ in range(args.rounds):
            for name in ("minitf", "torch"):
                dt, outs[name] = (run_minitf(model, src_ids, beam, args) if name == "minitf"
                                  else run_torch(tm, src_ids, beam, args))
                times[name].append(dt)
        n_tok = sum(len(h) + 1 for h in outs["minitf"])       # generated tokens, EOS included
        print(f"beam {beam}: mean output length {n_tok / len(src_ids) - 1:.1f} pieces + EOS")
        med = {name: report(name, times[name], len(src_ids), n_tok) for name in times}
        line, differ = compare(model, src_ids, outs["minitf"], outs["torch"], beam, args.alpha)
        print(f"  speed-up minitf/torch: {med['torch'] / med['minitf']:.2f}x; {line}")
        failed |= beam == 1 and bool(differ)
    if failed:
        sys.exit("greedy hypotheses differ between minitf and torch")


def vs_uncached(model, src_ids, args):
    for beam in args.beams:
        times = {True: [], False: []}
        outs = {}
        for _ in range(args.rounds):
            for use_cache in (True, False):
                dt, outs[use_cache] = run_minitf(model, src_ids, beam, args, use_cache)
                times[use_cache].append(dt)
        if outs[True] != outs[False]:
            sys.exit("cached and uncached decoding disagree")
        n_tok = sum(len(h) + 1 for h in outs[True])
        print(f"beam {beam}: mean output length {n_tok / len(src_ids) - 1:.1f} pieces + EOS; same hypotheses")
        med = {c: report("cached" if c else "uncached", times[c], len(src_ids), n_tok) for c in times}
        print(f"  speed-up cached/uncached: {med[False] / med[True]:.2f}x")


def profile(model, src_ids, args):
    args.streams = args.streams or 1   # cProfile sees only this thread: one stream unless asked
    for beam in args.beams:
        run_minitf(model, src_ids, beam, args)            # warm up
        prof = cProfile.Profile()
        prof.enable()
        dt, _ = run_minitf(model, src_ids, beam, args)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        print(f"beam {beam}: {dt:.2f} s under the profiler; functions by own time:")
        print("\n".join(out.getvalue().splitlines()[6:]))


def main():
    p = parser(__doc__)
    mode = p.add_mutually_exclusive_group(required=True)   # what to measure: one of the three
    mode.add_argument("--vs-torch", action="store_true", help="against bench/torch_decode.py (needs torch)")
    mode.add_argument("--vs-uncached", action="store_true", help="with and without the KV cache")
    mode.add_argument("--profile", action="store_true", help="cProfile one minitf run per beam size")
    p.add_argument("--preset", default="small", help="random weights of this preset without --checkpoint")
    p.add_argument("--vocab", type=count(5), default=8000, help="pieces of the random model without --checkpoint")
    p.add_argument("--checkpoint", help="a trained model (without it: random weights, which rarely end a sentence)")
    p.add_argument("--src", help="raw source sentences (with --checkpoint; without: random ids)")
    p.add_argument("--n", type=count(0), default=0, metavar="SENTENCES",
                   help="the first n sentences (0: all; random sources: 100)")
    p.add_argument("--beams", type=count(), nargs="+", default=[1, 4])
    p.add_argument("--alpha", type=Number(float, 0, MAX_ALPHA), default=0.6)
    p.add_argument("--max-len-b", type=count(0), default=50)
    p.add_argument("--batch-size", type=count(), default=64, help="sentences a batch (translate's default)")
    p.add_argument("--rounds", type=count(), default=3)
    p.add_argument("--streams", type=count(), default=None,
                   help="minitf's searches side by side (translate_ids; default: its default, one per core)")
    p.add_argument("--torch-streams", type=count(), default=1,
                   help="--vs-torch: PyTorch searches side by side, one op thread each (default 1: torch's own threads)")
    p.add_argument("--top", type=count(), default=25, help="--profile: functions shown")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    args = p.parse_args()
    if args.vs_torch:
        need_torch(p)
    if args.src and not args.checkpoint:   # its sentences would be timed on random ids, named as the file's
        p.error("--src is read with --checkpoint's tokenizer: give --checkpoint too (without both: random sources)")
    model, src_ids = load(args)
    if model.cfg.arch != "transformer" and (args.vs_torch or args.vs_uncached):
        p.error(f"--vs-torch and --vs-uncached time the Transformer's KV cache; {args.checkpoint} is --arch "
                f"{model.cfg.arch} (use --profile)")
    model.eval()
    header(model, src_ids, args)
    if args.vs_torch:
        vs_torch(model, src_ids, args)
    elif args.vs_uncached:
        vs_uncached(model, src_ids, args)
    else:
        profile(model, src_ids, args)


if __name__ == "__main__":
    run(main)
