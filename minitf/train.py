"""The training loop behind train_wmt.py: data -> tokenizer -> batches -> Adam with the
paper's schedule (5.3) -> checkpoints -> averaged model -> beam search -> sacreBLEU (6.1).

Resumable exactly: a checkpoint stores the parameters, Adam's moments and step, the data
position (epoch, batch index), and the dropout stream position (model.forward_count), so
`--resume` replays the same batches, masks and losses as a run that never stopped.
"""
import glob
from concurrent.futures import ThreadPoolExecutor
import json
import os
import signal
import sys
import time

import numpy as np

from .backend import get_xp, is_gpu, release_freed_memory, to_numpy
from .checkpoint import average_checkpoints, load_checkpoint, read_train_state, save_checkpoint
from .fileio import atomic_write
from .config import SIZE_FLAGS, TransformerConfig
from .data.binarized import StaleData
from .data.pipeline import load_data
from .data.tokenizer import Tokenizer
from . import distributed
from .errors import ConfigError, Interrupted, MinitfError
from .kernels import accum_dtype
from .models import build_model
from .optim import Adam, LossScaler
from .schedule import NoamSchedule, fade

def log(msg):
    sys.stderr.write(f"{msg}\n")   # one write: the lines of several ranks never run into each other
    sys.stderr.flush()


# ------------------------------------------------------------------------------ data
def to_batch(pairs, idx, tok):
    """(src, tgt_in, tgt_out, n_target_tokens) of the pairs `idx` of a TokenPairs: host arrays
    (forward_loss finds the non-pad rows on the host, then moves the ids itself)."""
    src, tgt_in, tgt_out = pairs.collate(idx, tok.pad_id, tok.bos_id, tok.eos_id)
    return src, tgt_in, tgt_out, int((tgt_out != tok.pad_id).sum())


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_paths(out):
    return sorted(glob.glob(os.path.join(out, "checkpoint_*.npz")))


def save(out, step, model, opt, tok, state, keep_last):
    path = os.path.join(out, f"checkpoint_{step:07d}.npz")
    save_checkpoint(path, model, opt, tokenizer=tok.to_bytes(), train_state=state)
    for old in checkpoint_paths(out)[:-keep_last]:
        os.unlink(old)
    return path


def resolve_recipe(args, cfg):
    """Fill the flags left unset from the preset's (or the resumed checkpoint's) recipe: max_steps,
    average_last, keep_last (average_last + 1: a final off-grid checkpoint never pushes an
    averaged one out), and ONE checkpoint spacing, in steps or in minutes of training."""
    if args.max_steps is None:
        args.max_steps = cfg.max_steps
    if args.alpha is None:
        args.alpha = cfg.decode_alpha
    if args.average_last is None:
        args.average_last = cfg.average_last
    if args.keep_last is None:
        args.keep_last = args.average_last + 1
    if args.save_every is None and args.save_every_minutes is None:
        args.save_every, args.save_every_minutes = cfg.save_every, cfg.save_every_minutes
    if args.save_every_minutes:
        args.save_every = None
    if cfg.lr_fade and not args.max_steps and not args.time_budget:
        raise ConfigError(f"--lr-fade {cfg.lr_fade} fades the learning rate to 0 at the run's end, but this run has "
                          f"none: give --time-budget or --max-steps, or --lr-fade 0")
    if args.average_last > args.keep_last:
        raise ConfigError(f"--average-last {args.average_last} > --keep-last {args.keep_last}: keep at least as "
                          f"many checkpoints as you average")


def forward_backward(model, micro, total, forward_count, scaler=None):
    """The gradient of one update: zero the gradients, then forward and backward each of its
    micro-batches [(j, (src, tgt_in, tgt_out, n))]. The update's loss is the token-weighted
    mean over them, so micro-batch j's backward weighs n / total (n its tokens, total the
    update's), times the float16 loss scale (undone by Adam.step's grad_divisor).
    Returns the token-summed loss and NLL (device scalars on a GPU, read once per step)."""
    model.zero_grad()
    loss_sum = nll_sum = 0.0
    for j, (src, tgt_in, tgt_out, n) in micro:
        model.forward_count = forward_count + j   # dropout masks: (seed, global batch index)
        loss_sum = loss_sum + model.forward_loss(src, tgt_in, tgt_out) * n
        model.backward(loss_weight=(scaler.scale if scaler else 1.0) * n / total)
        nll_sum = nll_sum + model.last_stats["nll_sum"]
    return loss_sum, nll_sum


def run_progress(args, step, wall_s):
    """How far the run is, 0 to 1: the larger of steps / --max-steps and seconds / --time-budget
    (the learning-rate fade's clock; every rank passes the same, the ranks' mean wall_s)."""
    return max(step / args.max_steps if args.max_steps else 0.0,
               wall_s / args.time_budget if args.time_budget else 0.0)


def on_save_grid(args, state, wall_s):
    """True when this step ends a checkpoint interval: every save_every steps, or the first step
    after each save_every_minutes of training (paper 6.1: 10-minute intervals)."""
    if args.save_every_minutes:
        interval = int(wall_s // (60 * args.save_every_minutes))
        if interval > state.get("grid_interval", 0):
            state["grid_interval"] = interval
            return True
        return False
    return state["step"] % args.save_every == 0


def build_config(args, vocab_size):
    over = {k: getattr(args, k) for k in ("dropout", "label_smoothing", "warmup", "lr_factor", "lr_fade", "max_tokens", "save_every",
                                          "save_every_minutes", "average_last", "max_steps")
            if getattr(args, k, None) is not None}
    over.update({field: getattr(args, flag) for flag, field in SIZE_FLAGS.items() if getattr(args, flag, None) is not None})
    if args.save_every is not None and args.save_every_minutes is None:
        over["save_every_minutes"] = None   # spacing in steps asked for: a resumed run keeps it
    if getattr(args, "attention", None) is not None:
        over["attention"] = args.attention
    return TransformerConfig.preset(args.preset, arch=getattr(args, "arch", None) or "transformer",
                                    vocab_size=vocab_size, **over)


# ------------------------------------------------------------------------------ the loop
def step_stats(model, loss_sum, nll_sum):
    """(loss_sum, nll_sum, grads_finite) on the host with ONE device->host copy per step (as
    torch's GradScaler reads its overflow flag): the step's only GPU synchronisation."""
    xp = model.xp
    dt = accum_dtype(model.dtype) if is_gpu(xp) else np.float64   # the values' own precision: no float64 on a GPU
    both = xp.stack([xp.asarray(loss_sum, dtype=dt), xp.asarray(nll_sum, dtype=dt),
                     xp.isfinite(model.flat_grads).all().astype(dt)])
    loss_sum, nll_sum, finite = (float(v) for v in to_numpy(both))
    return loss_sum, nll_sum, finite == 1.0


def evaluate_loss(model, batches):
    """Teacher-forced loss and per-token NLL over (src, tgt_in, tgt_out) batches, in eval mode
    (the model's train/eval mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    tot_loss = tot_nll = tot_n = 0.0
    for src, tgt_in, tgt_out, n in batches:
        loss = model.forward_loss(src, tgt_in, tgt_out)
        tot_loss += float(loss) * n
        tot_nll += float(model.last_stats["nll_sum"])
        tot_n += n
    model.train(was_training)
    return tot_loss / max(tot_n, 1), tot_nll / max(tot_n, 1)


def train(args):
    """Train as train_wmt.py's flags say; under mpiexec, on every rank (distributed.py). An error on
    any rank prints that rank's message and aborts the whole job (MPI Abort), never a hang."""
    world = distributed.init()
    try:
        return _train(args, world)
    except MinitfError as e:
        if world.size == 1:
            raise
        log(f"rank {world.rank}: error: {e}")
        world.abort(2)
    except Exception:
        if world.size == 1:
            raise
        import traceback
        log(f"rank {world.rank}: unexpected error:\n{traceback.format_exc()}")
        world.abort(1)


def _agree(world, **facts):
    """ConfigError on every rank when the ranks were launched with different data or flags; the
    message names only what differs (`--dropout 0.1 (rank 0) vs 0.3 (rank 1)`), the config's fields
    one by one, by their flags."""
    flag = {field: name for name, field in SIZE_FLAGS.items()}
    plain = {"data_id": "the data (data_id)", "resume_step": "the resumed step"}

    def named(f):   # {what the user calls it: value}
        out = {}
        for k, v in f.items():
            for key, value in (v.items() if k == "config" else [(k, v)]):
                label = plain.get(key) or "--" + flag.get(key, key).replace("_", "-")
                out[f"the config's {key}" if k == "config" and key in f else label] = value
        return out

    every = [named(f) for f in world.allgather(facts)]
    for rank, other in enumerate(every):
        diff = [f"{k} {v} (rank 0) vs {other.get(k)} (rank {rank})" for k, v in every[0].items() if other.get(k) != v]
        if diff:
            raise ConfigError(f"the ranks disagree: {'; '.join(diff)}; launch every rank with the same flags and files")


def _train(args, world):
    from tqdm import tqdm

    from .data import iterate_batches, token_batches
    lead = world.rank == 0   # the one writer: logs, progress bar, checkpoints, results
    if args.device == "gpu" and world.size > 1:
        world.use_gpu()   # the GPU of this rank's local rank, and the NCCL communicator
    if args.device == "cpu" and world.size > 1:
        threads = world.share_cores()   # this machine's cores split between its ranks' BLAS
        if lead and threads:
            log(f"{world.local_size} ranks on this machine: {threads} BLAS thread(s) each")
    get_xp(args.device)  # fail fast (before data and tokenizer work) when the device is unusable
    if lead and getattr(args, "fp16", False) and args.device == "cpu":
        log("warning: --fp16 on the CPU is very slow (NumPy has no float16 BLAS); it is meant for GPUs")
    os.makedirs(args.out, exist_ok=True)
    ckpts = checkpoint_paths(args.out)
    if ckpts and not args.resume:
        raise ConfigError(f"--out {args.out} already holds checkpoints: pass --resume to continue, "
                          f"or choose another --out")
    resume = load_checkpoint(ckpts[-1]) if args.resume and ckpts else None
    # a resumed run encodes with its checkpoint's tokenizer, so its cache holds the same ids;
    # rank 0 prepares the cache (and trains the tokenizer) once, the others then open it
    for turn in range(2 if world.size > 1 else 1):
        if (world.rank == 0) == (turn == 0):
            try:
                data = load_data(args, tokenizer=Tokenizer.from_bytes(resume.tokenizer) if resume and resume.tokenizer
                                 else None, log=log if lead else (lambda msg: None),
                                 expect_data_id=resume.train_state.get("data_id") if resume else None, notes=lead)
            except StaleData as e:
                raise ConfigError(f"--resume: {ckpts[-1]} was trained on other data: {e}; restore it, "
                                  f"or start a new --out") from None
        world.barrier()
    tok, train_pairs = data.tokenizer, data.train
    if resume is not None:
        cfg = resume.config
        for flag, field in (("arch", "arch"), ("attention", "attention"), *SIZE_FLAGS.items()):
            asked = getattr(args, flag, None)
            if asked is not None and asked != getattr(cfg, field):
                name = flag.replace("_", "-")
                raise ConfigError(f"--{name} {asked}: the checkpoint {ckpts[-1]} was trained with --{name} "
                                  f"{getattr(cfg, field)}; drop the flag to resume it, or start a new --out")
        trained_on = resume.train_state.get("data_id")
        if trained_on is not None and trained_on != data.data_id:
            raise ConfigError(f"--resume: {ckpts[-1]} was trained on the binarized corpus {trained_on}, but the "
                              f"training data now gives {data.data_id} ({data.corpus.folder}); the corpus files or "
                              f"the cleaning flags (--max-len, --max-ratio) changed: restore them, or start a new --out")
        if lead:
            log(f"resuming from {ckpts[-1]} (step {resume.train_state['step']})")
    else:
        cfg = build_config(args, tok.vocab_size)
    resolve_recipe(args, cfg)
    if cfg.vocab_size != tok.vocab_size:
        raise ConfigError(f"the checkpoint's vocabulary ({cfg.vocab_size}) != the tokenizer's ({tok.vocab_size})")
    fp16 = getattr(args, "fp16", False)
    _agree(world, data_id=data.data_id, config=cfg.to_dict(), seed=args.seed, update_freq=args.update_freq,
           dtype=getattr(args, "dtype", "float32"), fp16=fp16, resume_step=resume.train_state["step"] if resume else 0,
           max_steps=args.max_steps, save_every=args.save_every, save_every_minutes=args.save_every_minutes,
           time_budget=args.time_budget)
    model = build_model(cfg, device=args.device, dtype="float16" if fp16 else getattr(args, "dtype", "float32"),
                        seed=args.seed)
    scaler = LossScaler() if fp16 else None
    opt = Adam(model, lr=NoamSchedule(cfg.d_model, cfg.warmup, cfg.lr_factor))
    state = {"step": 0, "epoch": 0, "batch": 0, "forward_count": 0, "train_wall_s": 0.0,
             "train_tokens": 0, "nonfinite": 0, "data_id": data.data_id, "languages": [args.src, args.tgt]}
    if resume is not None:
        model.load_state_dict(resume.params)
        opt.load_state_dict(resume.optimizer)
        state.update(resume.train_state)
        if scaler is not None and "loss_scale" in state:
            scaler.scale, scaler.good_steps = state["loss_scale"], state["good_steps"]
    if lead:
        cfg_path = os.path.join(args.out, "config.json")
        atomic_write(cfg_path, lambda f: f.write(json.dumps({"model": cfg.to_dict(), "args": vars(args),
                                                               "ranks": world.size}, indent=2).encode()))
        log(f"model: {cfg.arch}, {model.num_parameters():,} parameters, preset {args.preset}, device {args.device}"
            + (f", {world.size} ranks" if world.size > 1 else ""))

    src_lens, tgt_lens = train_pairs.src_lens, train_pairs.tgt_lens   # token_batches adds the EOS / BOS itself
    per_update = world.size * args.update_freq   # batches of one update, over all ranks
    max_tokens = cfg.batch_tokens(world.size, args.update_freq)
    if resume is not None and state.get("batch_tokens", max_tokens) != max_tokens:
        raise ConfigError(f"--resume: {ckpts[-1]} was trained with batches of {state['batch_tokens']} tokens, but "
                          f"{world.size} rank(s) x --update-freq {args.update_freq} make batches of {max_tokens} (the "
                          f"preset's {cfg.update_tokens} tokens per update split over them): resume with the run's "
                          f"ranks and --update-freq, or start a new --out")
    state["batch_tokens"] = max_tokens
    first = token_batches(src_lens, tgt_lens, max_tokens, args.seed, state["epoch"])
    release_freed_memory()   # the sort's temporaries: hundreds of MB for a 36M-pair corpus
    epoch_len = len(first)   # for the log's fractional epoch (other epochs differ by a few batches)
    batches = iterate_batches(src_lens, tgt_lens, max_tokens, args.seed, state["epoch"], state["batch"], first=first,
                              after_plan=release_freed_memory)
    if per_update > epoch_len:
        raise ConfigError(f"{world.size} ranks x --update-freq {args.update_freq} = {per_update} batches per update, "
                          f"but an epoch has only {epoch_len}: use fewer ranks, a smaller --update-freq or --max-tokens")
    if lead:
        log(f"train: {len(src_lens):,} pairs in {epoch_len:,} batches per epoch; tokens per side (padding "
            f"included), at most: {max_tokens:,} per batch, {args.update_freq * max_tokens:,} per rank "
            f"({args.update_freq} batch{'es' if args.update_freq > 1 else ''}), {per_update * max_tokens:,} per update "
            f"({world.size} rank{'s' if world.size > 1 else ''})")
    valid = _valid_batches(data.valid, tok, max_tokens) if lead else None
    logf = open(os.path.join(args.out, "train_log.jsonl"), "a") if lead else None

    def write_log(rec):
        if logf is not None:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

    interrupted = []
    prev_handler = signal.signal(signal.SIGTERM, lambda *a: interrupted.append("SIGTERM"))
    prev_int = None
    if world.size > 1:   # Ctrl-C too becomes a flag the ranks agree on, never an exception mid all-reduce
        prev_int = signal.signal(signal.SIGINT, lambda *a: interrupted.append("SIGINT"))
    start_wall = time.time() - state["train_wall_s"]
    # under --time-budget the bar shows the budget (elapsed / budget, its ETA), not max_steps
    budget = args.time_budget
    bar = tqdm(initial=round(min(state["train_wall_s"], budget)) if budget else state["step"],
               total=round(budget) if budget else (args.max_steps or None), desc="train", file=sys.stderr,
               unit="s" if budget else "it", disable=args.quiet or not lead, dynamic_ncols=True)
    window = {"loss": 0.0, "nll": 0.0, "n": 0, "t0": time.time(), "tokens": 0}

    def next_update():
        """The next update's batches in the global order: rank r takes the r-th run of update_freq of
        them, collated; `total` is the update's GLOBAL number of non-pad target tokens (the loss is
        normalised by it). Runs on the prefetch thread, one update ahead of the one computing."""
        micro, total = [], 0
        for j in range(per_update):
            epoch, index, idx = next(batches)
            total += int(tgt_lens[idx].sum(dtype=np.int64)) + len(idx)   # target + EOS
            if j // args.update_freq == world.rank:
                micro.append((j, to_batch(train_pairs, idx, tok)))
        return epoch, index, total, micro

    prefetch = ThreadPoolExecutor(1, thread_name_prefix="minitf-batches")
    pending = prefetch.submit(next_update)
    stop_reason = "max_steps"
    model.train()
    try:
        while True:
            if args.max_steps and state["step"] >= args.max_steps:
                break
            elapsed = time.time() - start_wall
            over_budget, stop, elapsed_sum = world.allreduce_numbers(   # one decision on every rank
                [bool(args.time_budget and elapsed >= args.time_budget), bool(interrupted), elapsed])
            if over_budget:
                stop_reason = "time_budget"
                break
            if stop:
                raise KeyboardInterrupt
            epoch, index, total, micro = pending.result()   # collated while the last update computed
            pending = prefetch.submit(next_update)
            state["epoch"], state["batch"] = epoch, index + 1
            loss_sum, nll_sum = forward_backward(model, micro, total, state["forward_count"], scaler)
            state["forward_count"] += per_update
            world.allreduce_sum(model.flat_grads)   # every rank now holds the update's whole gradient
            loss_sum, nll_sum, grads_finite = step_stats(model, loss_sum, nll_sum)
            loss_sum, nll_sum = world.allreduce_numbers([loss_sum, nll_sum])
            if scaler is not None and np.isfinite(loss_sum) and not grads_finite:
                scaler.update(False)  # float16 overflow: skip the step with a smaller scale
                state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
                write_log({"step": state["step"], "event": "overflow_skipped", "loss_scale": scaler.scale})
                continue
            if not (np.isfinite(loss_sum) and grads_finite):
                state["nonfinite"] += 1
                write_log({"step": state["step"], "event": "nonfinite_loss_skipped", "count": state["nonfinite"]})
                if state["nonfinite"] >= args.max_nonfinite:
                    raise MinitfError(f"{state['nonfinite']} non-finite losses in a row at step {state['step']}: "
                                      f"lower --lr-factor or raise --warmup, then --resume")
                continue
            state["nonfinite"] = 0
            if scaler is not None:
                scaler.update(True)
                state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
            lr = opt.step(grad_divisor=scaler.scale if scaler else 1.0,
                          lr_scale=fade(run_progress(args, state["step"], elapsed_sum / world.size), cfg.lr_fade))
            state["step"] += 1
            state["train_tokens"] += total
            window["loss"] += loss_sum
            window["nll"] += nll_sum
            window["n"] += total
            bar.update(round(min(time.time() - start_wall, budget)) - bar.n if budget else 1)
            if state["step"] % args.log_every == 0:
                dt = time.time() - window["t0"]
                rec = {"step": state["step"], "epoch": round(state["epoch"] + state["batch"] / epoch_len, 3),
                       "loss": round(window["loss"] / window["n"], 4), "nll": round(window["nll"] / window["n"], 4),
                       "ppl": round(float(np.exp(min(window["nll"] / window["n"], 50))), 2), "lr": lr,
                       "tokens_per_s": round(window["n"] / dt, 1), "wall_s": round(time.time() - start_wall, 1)}
                write_log(rec)
                bar.set_postfix(step=state["step"], loss=rec["loss"], ppl=rec["ppl"], lr=f"{lr:.2e}",
                                tok_s=int(rec["tokens_per_s"]))
                window = {"loss": 0.0, "nll": 0.0, "n": 0, "t0": time.time()}
            if lead and args.valid_every and state["step"] % args.valid_every == 0:
                vl, vnll = evaluate_loss(model, valid)
                write_log({"step": state["step"], "valid_loss": round(vl, 4), "valid_nll": round(vnll, 4),
                           "valid_ppl": round(float(np.exp(min(vnll, 50))), 2)})
            if lead and on_save_grid(args, state, time.time() - start_wall):
                state["train_wall_s"], state["on_grid"] = time.time() - start_wall, True
                save(args.out, state["step"], model, opt, tok, state, args.keep_last)
    except KeyboardInterrupt:
        prefetch.shutdown(wait=False, cancel_futures=True)
        bar.close()
        _restore_signals(prev_handler, prev_int)
        signame = interrupted[0] if interrupted else "SIGINT"
        if lead:
            state["train_wall_s"], state["on_grid"] = time.time() - start_wall, False
            path = save(args.out, state["step"], model, opt, tok, state, args.keep_last)
            logf.close()
            log(f"interrupted ({signame}) at step {state['step']}: saved {path}; continue with --resume")
        raise Interrupted(signame) from None
    prefetch.shutdown(wait=False, cancel_futures=True)
    bar.close()
    _restore_signals(prev_handler, prev_int)
    if not lead:
        return None
    state["train_wall_s"] = time.time() - start_wall
    if not checkpoint_paths(args.out) or not checkpoint_paths(args.out)[-1].endswith(f"{state['step']:07d}.npz"):
        state["on_grid"] = False   # saved for --resume; off the spacing, so not averaged
        save(args.out, state["step"], model, opt, tok, state, args.keep_last)
    log(f"training stopped ({stop_reason}) at step {state['step']} after {state['train_wall_s']:.0f}s")
    state["epochs"] = round(state["epoch"] + state["batch"] / epoch_len, 3)
    try:
        results = finish(args, model, tok, data, state, valid, write_log)
    except KeyboardInterrupt:   # Ctrl-C while averaging or translating: training itself is saved
        avg = os.path.join(args.out, "averaged.npz")
        log(f"interrupted during the final evaluation: the checkpoints in {args.out} are complete; score "
            f"{'the average' if os.path.exists(avg) else 'one'} with `python -m minitf evaluate --checkpoint "
            f"{avg if os.path.exists(avg) else checkpoint_paths(args.out)[-1]} --src ... --ref ...`")
        raise Interrupted("SIGINT") from None
    finally:
        logf.close()
    return results


def _restore_signals(term, interrupt):
    signal.signal(signal.SIGTERM, term)
    if interrupt is not None:
        signal.signal(signal.SIGINT, interrupt)


def _valid_batches(valid, tok, max_tokens):
    from .data import TokenPairs, token_batches
    pairs = TokenPairs.from_lists(tok.encode(valid[0]), tok.encode(valid[1]))
    idxs = token_batches(pairs.src_lens, pairs.tgt_lens, max_tokens, seed=0, epoch=0, shuffle=False)
    return [to_batch(pairs, idx, tok) for idx in idxs]


def finish(args, model, tok, data, state, valid, write_log):
    """Average the last checkpoints, translate valid + test sets with beam search, score them."""
    from .translate import score, translate_lines
    every = checkpoint_paths(args.out)
    # paper 6.1: the last K checkpoints written at even intervals; a final save off that spacing
    # (a --time-budget stop, an interrupt) is averaged only if no checkpoint is on it
    ckpts = [c for c in every if read_train_state(c).get("on_grid", True)][-args.average_last:] or every[-1:]
    avg_path = os.path.join(args.out, "averaged.npz")
    average_checkpoints(ckpts, avg_path)
    model.load_state_dict(load_checkpoint(avg_path).params)
    model.eval()
    spacing = (f"every {args.save_every_minutes:g} min" if args.save_every_minutes else f"every {args.save_every} steps")
    log(f"averaged {len(ckpts)} checkpoints ({spacing}: {', '.join(os.path.basename(c) for c in ckpts)}) -> {avg_path}")
    vl, vnll = evaluate_loss(model, valid)
    results = {"steps": state["step"], "epochs": state["epochs"], "train_wall_s": round(state["train_wall_s"], 1),
               "train_tokens_per_s": round(state["train_tokens"] / max(state["train_wall_s"], 1e-9), 1),
               "averaged_checkpoints": [os.path.basename(c) for c in ckpts], "valid_loss": round(vl, 4),
               "valid_ppl": round(float(np.exp(min(vnll, 50))), 2), "beam": args.beam, "alpha": args.alpha,
               "bleu": {}, "chrf": {}, "sacrebleu_signature": None, "chrf_signature": None,
               "bleu_paper": {}, "bleu_paper_method": None}
    sets = {"valid": data.valid, **data.tests}
    for name, (src, ref) in sets.items():
        t0 = time.time()
        hyps = translate_lines(model, tok, src, args.beam, args.alpha, args.decode_batch, progress=not args.quiet)
        s = score(hyps, ref, lang=args.tgt)
        atomic_write(os.path.join(args.out, f"{name}.hyp.{args.tgt}"), lambda f: f.write("".join(h + "\n" for h in hyps).encode()))
        results["bleu"][name], results["chrf"][name] = s["bleu"], s["chrf"]
        results["sacrebleu_signature"], results["chrf_signature"] = s["bleu_signature"], s["chrf_signature"]
        results["bleu_paper"][name], results["bleu_paper_method"] = s["bleu_paper"], s["bleu_paper_method"]
        write_log({"step": state["step"], "eval": name, "bleu": s["bleu"], "chrf": s["chrf"],
                   "bleu_paper": s["bleu_paper"], "decode_s": round(time.time() - t0, 1)})
        paper = f" (paper's tokenized BLEU {s['bleu_paper']})" if s["bleu_paper"] is not None else ""
        log(f"{name}: BLEU {s['bleu']}{paper} chrF {s['chrf']} ({len(src)} sentences, {time.time() - t0:.0f}s)")
    if results["bleu_paper"] and None in results["bleu_paper"].values():
        log(f"note: the paper's tokenized BLEU was {results['bleu_paper_method']}")
    atomic_write(os.path.join(args.out, "results.json"), lambda f: f.write(json.dumps(results, indent=2).encode()))
    return results
