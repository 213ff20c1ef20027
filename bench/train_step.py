"""Training-step throughput of minitf (optionally against the same model in eager PyTorch).

    python bench/train_step.py --preset small --device cpu --vs-torch
    python bench/train_step.py --preset base --device cpu --vs-torch --batch-sentences 32

One fixed random batch WITH padding (lengths uniform in [len/2, len]); a step is
zero_grad + forward_backward (the loss's forward and backward as training takes them) + Adam step. Reported: median target (non-pad) tokens/s
over --rounds timed rounds (after --warmup-rounds), minitf and torch rounds ALTERNATING in
the same run; model FLOP utilisation against the device's measured float32 matmul peak;
peak memory. PyTorch is only needed for --vs-torch.

Model FLOPs per step, counted analytically on the REAL (non-pad) tokens only, so work spent on
padding lowers the utilisation: every matmul parameter used once per token costs 2 FLOPs
forward and 4 backward, so 6 * (matmul params touched per token) * tokens; attention adds
q k^T and p v, each 2 * H*d_k * l_q * l_k forward per sentence (l_q, l_k its query and key lengths), x3 for forward + backward.
Biases, LayerNorm, softmax, embedding lookups and Adam are not counted. The same count on
the padded shapes is in the JSON (`flops_per_step.padded`).
"""
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

if "--tf32" in sys.argv[1:]:
    os.environ["CUPY_TF32"] = "1"   # read at the first float32 product (CuPy's, minitf's): set before any
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minitf  # noqa: E402
from minitf import backend, kernels  # noqa: E402
from minitf.backend import get_xp, synchronize, to_numpy  # noqa: E402
from minitf.config import id_ranges  # noqa: E402
from minitf.errors import ConfigError  # noqa: E402
from bench.flags import count, need_torch, output_path, parser, run  # noqa: E402
from bench.shape import add_shape_flags, shape_overrides  # noqa: E402


# ----------------------------------------------------------------------------- batch and FLOPs
def make_batch(cfg, b, s, t, seed=0, full_length=False):
    """src [b, s], tgt_in / tgt_out [b, t] with trailing padding; each sentence's length is
    uniform in [len/2, len] (or exactly len with full_length: no padding at all). Source: tokens + EOS; target y = tokens + EOS, fed as
    tgt_in = BOS + y[:-1] and predicted as tgt_out = y. Target tokens come from the output vocabulary
    when the config has one (its ids 1..V_o: --output-pieces)."""
    rng = np.random.default_rng(seed)
    first = 4 if cfg.vocab_size > 4 else 1  # skip pad/unk/bos/eos ids
    out_v = output_size(cfg)
    src = np.full((b, s), cfg.pad_id, dtype=np.int64)
    tgt_in, tgt_out = np.full((b, t), cfg.pad_id, dtype=np.int64), np.full((b, t), cfg.pad_id, dtype=np.int64)
    for i in range(b):
        ls, lt = rng.integers(max(s // 2, 1), s + 1), rng.integers(max(t // 2, 1), t + 1)
        if full_length:
            ls, lt = s, t
        src[i, :ls] = rng.integers(first, cfg.vocab_size, ls)
        src[i, ls - 1] = cfg.eos_id
        y = np.append(rng.integers(first, out_v + 1 if cfg.output_vocab else cfg.vocab_size, lt - 1), cfg.eos_id)
        tgt_in[i, :lt] = np.append(cfg.bos_id, y[:-1])
        tgt_out[i, :lt] = y
    return src, tgt_in, tgt_out


def output_size(cfg):
    """The pieces the output layer scores: V_o of an output vocabulary, else V."""
    return cfg.vocab_size if cfg.output_vocab is None else int(cfg.output_ids().size)


def step_flops(cfg, src_lens, tgt_lens):
    """(total, dense, attention) FLOPs of one training step over sentences of the given
    source and target lengths (tokens per sentence)."""
    d, f, v, hk = cfg.d_model, cfg.d_ff, output_size(cfg), cfg.n_heads * cfg.d_k
    n, nd = cfg.n_layers, cfg.n_decoder_layers
    s, t = np.asarray(src_lens, dtype=np.float64), np.asarray(tgt_lens, dtype=np.float64)
    enc_per_src_tok = n * (4 * d * hk + 2 * d * f)                       # q k v out, fc1 fc2
    cross_kv_per_src_tok = nd * 2 * d * hk                              # decoder cross-attn k, v on memory
    dec_per_tgt_tok = nd * (4 * d * hk + 2 * d * hk + 2 * d * f) + d * v  # self q k v out, cross q out, ffn; logits
    dense = 6 * (s.sum() * (enc_per_src_tok + cross_kv_per_src_tok) + t.sum() * dec_per_tgt_tok)
    attention = 3 * 4 * hk * (n * s * s + nd * (t * t + t * s)).sum()   # enc self, dec self, dec cross
    return float(dense + attention), float(dense), float(attention)


# ----------------------------------------------------------------------------- machine
def cpu_model():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_name():
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{cfg.get('name')} {cfg.get('version')}"
    except Exception:
        return "unknown"


def matmul_peak(xp, n=2048, repeats=5):
    """Best-of float32 n^3 matmul rate (FLOP/s) on the device of xp."""
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype=xp.float32)
    c = a @ a
    best = float("inf")
    for _ in range(repeats):
        synchronize(xp)
        t0 = time.perf_counter()
        c = a @ a
        synchronize(xp)
        best = min(best, time.perf_counter() - t0)
    del c
    return 2 * n ** 3 / best


def torch_matmul_peak(torch, device, n=2048, repeats=5):
    a = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    c = a @ a
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        c = a @ a
        sync()
        best = min(best, time.perf_counter() - t0)
    del c
    return 2 * n ** 3 / best


def rss_peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


# ----------------------------------------------------------------------------- the two contenders
class MinitfRunner:
    FP16_LOSS_SCALE = 1024.0  # the start: static on the host path (enough for timing); dynamic from it where the
    # update ends on the device, as training's

    def __init__(self, cfg, device, batch, lr, fp16, name="minitf"):
        """fp16: False (float32), True or "float16" (--fp16), "bfloat16" (--bf16)."""
        self.name, self.cfg = name, cfg
        self.xp = get_xp(device)
        self.dtype, self.model = "float32", None
        if fp16:
            half = "float16" if fp16 is True else fp16
            try:  # minitf's mixed precision, where this minitf version has it
                self.model = minitf.Transformer(cfg, device=device, dtype=half, seed=0)
                self.dtype = half
            except ConfigError:
                pass
        if self.model is None:
            self.model = minitf.Transformer(cfg, device=device, dtype="float32", seed=0)
        self.scale = self.FP16_LOSS_SCALE if self.dtype == "float16" else 1.0
        self.model.train()
        self.opt = minitf.Adam(self.model, lr=lr)
        self.batch = batch   # host ids, as train.py passes them (forward_loss moves them)
        # a GPU update as training makes it, where this minitf version has it: the outcome decided on
        # the device (minitf.optim.UpdateCheck, dynamic loss scaling from the same start), read an update late;
        # or, where that is switched off (MINITF_HOST_CHECK=1, MINITF_FUSED_ADAM=0), read on the host at once
        self.check, self._last = None, None
        from minitf import optim
        self.read_on_host = backend.is_gpu(self.xp) and hasattr(optim, "UpdateCheck")
        if self.read_on_host and optim.UpdateCheck.applies(self.opt):
            from minitf.distributed import World
            from minitf.optim import LossScaler, UpdateCheck
            self.world = World()
            self.check = UpdateCheck(self.model, LossScaler(self.scale) if self.dtype == "float16" else None)

    def step(self):
        m = self.model
        if self.check is None:
            m.zero_grad()
            if hasattr(m, "forward_backward"):   # as training takes them, where this minitf version has it
                loss = m.forward_backward(*self.batch, loss_weight=self.scale)
            else:
                loss = m.forward_loss(*self.batch)
                m.backward(loss_weight=self.scale)
            if self.read_on_host:   # train.finish_on_host's one read: loss, NLL, every gradient finite
                from minitf.train import step_stats
                step_stats(m, m.last_stats["loss_sum"], m.last_stats["nll_sum"])
            self.opt.step(grad_divisor=self.scale)
            return loss
        from minitf.train import forward_backward
        n = int((np.asarray(self.batch[2]) != self.cfg.pad_id).sum())
        loss_sum, nll_sum = forward_backward(m, [(0, (*self.batch, n))], n, 0, self.check.scaler, self.check)
        outcome = self.check.check(loss_sum, nll_sum, self.world)
        if self._last is not None:
            self._last.result()   # the host reads the last update's outcome while this one computes
        self.opt.step(check=self.check)
        self._last = outcome
        return m.last_stats["loss"]

    def sync(self):
        synchronize(self.xp)


class TorchRunner:
    name = "torch"

    def __init__(self, cfg, device, batch, lr, fp16, state_dict, strong=False, compile=False):
        """strong: scaled_dot_product_attention, logits on the rows with a loss, fused Adam on a
        GPU (bench/torch_model.py); compile: the loss through torch.compile too."""
        import torch
        from bench.torch_model import as_ids, from_minitf_state
        self.torch = torch
        self.device = "cuda" if device == "gpu" else "cpu"
        if strong:
            self.name = "torch-strong" + ("-compiled" if compile else "")
        torch.backends.cuda.matmul.allow_tf32 = kernels.tf32()   # same matmul mode as minitf
        self.model = from_minitf_state(state_dict, cfg, dtype="float32", device=self.device, autocast_fp16=fp16,
                                       strong=strong)
        self.model.train()
        fused = {"fused": True} if strong and self.device == "cuda" else {}
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, **fused)
        # loss scaling for float16 only (AMP's recipe; bfloat16 has float32's range)
        self.scaler = torch.amp.GradScaler(self.device, enabled=fp16 in (True, "float16") and self.device == "cuda")
        self.batch = [as_ids(a, self.device) for a in batch]
        self.loss_fn = torch.compile(self.model.loss) if compile else self.model.loss

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(*self.batch)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def torch_runner_like(runner, device, batch, lr, fp16, strong=False, compile=False):
    """PyTorch's runner holding the weights of minitf's `runner`, so that both start from the same point."""
    state = {n: to_numpy(a).copy() for n, a in runner.model.state_dict().items()}
    return TorchRunner(runner.cfg, device, batch, lr, fp16, state, strong=strong, compile=compile)


def make_runners(cfg, batch, lr, fp16, with_torch=True, strong=False):
    """[minitf's runner of one training step on the GPU] and, with_torch, PyTorch eager's (and,
    strong, PyTorch as a user choosing it for speed runs it: SDPA, logits on the rows with a loss,
    fused Adam), each holding minitf's initial weights so that all start from the same point."""
    runners = [MinitfRunner(cfg, "gpu", batch, lr, fp16)]
    if with_torch:
        runners.append(torch_runner_like(runners[0], "gpu", batch, lr, fp16))
        if strong:
            runners.append(torch_runner_like(runners[0], "gpu", batch, lr, fp16, strong=True))
    return runners


def timed_round(runner, steps):
    runner.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = runner.step()
    runner.sync()
    return time.perf_counter() - t0, float(loss)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--preset", default="small", choices=sorted(minitf.PRESETS))
    add_shape_flags(ap)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--fp16", action="store_true", help="torch under autocast float16 (+GradScaler on GPU); "
                    "minitf in float16 only if it supports that dtype, else float32")
    ap.add_argument("--vs-torch", action="store_true")
    ap.add_argument("--tf32", action="store_true",
                    help="GPU float32 matmuls on TF32 tensor cores, on both sides (CUPY_TF32=1 for minitf, "
                         "torch.backends.cuda.matmul.allow_tf32 for torch); default: full float32 on both")
    ap.add_argument("--batch-sentences", type=count(), default=64)
    ap.add_argument("--src-len", type=count(), default=24)
    ap.add_argument("--tgt-len", type=count(), default=24)
    ap.add_argument("--vocab", type=count(5), default=8000, help="pieces (at least the 4 special ones and one more)")
    ap.add_argument("--output-pieces", type=int, metavar="V_o",
                    help="an output vocabulary of V_o of the --vocab pieces (ids 1..V_o; the targets drawn from them): "
                         "train_wmt.py --output-vocab target")
    ap.add_argument("--vs-joint", action="store_true",
                    help="with --output-pieces: also time the same model scoring all --vocab pieces (rounds alternate)")
    ap.add_argument("--full-length", action="store_true",
                    help="every sentence exactly --src-len/--tgt-len long: no padding, so minitf's pad-free "
                         "rows save nothing (the like-for-like kernel comparison)")
    ap.add_argument("--rounds", type=count(), default=7)
    ap.add_argument("--warmup-rounds", type=count(0), default=2)
    ap.add_argument("--steps-per-round", type=count(), default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing, run minitf's steps under cProfile and print the top functions")
    args = ap.parse_args(argv)
    output_path(ap, args.json, "--json")

    sizes = shape_overrides(args)
    if args.vs_joint and not args.output_pieces:
        ap.error("--vs-joint compares with --output-pieces V_o: give it")
    if args.vs_torch:
        need_torch(ap)
    if args.vs_torch and args.output_pieces:
        ap.error("--vs-torch times the paper's joint output (the PyTorch model has no output vocabulary): "
                 "drop --output-pieces")
    joint_cfg = minitf.Config.preset(args.preset, vocab_size=args.vocab, **sizes)
    cfg = joint_cfg
    if args.output_pieces:
        if not 4 <= args.output_pieces < args.vocab:
            ap.error(f"--output-pieces must be in [4, --vocab {args.vocab}), got {args.output_pieces}")
        cfg = minitf.Config.preset(args.preset, vocab_size=args.vocab,
                                              output_vocab=id_ranges(range(1, args.output_pieces + 1)), **sizes)
    batch = make_batch(cfg, args.batch_sentences, args.src_len, args.tgt_len, full_length=args.full_length)
    src, tgt_in, tgt_out = batch
    tgt_tokens = int((tgt_out != cfg.pad_id).sum())
    src_tokens = int((src != cfg.pad_id).sum())
    src_lens, tgt_lens = (src != cfg.pad_id).sum(axis=1), (tgt_out != cfg.pad_id).sum(axis=1)
    flops, dense_flops, attn_flops = step_flops(cfg, src_lens, tgt_lens)
    padded_flops = step_flops(cfg, [src.shape[1]] * len(src), [tgt_in.shape[1]] * len(src))[0]
    xp = get_xp(args.device)
    load_start = os.getloadavg()[0]  # other processes on the machine skew the timings: reported

    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "blas_threads_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                    "MKL_NUM_THREADS") if k in os.environ},
                    "python": platform.python_version(), "numpy": np.__version__, "numpy_blas": blas_name()},
        "args": vars(args),
        "config": {k: getattr(cfg, k) for k in ("d_model", "n_heads", "d_k", "d_ff", "n_layers", "n_decoder_layers",
                                                "vocab_size", "dropout", "label_smoothing", "positional")}
                  | {"output_pieces": output_size(cfg)},
        "batch": {"sentences": src.shape[0], "src_len": src.shape[1], "tgt_len": tgt_in.shape[1],
                  "src_tokens": src_tokens, "tgt_tokens": tgt_tokens,
                  "padded_positions": int(src.size + tgt_in.size)},
        "flops_per_step": {"total": flops, "dense": dense_flops, "attention": attn_flops, "padded": padded_flops},
    }
    if args.device == "gpu":
        cupy = backend.cupy   # the module minitf runs on (MINITF_CUPY_MODULE)
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        info["machine"]["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        info["machine"]["cupy"] = cupy.__version__

    peaks = {"numpy" if args.device == "cpu" else "cupy": matmul_peak(xp)}
    if args.device == "gpu":
        cupy = backend.cupy   # the module minitf runs on (MINITF_CUPY_MODULE)
        cupy.get_default_memory_pool().free_all_blocks()  # so the pool's size below is minitf's high-water mark
    rss_start = rss_peak_mib()

    runners = [MinitfRunner(cfg, args.device, batch, args.lr, args.fp16)]
    if args.profile:
        return profile(runners[0], args)
    info["minitf_dtype"] = runners[0].dtype
    info["minitf_params"] = runners[0].model.num_parameters()
    for _ in range(args.warmup_rounds):
        timed_round(runners[0], args.steps_per_round)
    rss_minitf = rss_peak_mib()  # before torch is even imported: minitf's own high-water mark
    if args.vs_joint:
        runners.append(MinitfRunner(joint_cfg, args.device, batch, args.lr, args.fp16, name="joint"))
        for _ in range(args.warmup_rounds):
            timed_round(runners[-1], args.steps_per_round)

    if args.vs_torch:
        import torch
        info["machine"]["torch"] = torch.__version__
        info["machine"]["torch_threads"] = torch.get_num_threads()
        peaks["torch"] = torch_matmul_peak(torch, "cuda" if args.device == "gpu" else "cpu")
        if args.device == "gpu":
            torch.cuda.reset_peak_memory_stats()
        runners.append(torch_runner_like(runners[0], args.device, batch, args.lr, args.fp16))
        # same weights, same batch: without dropout the two losses agree (a setup check, untimed)
        runners[0].model.eval()
        runners[1].model.eval()
        info["eval_loss_same_weights"] = {"minitf": float(runners[0].model.forward_loss(*runners[0].batch)),
                                          "torch": float(runners[1].model.loss(*runners[1].batch).detach())}
        runners[0].model.train()
        runners[1].model.train()
        for _ in range(args.warmup_rounds):
            timed_round(runners[1], args.steps_per_round)
    peak = max(peaks.values())
    info["matmul_peak_flops"] = peaks

    times = {r.name: [] for r in runners}
    losses = {r.name: [] for r in runners}
    for _ in range(args.rounds):  # alternate: minitf round, torch round, minitf round, ...
        for r in runners:
            dt, loss = timed_round(r, args.steps_per_round)
            times[r.name].append(dt / args.steps_per_round)
            losses[r.name].append(loss)

    results = {}
    for r in runners:
        med = statistics.median(times[r.name])
        r_flops = step_flops(r.cfg, src_lens, tgt_lens)[0] if r.name == "joint" else flops
        results[r.name] = {"step_s_median": med, "step_s_all": times[r.name],
                           "tgt_tokens_per_s": tgt_tokens / med, "mfu": r_flops / med / peak,
                           "achieved_flops": r_flops / med, "last_loss": losses[r.name][-1]}
    if args.vs_joint:
        results["ratio_output_vocab_over_joint"] = (results["minitf"]["tgt_tokens_per_s"]
                                                    / results["joint"]["tgt_tokens_per_s"])

    # memory
    if args.device == "cpu":
        tracemalloc.start()  # NumPy reports its array allocations to tracemalloc
        runners[0].step()
        results["minitf"]["numpy_step_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        results["minitf"]["rss_peak_mib"] = rss_minitf
        info["rss_before_models_mib"] = rss_start
        if args.vs_torch:
            results["torch"]["process_rss_peak_mib"] = rss_peak_mib()
    else:
        cupy = backend.cupy   # the module minitf runs on (MINITF_CUPY_MODULE)
        results["minitf"]["gpu_pool_peak_mib"] = cupy.get_default_memory_pool().total_bytes() / 2**20
        if args.vs_torch:
            results["torch"]["gpu_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if args.vs_torch:
        results["ratio_minitf_over_torch"] = (results["minitf"]["tgt_tokens_per_s"]
                                              / results["torch"]["tgt_tokens_per_s"])
    info["results"] = results
    info["loadavg_start_end"] = [load_start, os.getloadavg()[0]]
    report(info)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(info, fh, indent=2)
    return info


def profile(runner, args, top=30):
    import cProfile
    import pstats
    for _ in range(args.warmup_rounds):
        timed_round(runner, args.steps_per_round)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.rounds):
        timed_round(runner, args.steps_per_round)
    prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"=== minitf, {args.rounds * args.steps_per_round} steps, sorted by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(top)


def report(info):
    m, b, res = info["machine"], info["batch"], info["results"]
    print(f"date {info['date']}  python {m['python']}  numpy {m['numpy']} ({m['numpy_blas']})"
          + (f"  torch {m['torch']} ({m['torch_threads']} threads)" if "torch" in m else "")
          + (f"  cupy {m['cupy']}  gpu {m['gpu']}" if "gpu" in m else ""))
    print(f"cpu {m['cpu']}: {m['cpu_count']} logical cores, {m['affinity']} usable; "
          f"thread env {m['blas_threads_env'] or 'unset (libraries use all cores)'}")
    c, a = info["config"], info["args"]
    print(f"preset {a['preset']} on {a['device']}: D={c['d_model']} H={c['n_heads']} d_k={c['d_k']} F={c['d_ff']} "
          f"layers={c['n_layers']}+{c['n_decoder_layers']} V={c['vocab_size']} output {c['output_pieces']} dropout={c['dropout']}; minitf {info['minitf_params']:,} params "
          f"({info['minitf_dtype']})")
    print(f"batch {b['sentences']} x src {b['src_len']} / tgt {b['tgt_len']}: {b['src_tokens']} src + "
          f"{b['tgt_tokens']} tgt non-pad tokens; {a['rounds']} rounds x {a['steps_per_round']} step(s) "
          f"after {a['warmup_rounds']} warm-up rounds")
    f = info["flops_per_step"]
    peaks = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in info["matmul_peak_flops"].items())
    print(f"model FLOPs/step on non-pad tokens {f['total'] / 1e9:.2f} G (dense {f['dense'] / 1e9:.2f} + attention "
          f"{f['attention'] / 1e9:.2f}; {f['padded'] / 1e9:.2f} G if padding counted); "
          f"float32 2048^3 matmul peak GFLOP/s: {peaks} (MFU uses the max)")
    for name in ("minitf", "joint", "torch"):
        if name not in res:
            continue
        r = res[name]
        mem = ", ".join(f"{k} {v:.0f}" for k, v in r.items() if k.endswith("_mib"))
        print(f"{name:7s} step {r['step_s_median'] * 1e3:8.1f} ms (min {min(r['step_s_all']) * 1e3:.1f}, "
              f"max {max(r['step_s_all']) * 1e3:.1f})  {r['tgt_tokens_per_s']:9.0f} tgt tok/s  "
              f"{r['achieved_flops'] / 1e9:6.1f} GFLOP/s  MFU {100 * r['mfu']:5.1f}%  loss {r['last_loss']:.3f}  "
              f"memory MiB: {mem}")
    print(f"1-min load average at start / end: {info['loadavg_start_end'][0]:.2f} / {info['loadavg_start_end'][1]:.2f} "
          f"on {m['affinity']} cores (the end value includes this benchmark)")
    if "eval_loss_same_weights" in info:
        e = info["eval_loss_same_weights"]
        print(f"setup check, same weights without dropout: loss minitf {e['minitf']:.6f} torch {e['torch']:.6f}")
    if "ratio_output_vocab_over_joint" in res:
        print(f"ratio output vocabulary of {c['output_pieces']} / joint {c['vocab_size']} (tokens/s): "
              f"{res['ratio_output_vocab_over_joint']:.3f}")
    if "ratio_minitf_over_torch" in res:
        print(f"ratio minitf/torch (tokens/s): {res['ratio_minitf_over_torch']:.3f}")


if __name__ == "__main__":
    run(main)
