#!/usr/bin/env python
"""The attention alone: the head layout (its weights' rows padded to whole 16-byte vectors, and S apart) against packed
rows (kernels.attention_rows, MINITF_FUSED_ATTN=1).

    python bench/attention_rows.py                     # base at the report's batch: float32 (TF32), --fp16, --bf16
    python bench/attention_rows.py --modes fp16 --rounds 21
    python bench/attention_rows.py --smoke             # tiny sizes (checks this script, e.g. under the CuPy stand-in)

A model of the preset in the mode's dtype on the GPU, and bench/data.py's `wmt_batch` (bench/gpu_report.py's
batch: at most 25,000 padded tokens a side of WMT14-shaped lengths) as packed rows of random values: the first
encoder layer's self-attention on the source rows, the first decoder layer's (causal) on the target rows and its
cross-attention, each called forward and backward (the gradients of its inputs and weights) with
MINITF_FUSED_ATTN=0 (the head layout: unpack, batched products, softmax, pack; its weights' rows padded to whole
16-byte vectors, and with MINITF_ATTN_PITCH=0 S apart, S the attention's key length: "rows S apart") and =1 (packed
rows: on tensor cores
in float16 and bfloat16, and in float32 where its products run on TF32 (CUPY_TF32=1, this script's default), where the
head's width is a multiple of 16, else on CUDA cores), and where tensor cores apply also with MINITF_FUSED_ATTN_MMA=0
(packed rows on CUDA cores), in alternating rounds of --calls calls, the device synchronised
before and after each round. Printed per mode and attention: the median ms of a forward and backward on each path,
the ratio of the head layout's to each other path's (above 1, that path is faster), and the largest difference, over
the other paths, between their input gradients and the head layout's, relative to the largest value.
"""
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minitf  # noqa: E402
from minitf import backend, kernels  # noqa: E402
from minitf.masks import causal_bias, padding_bias  # noqa: E402
from minitf.packing import make_rows  # noqa: E402
from bench.data import wmt_batch  # noqa: E402
from bench.env import Env  # noqa: E402
from bench.rounds import alternate  # noqa: E402
from bench.flags import parser  # noqa: E402

DTYPES = {"float32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# (name, what it is called in the output, its switches); "cuda" only where "rows" takes tensor cores (16 bits, TF32)
PATHS = (("heads", "head layout", {"MINITF_FUSED_ATTN": "0", "MINITF_ATTN_PITCH": "1"}),
         ("tight", "rows S apart", {"MINITF_FUSED_ATTN": "0", "MINITF_ATTN_PITCH": "0"}),
         ("rows", "packed rows", {"MINITF_FUSED_ATTN": "1", "MINITF_FUSED_ATTN_MMA": "1"}),
         ("cuda", "on CUDA cores", {"MINITF_FUSED_ATTN": "1", "MINITF_FUSED_ATTN_MMA": "0"}))


def attentions(model, src, tgt_in, seed=0):
    """{name: (layer, x_q, x_kv, bias, rows_q, rows_kv, dy)}: the three attentions of the model's first layers
    on the batch's packed rows (every position a row where a side has no padding), random inputs and output
    gradients in the model's dtype."""
    xp, dt, pad, d = model.xp, model.dtype, model.cfg.pad_id, model.cfg.d_model
    rows = {side: make_rows(ids != pad, xp, whole=True) for side, ids in (("src", src), ("tgt", tgt_in))}
    rng = np.random.default_rng(seed)

    def rand(side):
        return xp.asarray(rng.standard_normal((len(rows[side].host_index), d)).astype(np.float32)).astype(dt)
    xs, xt, dys, dyt = rand("src"), rand("tgt"), rand("src"), rand("tgt")
    src_bias = padding_bias(src, pad, dt, xp)
    tgt_bias = causal_bias(tgt_in.shape[1], xp, dt)[None, None] + padding_bias(tgt_in, pad, dt, xp)
    enc, dec = model.encoder.layer_list[0], model.decoder.layer_list[0]
    return {"encoder self": (enc.self_attn, xs, xs, src_bias, rows["src"], rows["src"], dys),
            "decoder self": (dec.self_attn, xt, xt, tgt_bias, rows["tgt"], rows["tgt"], dyt),
            "cross": (dec.cross_attn, xt, xs, src_bias, rows["tgt"], rows["src"], dyt)}


def call(layer, x_q, x_kv, bias, rows_q, rows_kv, dy):
    """One forward and backward of the attention; its input gradients (dx_q, dx_kv)."""
    layer.forward(x_q, x_kv, bias, rows_q, rows_kv, None)
    return layer.backward(dy)


def time_paths(args_of, paths, rounds, calls, warmup):
    """{path: [seconds a call, one per round]}, the paths alternating round by round (bench/rounds.py)."""
    xp = backend.xp_of(args_of[1])
    return alternate({name: (lambda env=env: Env(env), lambda: call(*args_of)) for name, _, env in paths},
                     rounds, calls, warmup, sync=lambda: backend.synchronize(xp))


def gradient_difference(args_of, paths):
    """The largest difference between another path's input gradients and the head layout's, relative to the
    largest value."""
    got = {}
    for name, _, env in paths:
        with Env(env):
            got[name] = [backend.to_numpy(g).astype(np.float64) for g in call(*args_of)]
    return max(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
               for name, _, _ in paths[1:] for a, b in zip(got[name], got["heads"]))


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--preset", default="base")
    p.add_argument("--modes", default="float32,fp16,bf16", help="comma-separated: float32 (TF32), fp16, bf16")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=5, help="forward and backward calls timed a round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    ok, why = backend.gpu_available()
    if not ok:
        sys.exit(f"attention_rows: no GPU: {why}")
    preset, vocab, tokens = ("tiny", 64, 256) if args.smoke else (args.preset, 37000, 25000)
    if args.smoke:
        args.rounds, args.calls, args.warmup = 2, 1, 1
    cfg = minitf.Config.preset(preset, vocab_size=vocab)
    src, tgt_in, _ = wmt_batch(cfg, tokens)
    print(f"{preset}: {src.shape[0]} sentences, {int((src != cfg.pad_id).sum())} source and "
          f"{int((tgt_in != cfg.pad_id).sum())} target rows, H={cfg.n_heads} K={cfg.d_k}")
    for mode in args.modes.split(","):
        model = minitf.Transformer(cfg, device="gpu", dtype=DTYPES[mode], seed=0)
        paths = [path for path in PATHS if path[0] != "cuda" or mode != "float32" or kernels.tf32()]
        for name, args_of in attentions(model, src, tgt_in).items():
            times = time_paths(args_of, paths, args.rounds, args.calls, args.warmup)
            ms = {path: statistics.median(ts) * 1e3 for path, ts in times.items()}
            line = f"  {mode:8s} {name:13s} head layout {ms['heads']:8.3f} ms"
            for path, label, _ in paths[1:]:
                line += f"  {label} {ms[path]:8.3f} ms x{ms['heads'] / ms[path]:.3f}"
            print(f"{line}  input gradients differ by {gradient_difference(args_of, paths):.2e}")


if __name__ == "__main__":
    main()
