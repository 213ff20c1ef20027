"""The paper's Table 1, measured on minitf's own layers: self-attention, recurrent, convolutional.

    # time of one layer's forward + backward against n (width d fixed) and against d (n fixed),
    # and the sequential steps each layer takes
    python bench/table1.py --out docs/img/table1.json
    # plus the maximum path length made visible on two trained models: the gradient norm of the
    # encoder output at position n with respect to the input at position 1, against n
    python bench/table1.py --out docs/img/table1.json --rnn runs/m30k_rnn/averaged.npz \\
        --transformer runs/m30k/averaged.npz --sentences $MULTI30K/val.en.gz
    python -m minitf plot table1 --results docs/img/table1.json --out docs/img/table1.png

Layers (float32, a batch of --batch sequences, width d in and out):
  self-attention   the attention itself, softmax(q k^T / sqrt(d)) v over all n positions
                   (functional.attention_forward/backward): Table 1's O(n^2 d), one step
  self-attention+  the same with its q, k, v, o projections (layers.MultiHeadAttention, 1 head):
                   + O(n d^2)
  recurrent        layers.LSTM(d, d): O(n d^2) (8 d x d products per position: 4 gates x input and
                   state) in n sequential steps
  convolutional    layers.Conv1d(d, d, k): O(k n d^2), one step
Each timing is the median of --rounds, the layers alternating within each round. The steps
column counts the layer's dependent steps in one forward: the LSTM's cell calls (counted by
wrapping layers.recurrent.cell_forward), 1 for the others (one matmul chain over all positions).
"""
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minitf import functional as F  # noqa: E402
from minitf.layers import LSTM, Conv1d, MultiHeadAttention  # noqa: E402
from minitf.layers import recurrent  # noqa: E402
from bench.flags import count, output_path, parser, run  # noqa: E402
from bench.train_step import cpu_model  # noqa: E402

LAYERS = ("self-attention", "self-attention+", "recurrent", "convolutional")


def make_layers(d, k, rng):
    """name -> (run(x): one forward + backward, steps(x): dependent steps of one forward)."""
    lstm, conv, mha = LSTM(d, d, rng), Conv1d(d, d, k, rng), MultiHeadAttention(d, 1, d, rng)
    for layer in (lstm, conv, mha):
        for key, p in layer.params.items():
            layer.params[key] = p.astype(np.float32)
    scale = 1.0 / np.sqrt(d)

    def attention(x):
        out, p = F.attention_forward(x, x, x, 0.0, scale)
        F.attention_backward(np.ones_like(out), x, x, x, p, scale)

    def attention_layer(x):
        mha.forward(x, x, 0.0)
        mha.backward(np.ones_like(x))

    def rnn(x):
        out, _ = lstm.forward(x)
        lstm.backward(np.ones_like(out))

    def cnn(x):
        conv.backward(np.ones_like(conv.forward(x)))

    def lstm_steps(x):
        calls = []
        original = recurrent.cell_forward

        def counted(*args):
            calls.append(1)
            return original(*args)
        recurrent.cell_forward = counted
        try:
            lstm.forward(x)
        finally:
            recurrent.cell_forward = original
        return len(calls)

    one = lambda x: 1   # noqa: E731  (no loop over positions: one chain of matmuls)
    return {"self-attention": (attention, one), "self-attention+": (attention_layer, one),
            "recurrent": (rnn, lstm_steps), "convolutional": (cnn, one)}


def time_layers(n, d, k, batch, rounds, rng):
    x = rng.standard_normal((batch, n, d)).astype(np.float32)
    layers = make_layers(d, k, rng)
    times = {name: [] for name in LAYERS}
    for name in LAYERS:      # warm-up
        layers[name][0](x)
    for _ in range(rounds):
        for name in LAYERS:
            t0 = time.perf_counter()
            layers[name][0](x)
            times[name].append(time.perf_counter() - t0)
    return ({name: statistics.median(v) for name, v in times.items()},
            {name: layers[name][1](x) for name in LAYERS})


def sweep(points, fixed, vary, k, batch, rounds, rng, log):
    rows = []
    for v in points:
        n, d = (v, fixed) if vary == "n" else (fixed, v)
        med, steps = time_layers(n, d, k, batch, rounds, rng)
        rows.append({"n": n, "d": d, "seconds": med, "steps": steps})
        log(f"n={n:5d} d={d:5d}  " + "  ".join(f"{name} {1e3 * med[name]:9.2f} ms" for name in LAYERS)
            + f"  | steps rnn {steps['recurrent']}")
    return rows


# ------------------------------------------------------------------ path length on trained models
def token_stream(path, tokenizer, limit=4000):
    from minitf.data.readers import read_lines
    ids = []
    for line in read_lines(path)[:limit]:
        ids += tokenizer.encode([line])[0]
    return np.array(ids)


def path_gradients(checkpoint, sentences, lengths, samples, rng):
    """{'arch', 'checkpoint', 'n': the lengths, 'grad_norm': per length the mean over samples of
    || d output[n-1] / d input[0] ||}, the encoder of a trained model,
    eval mode; output[n-1] is projected on a random unit vector, input = the encoder's input
    (embedding + positions for the Transformer, embedding for the RNN)."""
    from minitf.checkpoint import load_checkpoint
    from minitf.data.tokenizer import Tokenizer
    ckpt = load_checkpoint(checkpoint)
    model = ckpt.build_model(dtype="float64")
    stream = token_stream(sentences, Tokenizer.from_bytes(ckpt.tokenizer))
    out = {}
    for n in lengths:
        norms = []
        for _ in range(samples):
            start = int(rng.integers(0, len(stream) - n))
            src = stream[None, start: start + n]
            memory = model.encode(src)[0]
            d_out = np.zeros_like(memory)
            u = rng.standard_normal(memory.shape[-1])
            d_out[0, n - 1] = u / np.linalg.norm(u)
            if ckpt.config.arch == "rnn":
                dx = d_out
                for layer in reversed(model.encoder):
                    dx = layer.backward(dx)
            else:
                dx = model.encoder.backward(d_out)
            norms.append(float(np.linalg.norm(dx[0, 0])))
        out[n] = statistics.mean(norms)
    return {"arch": ckpt.config.arch, "checkpoint": str(checkpoint), "n": list(out), "grad_norm": list(out.values())}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--n", type=count(), nargs="+", default=[16, 32, 64, 128, 256, 512, 1024], metavar="LENGTH",
                   help="lengths at --d")
    p.add_argument("--d", type=count(), default=256, metavar="WIDTH", help="width for the sweep over n")
    p.add_argument("--widths", type=count(), nargs="+", default=[32, 64, 128, 256, 512, 1024], help="widths at --n-fixed")
    p.add_argument("--n-fixed", type=count(), default=128, help="length for the sweep over d")
    p.add_argument("--k", type=count(), default=3, metavar="WIDTH", help="kernel width of the convolution")
    p.add_argument("--batch", type=count(), default=8)
    p.add_argument("--rounds", type=count(), default=5)
    p.add_argument("--rnn", help="a trained --arch rnn checkpoint (path-length part)")
    p.add_argument("--transformer", help="a trained Transformer checkpoint (path-length part)")
    p.add_argument("--sentences", help="source sentences (plain or .gz) the path-length part encodes")
    p.add_argument("--lengths", type=count(2), nargs="+", default=[2, 4, 8, 12, 16, 24, 32, 48, 64, 96])
    p.add_argument("--samples", type=count(), default=16)
    p.add_argument("--out", help="write the results as JSON (for `python -m minitf plot table1`)")
    args = p.parse_args(argv)
    output_path(p, args.out, "--out")
    if (args.rnn or args.transformer) and not args.sentences:
        p.error("--rnn/--transformer need --sentences (the text to encode)")
    for path in filter(None, [args.rnn, args.transformer, args.sentences]):
        if not os.path.isfile(path):
            p.error(f"{path} does not exist")
    rng = np.random.default_rng(0)
    machine = f"{cpu_model()}, {os.cpu_count()} cores, numpy {np.__version__}"
    print(f"date {datetime.date.today()}  machine {machine}  batch {args.batch}  rounds {args.rounds}  k {args.k}")
    results = {"date": str(datetime.date.today()), "machine": machine, "batch": args.batch, "k": args.k,
               "rounds": args.rounds, "by_n": sweep(args.n, args.d, "n", args.k, args.batch, args.rounds, rng, print),
               "by_d": sweep(args.widths, args.n_fixed, "d", args.k, args.batch, args.rounds, rng, print)}
    results["path"] = []
    for ckpt in filter(None, [args.rnn, args.transformer]):
        res = path_gradients(ckpt, args.sentences, args.lengths, args.samples, rng)
        print(f"{res['arch']}: |d out[n] / d in[1]| " + "  ".join(f"n={n} {g:.2e}" for n, g in zip(res["n"], res["grad_norm"])))
        results["path"].append(res)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    run(main)
