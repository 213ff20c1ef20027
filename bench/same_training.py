#!/usr/bin/env python
"""The same training on three engines: --updates updates from the same initial weights on the same
batches of real sentences, then each one's loss on a validation set.

    python bench/same_training.py --train-src train.en --train-tgt train.de \\
        --valid-src val.en.gz --valid-tgt val.de.gz --tokenizer tok.model --updates 400 --also-seed 1 --fp16 --out runs/same

Runners, one after another, each from the weights of `minitf.Transformer(cfg, seed=0)`:

  now      the GPU step as it is
  before   the same with every GPU fusion switched off (MINITF_CUBLAS=0, MINITF_FUSED_*=0: CuPy's
           matmul and separate passes), bench/gpu_ab.py's `before` variant
  torch    PyTorch eager (bench/torch_model.py), under AMP with a GradScaler when --fp16, AMP bfloat16
           without one when --bf16

All three see the same batches in the same order (token_batches over the training pairs, seed 0),
the same learning rate (the preset's schedule, paper eq. 3: with `base` a 400-update run stays
inside the 4,000 warmup updates), label smoothing and dropout (each engine draws its own masks),
dynamic loss scaling from 2^15 (growth every 1,000 good updates), and skip the update when a
float16 gradient overflowed. --also-seed s adds the first variant with dropout seed s: how far
two runs of one engine differ by chance, the yardstick for the others. --seeds COUNT runs every
runner with dropout seeds 0 .. COUNT-1 (PyTorch's from torch.manual_seed), all runners of one seed
before the next, and ends with each engine's mean validation NLL over its seeds, its spread and
the means' relative differences: an engine's gap to another judged against its own spread. A short warmup is a poor
test: at --warmup 400 (rate factor 0.35) `base` went unstable after the peak, and two dropout
seeds of one engine ended 11% apart in validation NLL (docs/benchmarks.md). --grad-float16 SCALE (float32)
stores minitf's gradients as a float16 buffer at loss scale SCALE would before each update: float16 gradient
storage alone, apart from float16 arithmetic (on the CPU too); --norm-float16 (float32) rounds every LayerNorm's
output to float16: the post-norm residual stream as --fp16 stores it and PyTorch AMP does not.

For each runner it prints the updates made and skipped, ms per update (with one device->host
read a step), the mean training loss of the last 50 updates, the validation NLL per target token
(eval mode, the engine's own precision) and its relative difference to that of the first runner that finished, and
peak GPU memory (CuPy's pool / torch.cuda.max_memory_reserved); --out adds each runner's loss
curve (means of 50 updates). --device cpu runs the CPU path (then `now` and `before` are the
same code: a check of this script). A runner that fails (a first run of new kernels, say) is printed as FAILED
with its error (and listed under "failed" in --out's JSON), and the others still run, unless the error left the
CUDA context unusable (an illegal address does). The relative differences are to the first runner that finished.
"""
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minitf  # noqa: E402
from minitf import backend, kernels  # noqa: E402
from minitf.data import Tokenizer, collate, read_parallel, token_batches  # noqa: E402
from minitf.optim import LossScaler  # noqa: E402
from minitf.schedule import noam  # noqa: E402
from minitf.train import compute_dtype, step_stats  # noqa: E402
from minitf.validation import evaluate_loss  # noqa: E402
from bench.gpu_ab import DEFAULT_VARIANTS, VariantEnv, check_kernel_files, parse_variant  # noqa: E402
from bench.shape import add_shape_flags, shape_overrides  # noqa: E402
from bench.flags import count, parser  # noqa: E402
from minitf.flags import Number  # noqa: E402


def log(msg):
    print(f"[same_training {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- data
def batches_of(tok, src_lines, tgt_lines, max_tokens, count=None, shuffle=True):
    """Host batches (src, tgt_in, tgt_out, n_target_tokens) of token_batches(seed 0) over the
    pairs, epoch after epoch until `count` (all of one epoch when count is None)."""
    threads = os.cpu_count() or 1
    src_ids, tgt_ids = tok.encode(src_lines, num_threads=threads), tok.encode(tgt_lines, num_threads=threads)
    src_lens = np.array([len(s) for s in src_ids], np.int64)
    tgt_lens = np.array([len(t) for t in tgt_ids], np.int64)
    out, epoch = [], 0
    while True:
        for idx in token_batches(src_lens, tgt_lens, max_tokens, seed=0, epoch=epoch, shuffle=shuffle):
            src, tgt_in, tgt_out = collate([src_ids[i] for i in idx], [tgt_ids[i] for i in idx],
                                           tok.pad_id, tok.bos_id, tok.eos_id)
            out.append((src, tgt_in, tgt_out, int((tgt_out != tok.pad_id).sum())))
            if count is not None and len(out) == count:
                return out
        if count is None:
            return out
        epoch += 1


# ----------------------------------------------------------------------------- the runners
def learning_rate(cfg, args, step):
    return noam(step, cfg.d_model, args.warmup, args.lr_factor)


def pool_peak_mib(xp):
    """The bytes CuPy's pool holds after a run (it keeps what it allocated: the run's peak,
    give or take fragmentation); None on the CPU."""
    if not backend.is_gpu(xp):
        return None
    return round(backend.cupy.get_default_memory_pool().total_bytes() / 2 ** 20, 1)


def free_pool(xp):
    if backend.is_gpu(xp):
        backend.cupy.get_default_memory_pool().free_all_blocks()


def float16_stored(grads, scale):
    """grads (float32, in place) as a float16 buffer at loss scale `scale` would hold them: times the scale, rounded to
    float16 (to 0 below its smallest subnormal, to infinity above 65,504), divided again."""
    with np.errstate(over="ignore"):    # a value past float16's range becomes infinite, as a float16 buffer holds it
        grads[...] = (grads * scale).astype(np.float16).astype(grads.dtype) / scale
    return grads


def norms_in_float16(model):
    """Every LayerNorm of `model` rounds its output to float16 (kept in the model's float32): the post-norm blocks'
    residual stream as float16 storage holds it (minitf --fp16 stores it so; PyTorch AMP keeps it in float32)."""
    from minitf.layers.layernorm import LayerNorm

    def rounded(y):
        y[...] = y.astype(np.float16).astype(y.dtype)
        return y
    for layer in model.layers():
        if isinstance(layer, LayerNorm):
            f, r = layer.forward, layer.forward_residual
            layer.forward = lambda x, f=f: rounded(f(x))
            layer.forward_residual = lambda *a, r=r, **k: rounded(r(*a, **k))
    return model


def train_minitf(name, env, cfg, args, train, valid, dropout_seed=0):
    """The updates of `train` (one a batch) of minitf under the variant's environment; returns the runner's record."""
    with VariantEnv(env):
        model = minitf.Transformer(cfg, device=args.device, dtype=compute_dtype(args), seed=0)
        model.seed = dropout_seed    # the dropout masks' seed (the weights above are seed 0's)
        if args.norm_float16:
            norms_in_float16(model)
        xp = model.xp
        model.train()
        opt = minitf.Adam(model, lr=lambda step: learning_rate(cfg, args, step))
        scaler = LossScaler(init_scale=2.0 ** 15, growth_interval=1000) if args.fp16 else None
        losses, skipped = [], 0
        backend.synchronize(xp)
        t0 = time.perf_counter()
        for i, (src, tgt_in, tgt_out, n) in enumerate(train):
            model.forward_count = i      # dropout masks: (seed, batch index), as train.py draws them
            model.zero_grad()
            loss = model.forward_backward(src, tgt_in, tgt_out, loss_weight=scaler.scale if scaler else 1.0)
            loss_value, _, finite = step_stats(model, loss, 0.0)
            if scaler is not None:
                scaler.update(finite)
            if not finite:
                skipped += 1
                continue
            if args.grad_float16:
                float16_stored(model.flat_grads, args.grad_float16)
            opt.step(grad_divisor=scaler.scale if scaler else 1.0)
            losses.append(loss_value)
        backend.synchronize(xp)
        seconds = time.perf_counter() - t0
        _, nll = evaluate_loss(model, valid)
        record = result(name, losses, skipped, seconds, len(train), nll, pool_peak_mib(xp))
        del model, opt
        free_pool(xp)
        return record


def initial_state(cfg, args):
    """The seed-0 weights every runner starts from, on the host."""
    model = minitf.Transformer(cfg, device="cpu", dtype="float32", seed=0)
    return {n: np.array(a, copy=True) for n, a in model.state_dict().items()}


def train_torch(cfg, args, train, valid, state, dropout_seed=0, name="torch"):
    """The same updates in PyTorch eager from the same weights (AMP + GradScaler with --fp16); its dropout
    masks from torch.manual_seed(dropout_seed)."""
    import torch
    from bench.torch_model import as_ids, from_minitf_state
    dev = "cuda" if args.device == "gpu" else "cpu"
    torch.manual_seed(dropout_seed)      # the CPU's and every GPU's generator
    torch.backends.cuda.matmul.allow_tf32 = kernels.tf32()   # minitf's matmul mode
    amp = args.fp16 and dev == "cuda"     # float16 autocast with its GradScaler; bfloat16 autocast needs none
    half = "float16" if amp else "bfloat16" if args.bf16 and dev == "cuda" else False
    model = from_minitf_state(state, cfg, dtype="float32", device=dev, autocast_fp16=half)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    scaler = torch.amp.GradScaler(dev, enabled=amp, init_scale=2.0 ** 15, growth_interval=1000)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    losses, skipped, made = [], 0, 0
    t0 = time.perf_counter()
    for src, tgt_in, tgt_out, n in train:
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, args, made + 1)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(as_ids(src, dev), as_ids(tgt_in, dev), as_ids(tgt_out, dev))
        scaler.scale(loss).backward()
        before = scaler.get_scale() if amp else None
        scaler.step(opt)
        scaler.update()
        if amp and scaler.get_scale() < before:   # GradScaler skipped the step (inf/NaN gradients)
            skipped += 1
            continue
        made += 1
        losses.append(float(loss.detach()))
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    nll = torch_valid_nll(torch, model, valid, dev, as_ids)
    peak = round(torch.cuda.max_memory_reserved() / 2 ** 20, 1) if dev == "cuda" else None
    return result(name, losses, skipped, seconds, len(train), nll, peak)


def torch_valid_nll(torch, model, valid, dev, as_ids):
    """NLL per target token over the validation batches, in eval mode."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for src, tgt_in, tgt_out, n in valid:
            logits = model.forward(as_ids(src, dev), as_ids(tgt_in, dev)).float()
            gold = as_ids(tgt_out, dev)
            nll = -torch.log_softmax(logits, dim=-1).gather(-1, gold[..., None])[..., 0]
            total += float((nll * (gold != model.cfg.pad_id)).sum())
            count += n
    model.train()
    return total / count


def result(name, losses, skipped, seconds, updates, nll, peak_mib):
    tail = losses[-50:]
    curve = [round(float(np.mean(losses[i:i + 50])), 4) for i in range(0, len(losses), 50)]
    return {"curve_mean_per_50": curve, "runner": name, "updates": len(losses), "skipped": skipped, "ms_per_update": 1000 * seconds / updates,
            "train_loss_last50": float(np.mean(tail)) if tail else None, "first_loss": losses[0] if losses else None,
            "valid_nll": float(nll), "peak_mib": peak_mib}


def seeded(name, seed):
    """A runner's name: the engine's (a variant's, or "torch"), with "@seed<s>" for dropout seeds but 0."""
    return f"{name}@seed{seed}" if seed else name


def by_engine(records):
    """Each engine's runs over its dropout seeds (runners named engine or engine@seed<s>), in the order they first
    finished: seeds, the mean, least and largest validation NLL, and the mean's relative difference to the first
    engine's mean."""
    groups = {}
    for r in records:
        groups.setdefault(r["runner"].split("@")[0], []).append(r["valid_nll"])
    out = [{"engine": e, "seeds": len(v), "valid_nll_mean": float(np.mean(v)), "valid_nll_min": min(v),
            "valid_nll_max": max(v)} for e, v in groups.items()]
    for e in out:
        e["mean_rel_diff"] = (e["valid_nll_mean"] - out[0]["valid_nll_mean"]) / out[0]["valid_nll_mean"]
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--train-src", required=True)
    p.add_argument("--train-tgt", required=True)
    p.add_argument("--valid-src", required=True)
    p.add_argument("--valid-tgt", required=True)
    p.add_argument("--tokenizer", required=True, help="a SentencePiece model with minitf's special ids")
    p.add_argument("--pairs", type=count(), default=400_000, help="read at most this many training pairs")
    p.add_argument("--valid-pairs", type=count(), default=1000)
    p.add_argument("--preset", default="base")
    add_shape_flags(p)
    p.add_argument("--updates", type=count(), default=300)
    p.add_argument("--max-tokens", type=count(), default=25000, help="padded tokens a side per batch")
    p.add_argument("--warmup", type=count(), default=None, help="warmup updates (default: the preset's)")
    p.add_argument("--lr-factor", type=Number(float, above=0), default=None,
                   help="the schedule's factor (default: the preset's)")
    p.add_argument("--device", default="gpu", choices=["cpu", "gpu"])
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true", help="minitf --bf16 against PyTorch AMP bfloat16 (no loss scaling)")
    p.add_argument("--variant", action="append", help="as bench/gpu_ab.py's, KERNELS=FILE too (default: now, before)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--also-seed", type=int, action="append", default=[], metavar="SEED",
                   help="also the first variant with dropout seed SEED: how far runs of one engine differ by chance")
    p.add_argument("--seeds", type=count(), default=1, metavar="COUNT",
                   help="every runner (each variant and PyTorch) with dropout seeds 0 .. COUNT-1, seed by seed; the "
                        "summary gives each engine's mean validation NLL and its spread")
    p.add_argument("--grad-float16", type=float, metavar="SCALE",
                   help="minitf in float32 with its gradients stored as a float16 buffer at loss scale SCALE would "
                        "store them (scaled, rounded to float16, divided again) before each update: what float16 "
                        "gradient storage alone does, apart from float16 arithmetic")
    p.add_argument("--norm-float16", action="store_true",
                   help="minitf in float32 with every LayerNorm's output rounded to float16: the post-norm residual "
                        "stream as minitf --fp16 stores it (PyTorch AMP keeps it in float32), apart from the rest of "
                        "float16 arithmetic")
    p.add_argument("--out", help="a folder for same_training.json (made where missing)")
    args = p.parse_args(argv)
    if args.fp16 and args.bf16:
        p.error("--fp16 and --bf16 each choose the 16-bit dtype: give one")
    if args.grad_float16 is not None and (args.fp16 or args.bf16 or not args.grad_float16 > 0):
        p.error("--grad-float16 takes a positive loss scale and float32 (no --fp16 or --bf16): it stores float32 "
                "gradients as float16 would")
    if args.norm_float16 and (args.fp16 or args.bf16):
        p.error("--norm-float16 is for float32 (no --fp16 or --bf16): it rounds a float32 model's LayerNorm outputs")
    variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    check_kernel_files(variants)
    tok = Tokenizer(args.tokenizer)
    log(f"reading and encoding {args.train_src} / {args.train_tgt} (at most {args.pairs:,} pairs)")
    src_lines, tgt_lines = read_parallel(args.train_src, args.train_tgt)
    train = batches_of(tok, src_lines[:args.pairs], tgt_lines[:args.pairs], args.max_tokens, count=args.updates)
    vs, vt = read_parallel(args.valid_src, args.valid_tgt)
    valid = batches_of(tok, vs[:args.valid_pairs], vt[:args.valid_pairs], args.max_tokens, shuffle=False)
    cfg = minitf.Config.preset(args.preset, vocab_size=tok.vocab_size, **shape_overrides(args))
    args.warmup = args.warmup or cfg.warmup
    args.lr_factor = cfg.lr_factor if args.lr_factor is None else args.lr_factor
    tokens = sum(b[3] for b in train)
    log(f"{args.preset}, vocabulary {tok.vocab_size:,}, {len(train)} batches ({tokens / len(train):,.0f} target "
        f"tokens each), validation {sum(b[3] for b in valid):,} target tokens")
    records = []
    trainers = []
    for seed in range(args.seeds):
        runs = [(seeded(name, seed), env, seed) for name, env in variants]
        if seed == 0:
            runs[1:1] = [(seeded(variants[0][0], s), variants[0][1], s) for s in args.also_seed]
        trainers += [(name, lambda name=name, env=env, seed=seed: train_minitf(name, env, cfg, args, train, valid, seed))
                     for name, env, seed in runs]
        if not args.no_torch:
            trainers.append((seeded("torch", seed), lambda seed=seed: train_torch(
                cfg, args, train, valid, initial_state(cfg, args), seed, seeded("torch", seed))))
    failed = []
    for name, trainer in trainers:
        log(f"{name}: {args.updates} updates")
        try:
            records.append(trainer())
        except Exception as e:   # one runner's failure (a first run of new kernels, say) does not end the others
            failed.append({"runner": name, "error": f"{type(e).__name__}: {e}"})
            log(f"{name}: FAILED: {failed[-1]['error']}")
            continue
        log(json.dumps(records[-1]))
    first = records[0]["valid_nll"] if records else float("nan")
    for r in records:
        r["valid_nll_rel_diff"] = (r["valid_nll"] - first) / first
    engines = by_engine(records)
    info = {"preset": args.preset, "fp16": args.fp16, "bf16": args.bf16, "grad_float16": args.grad_float16,
            "norm_float16": args.norm_float16, "device": args.device, "updates": args.updates,
            "warmup": args.warmup, "lr_factor": args.lr_factor, "target_tokens_per_batch": tokens / len(train),
            "vocab": tok.vocab_size, "shape": shape_overrides(args), "runners": records, "engines": engines,
            "failed": failed}
    w = max([11] + [len(r["runner"]) for r in records + failed])   # the names' column: the longest name
    print(f"{'runner':{w}} {'made':>5} {'skipped':>7} {'ms/upd':>7} {'train loss':>10} {'valid nll':>9} "
          f"{'vs first':>8} {'peak MiB':>8}")
    for r in records:
        print(f"{r['runner']:{w}} {r['updates']:5d} {r['skipped']:7d} {r['ms_per_update']:7.1f} "
              f"{r['train_loss_last50'] or float('nan'):10.4f} {r['valid_nll']:9.4f} {100 * r['valid_nll_rel_diff']:+7.2f}% "
              f"{r['peak_mib'] if r['peak_mib'] is not None else '-':>8}")
    for f in failed:
        print(f"{f['runner']:{w}} FAILED: {f['error']}")
    if any(e["seeds"] > 1 for e in engines):
        print(f"\n{'engine':{w}} {'seeds':>5} {'valid nll: mean (min-max)':>26} {'mean vs first':>13}")
        for e in engines:
            print(f"{e['engine']:{w}} {e['seeds']:5d} {e['valid_nll_mean']:9.4f} ({e['valid_nll_min']:.4f}-"
                  f"{e['valid_nll_max']:.4f}) {100 * e['mean_rel_diff']:+12.2f}%")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "same_training.json").write_text(json.dumps(info, indent=1))
    return info


if __name__ == "__main__":
    main()
