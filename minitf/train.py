"""The training loop behind train_wmt.py: data -> tokenizer -> batches -> Adam with the
paper's schedule (5.3) -> checkpoints -> averaged model -> beam search -> sacreBLEU (6.1).

`train` reads as its three steps: `set_up` (device, data, the checkpoint to resume, model,
optimizer, the batch stream: a `Run`), `run_loop` (each update: `should_stop`, `take_step`,
`after_step`), and `end` (the last checkpoint, then `finish`: averaging, decoding, scores).

Resumable exactly: a checkpoint stores the parameters, Adam's moments and step, the data
position (epoch, batch index), and the dropout stream position (model.forward_count), so
`--resume` replays the same batches, masks and losses as a run that never stopped.
"""
import argparse
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
import glob
import hashlib
import json
import os
import re
import signal
import time
from typing import Optional

import numpy as np

from .backend import get_xp, is_gpu, release_freed_memory, to_numpy
from .checkpoint import average_checkpoints, load_checkpoint, read_train_state, save_checkpoint
from .fileio import atomic_write, folder_lock, leftover_temp_files, refuse_if_busy
from .config import SIZE_FLAGS, TransformerConfig, id_ranges
from .data.binarized import StaleData
from .data.pipeline import load_data
from .data.tokenizer import EOS_ID, UNK_ID, Tokenizer
from . import distributed
from .errors import ConfigError, Interrupted, MinitfError
from .kernels import accum_dtype
from .models import build_model
from .optim import Adam, LossScaler
from .schedule import NoamSchedule, fade
from .trainlog import Console, TrainLog, log, print_summary, summary_lines
from .translate import paper_bleu_available
from .validation import Validation, evaluate_loss, perplexity, to_batch


# ------------------------------------------------------------------------------ checkpoints
# what a run writes into --out (atomic_write's temporary files of these are its leftovers)
STEP_CHECKPOINT = re.compile(r"checkpoint_\d+\.npz")
BEST = "checkpoint_best.npz"   # the model of the best validation BLEU so far (no optimizer state)
OUTPUT_NAMES = re.compile(r"checkpoint_\d+\.npz|checkpoint_best\.npz|averaged\.npz|model\.npz|config\.json|results\.json|[\w.-]+\.hyp\.[\w-]+")


def checkpoint_paths(out):
    """The training checkpoints in `out` (checkpoint_<step>.npz), oldest first; not checkpoint_best.npz."""
    return sorted(p for p in glob.glob(os.path.join(out, "checkpoint_*.npz")) if STEP_CHECKPOINT.fullmatch(os.path.basename(p)))


def save(out, step, model, opt, tok, state, keep_last):
    path = os.path.join(out, f"checkpoint_{step:07d}.npz")
    save_checkpoint(path, model, opt, tokenizer=tok.to_bytes(), train_state=state)
    for old in checkpoint_paths(out)[:-keep_last]:
        os.unlink(old)
    return path


VALID_EVERY = 200   # updates between validations when checkpoints are spaced in steps (CPU presets)


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
    if args.valid_every is None and args.valid_every_minutes is None:   # validate with the checkpoints' clock
        if args.save_every_minutes:
            args.valid_every_minutes = args.save_every_minutes
        else:
            args.valid_every = VALID_EVERY
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
    return on_grid(state, "grid_interval", args.save_every, args.save_every_minutes, wall_s)


def on_grid(state, key, every_steps, every_minutes, wall_s):
    """True every `every_steps` steps, or at the first step after each `every_minutes` of training
    (`state[key]`: the last interval that fired); never when both are unset or 0."""
    if every_minutes:
        interval = int(wall_s // (60 * every_minutes))
        if interval > state.get(key, 0):
            state[key] = interval
            return True
        return False
    return bool(every_steps) and state["step"] % every_steps == 0


# flags that set a config field of the same name and change what training does: a resume must not differ in them
RECIPE_FLAGS = ("dropout", "attention_dropout", "relu_dropout", "label_smoothing", "bpe_dropout_source",
                "bpe_dropout_target", "bidirectional_epochs", "warmup", "lr_factor", "lr_fade", "weight_decay")
# flags that set a config field of the same name, the run's schedule (build_config)
SCHEDULE_FLAGS = ("max_tokens", "save_every", "save_every_minutes", "average_last", "max_steps")


def build_config(args, vocab_size, target_pieces=None, note=None):
    """The preset's config with the flags over it; `target_pieces(both_sides)`: the pieces the training
    data's targets hold (both sides' with bidirectional training, whose targets are both languages),
    called when the run's output layer (--output-vocab, or the preset's) is "target"; `note`
    (rank 0's log) is told when the preset's choice gives way to a flag."""
    over = {k: getattr(args, k) for k in RECIPE_FLAGS + SCHEDULE_FLAGS if getattr(args, k, None) is not None}
    over.update({field: getattr(args, flag) for flag, field in SIZE_FLAGS.items() if getattr(args, flag, None) is not None})
    if args.save_every is not None and args.save_every_minutes is None:
        over["save_every_minutes"] = None   # spacing in steps asked for: a resumed run keeps it
    if getattr(args, "attention", None) is not None:
        over["attention"] = args.attention
    cfg = TransformerConfig.preset(args.preset, arch=getattr(args, "arch", None) or "transformer",
                                   vocab_size=vocab_size, **over)
    layer = getattr(args, "output_vocab", None) or cfg.output_layer
    if layer == "target" and cfg.bpe_dropout_target:   # only the preset's choice gets here (the flags exclude it)
        if note:
            note("note: --bpe-dropout-target makes pieces the plain segmentation does not: the output layer scores "
                 "the joint vocabulary (--output-vocab joint) instead of the preset's target side")
        layer = "joint"
    if layer == "target" and target_pieces is not None:
        return dataclasses.replace(cfg, output_layer=layer, output_vocab=target_pieces(bool(cfg.bidirectional_epochs)))
    return dataclasses.replace(cfg, output_layer=layer)


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


# ------------------------------------------------------------------------------ the run
@dataclass
class Run:
    """What the steps of a run pass along. `state` is what a checkpoint saves besides the model
    and Adam: step, data position (epoch, batch), dropout stream position, wall time, ..."""
    args: argparse.Namespace
    world: distributed.World
    data: object                   # data.pipeline.Data: tokenizer, training pairs, valid and test text
    cfg: TransformerConfig
    model: object
    opt: Adam
    scaler: Optional[LossScaler]
    state: dict
    resume_path: Optional[str] = None
    stream: Optional["UpdateStream"] = None
    epoch_len: int = 1             # batches in an epoch (for the log's fractional epoch)
    validation: Optional[Validation] = None   # on every rank: each validates its share
    log: Optional[TrainLog] = None
    console: Optional[Console] = None
    start_wall: float = 0.0
    elapsed_mean: float = 0.0      # the ranks' mean seconds of training at the top of this update
    elapsed_lead: float = 0.0      # rank 0's, the same number on every rank (the validations' clock)
    window: dict = field(default_factory=dict)   # the losses since the last log record
    short_noted: bool = False      # note_a_short_run has spoken (or found the run long enough)
    budget_clock: Optional[tuple] = None   # (step, seconds of training) after this process's first update

    def epochs(self):
        """Epochs trained, with the fraction of the current one (an epoch of both directions, bidirectional
        training's, has about twice the batches of one direction's)."""
        epoch, batch = self.state["epoch"], self.state["batch"]
        return round(epoch + batch / (self.epoch_len * (2 if epoch < self.cfg.bidirectional_epochs else 1)), 3)

    @property
    def lead(self):
        """Rank 0: the one writer of logs, console, checkpoints and results."""
        return self.world.rank == 0

    def elapsed(self):
        """Seconds of training, earlier runs of a resumed one included."""
        return time.time() - self.start_wall

    def save(self, on_grid):
        """A checkpoint of this step (rank 0 only); `on_grid`: on the --save-every spacing."""
        self.state["train_wall_s"], self.state["on_grid"] = self.elapsed(), on_grid
        return save(self.args.out, self.state["step"], self.model, self.opt, self.data.tokenizer, self.state,
                    self.args.keep_last)


class UpdateStream:
    """The updates' batches in the global order, each collated on a background thread while the
    update before it computes. An update is (epoch, index, total, micro): rank r takes the r-th
    run of update_freq of the update's world size x update_freq batches, as micro [(j, batch)];
    `total` is the update's GLOBAL number of non-pad target tokens (the loss is normalised by it);
    (epoch, index) is the position of its last batch."""

    def __init__(self, batches, pairs_of, tok, per_update, update_freq, rank):
        self.batches, self.pairs_of, self.tok = batches, pairs_of, tok   # pairs_of(epoch): the epoch's TokenPairs
        self.per_update, self.update_freq, self.rank = per_update, update_freq, rank
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="minitf-batches")
        self.pending = self.pool.submit(self._collate)

    def _collate(self):
        micro, total = [], 0
        for j in range(self.per_update):
            epoch, index, idx = next(self.batches)
            pairs = self.pairs_of(epoch)
            total += int(pairs.tgt_lens[idx].sum(dtype=np.int64)) + len(idx)   # target + EOS
            if j // self.update_freq == self.rank:
                micro.append((j, to_batch(pairs, idx, self.tok)))
        return epoch, index, total, micro

    def next(self):
        update = self.pending.result()
        self.pending = self.pool.submit(self._collate)
        return update

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


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
    """The run under --out's lock (one run writes a folder at a time; rank 0 holds it for the job)."""
    with folder_lock(args.out, refuse_if_busy("--out", args.out)) if world.rank == 0 else contextlib.nullcontext():
        return _locked_train(args, world)


def _locked_train(args, world):
    """The run: set-up, the update loop, the end."""
    run = set_up(args, world)
    try:
        stop = run_loop(run)
    except KeyboardInterrupt:   # a second Ctrl-C: stopped at once, mid-update, so nothing is saved
        if run.lead:
            run.log.close()
            last = checkpoint_paths(args.out)
            log(f"interrupted again (SIGINT) at step {run.state['step']}: stopped without saving; --resume "
                f"continues from {last[-1] if last else 'the start'}")
        raise Interrupted("SIGINT") from None
    finally:
        run.stream.close()
        run.console.close()
    return end(run, stop)


# ------------------------------------------------------------------------------ set-up
def set_up(args, world):
    """Device, data (and the checkpoint to resume), model, optimizer, the batch stream, the log."""
    lead = world.rank == 0
    _prepare_device(args, world)
    ckpts = checkpoint_paths(args.out)
    if ckpts and not args.resume:
        raise ConfigError(f"--out {args.out} already holds checkpoints: pass --resume to continue, "
                          f"or choose another --out")
    resume = load_checkpoint(ckpts[-1]) if args.resume and ckpts else None
    if resume is not None:
        check_resumed(args.out, resume)
    data = _load_data(args, world, resume)
    cfg = _config(args, data, resume, lead)
    if resume is not None and lead:
        log(f"resuming from {resume.path} (step {resume.train_state['step']})")
    fp16 = getattr(args, "fp16", False)
    _agree(world, data_id=data.data_id, config=cfg.to_dict(), seed=args.seed, update_freq=args.update_freq,
           dtype=getattr(args, "dtype", "float32"), fp16=fp16, resume_step=resume.train_state["step"] if resume else 0,
           max_steps=args.max_steps, save_every=args.save_every, save_every_minutes=args.save_every_minutes,
           time_budget=args.time_budget)
    model = build_model(cfg, device=args.device, dtype="float16" if fp16 else getattr(args, "dtype", "float32"),
                        seed=args.seed)
    run = Run(args, world, data, cfg, model, Adam(model, lr=NoamSchedule(cfg.d_model, cfg.warmup, cfg.lr_factor),
                                                 weight_decay=cfg.weight_decay),
              LossScaler() if fp16 else None, new_state(args, data), resume.path if resume else None)
    if resume is not None:
        _restore(run, resume)
    if lead:
        _prepare_out(args.out)
        atomic_write(os.path.join(args.out, "config.json"), lambda f: f.write(json.dumps(
            {"model": cfg.to_dict(), "args": vars(args), "ranks": world.size,
             "tokenizer_sha256": hashlib.sha256(data.tokenizer.to_bytes()).hexdigest()}, indent=2).encode()))
        corpus = f"--train {args.train}" if args.train else args.dataset
        log(f"task: {corpus}, {args.src} -> {args.tgt}; the scores go to {os.path.join(args.out, 'results.json')}, "
            f"the model to {os.path.join(args.out, 'model.npz')}")
        log(f"model: {cfg.arch}, {model.num_parameters():,} parameters, preset {args.preset}, device {args.device}"
            + (f", {world.size} ranks" if world.size > 1 else "")
            + (f"; output layer over {cfg.output_ids().size:,} of the {cfg.vocab_size:,} pieces (--output-vocab target)"
               if cfg.output_vocab else "")
            + ("; pre-norm (--norm pre)" if cfg.norm_position == "pre" else ""))
        if not paper_bleu_available():   # said now, not after hours of training
            log("note: sacremoses is not installed, so the end of this run will report sacreBLEU and chrF but not "
                "the paper's tokenized BLEU; pip install 'minitf[paper]' (the gpu and dev extras include it)")
        if getattr(args, "preset_chosen", False) and resume is None:
            log(f"note: no --preset given: {args.preset}, the preset for --device {args.device} "
                + ("(sized for minutes on a CPU; --preset base is the paper's model, for GPUs)" if args.device == "cpu"
                   else "(the paper's base model)"))
    _open_stream(run)
    run.log = TrainLog(os.path.join(args.out, "train_log.jsonl"), enabled=lead)
    if lead and run.log.dropped:
        log(f"{run.log.path}: dropped its torn last line ({run.log.dropped} bytes, a record cut by a kill or a "
            f"full disk)")
    run.start_wall = time.time() - run.state["train_wall_s"]
    run.console = Console(run.state, args.max_steps, args.time_budget, quiet=args.quiet, enabled=lead)
    run.window = new_window()
    return run


def _prepare_device(args, world):
    if args.device == "gpu" and world.size > 1:
        world.use_gpu()   # the GPU of this rank's local rank, and the NCCL communicator
    if args.device == "cpu" and world.size > 1:
        threads = world.share_cores()   # this machine's cores split between its ranks' BLAS
        if world.rank == 0 and threads:
            log(f"{world.local_size} ranks on this machine: {threads} BLAS thread(s) each")
    get_xp(args.device)  # fail fast (before data and tokenizer work) when the device is unusable
    if world.rank == 0 and getattr(args, "fp16", False) and args.device == "cpu":
        log("warning: --fp16 on the CPU is very slow (NumPy has no float16 BLAS); it is meant for GPUs")


def _prepare_out(out):
    """--out is made once the data is ready (a failed download leaves no empty folder); the temporary
    files of a run killed while saving are removed."""
    os.makedirs(out, exist_ok=True)
    stale = leftover_temp_files(out, lambda name: bool(OUTPUT_NAMES.fullmatch(name)))
    for path in stale:
        os.unlink(path)
    if stale:
        log(f"removed {len(stale)} temporary file(s) of an earlier run killed while saving: "
            f"{', '.join(os.path.basename(p) for p in stale)}")


def check_resumed(out, resume):
    """The checkpoint --resume picked must be this run's: the step in its name is the step it
    records, and its model and tokenizer are the ones --out's config.json was written for (a
    checkpoint copied in from another run is refused before anything in the folder is written)."""
    name = os.path.basename(resume.path)
    named = int(re.fullmatch(r"checkpoint_(\d+)\.npz", name).group(1))
    recorded = resume.train_state.get("step")
    if recorded != named:
        raise ConfigError(f"--resume: {resume.path} is named step {named} but records step {recorded}: it is not "
                          f"this run's checkpoint; move it out of {out} (or start a new --out)")
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            recorded_run = json.load(f)
    except (OSError, ValueError):
        return   # no (readable) config.json: a run killed before writing it, or an older minitf
    if not isinstance(recorded_run, dict):
        return
    model = recorded_run.get("model")
    if isinstance(model, dict):
        ours = resume.config.to_dict()
        diff = [f"{k} {model.get(k)!r} in config.json, {ours.get(k)!r} in the checkpoint"
                for k in sorted(set(model) | set(ours)) if model.get(k) != ours.get(k)]
        if diff:
            raise ConfigError(f"--resume: {resume.path} is not this run's model: {'; '.join(diff[:4])}"
                              f"{' ...' if len(diff) > 4 else ''}; move it out of {out} (or start a new --out)")
    sha = recorded_run.get("tokenizer_sha256")
    if sha and resume.tokenizer and hashlib.sha256(resume.tokenizer).hexdigest() != sha:
        raise ConfigError(f"--resume: {resume.path} holds another tokenizer than the run's (config.json): it is "
                          f"not this run's checkpoint; move it out of {out} (or start a new --out)")


def _load_data(args, world, resume):
    """A resumed run encodes with its checkpoint's tokenizer, so its cache holds the same ids;
    rank 0 prepares the cache (and trains the tokenizer) once, the others then open it."""
    lead = world.rank == 0
    for turn in range(2 if world.size > 1 else 1):
        if lead == (turn == 0):
            try:
                data = load_data(args, tokenizer=Tokenizer.from_bytes(resume.tokenizer) if resume and resume.tokenizer
                                 else None, log=log if lead else (lambda msg: None),
                                 expect_data_id=resume.train_state.get("data_id") if resume else None, notes=lead)
            except StaleData as e:
                raise ConfigError(f"--resume: {resume.path} was trained on other data: {e}; restore it, "
                                  f"or start a new --out") from None
        world.barrier()
    return data


def _config(args, data, resume, lead=True):
    """The resumed checkpoint's config (a flag that would change it is an error), or the preset's
    with the flags over it; then the recipe's flags left unset (resolve_recipe)."""
    vocab_size = data.tokenizer.vocab_size
    if resume is None:
        cfg = build_config(args, vocab_size, lambda both: _target_pieces(data, vocab_size, both),
                           note=log if lead else None)
    else:
        cfg = resume.config
        for flag, name in (("arch", "arch"), ("attention", "attention"), ("output_vocab", "output_layer"),
                           *SIZE_FLAGS.items(), *zip(RECIPE_FLAGS, RECIPE_FLAGS)):
            asked = getattr(args, flag, None)
            if asked is not None and asked != getattr(cfg, name):
                dashed = flag.replace("_", "-")
                raise ConfigError(f"--{dashed} {asked}: the checkpoint {resume.path} was trained with --{dashed} "
                                  f"{getattr(cfg, name)}; drop the flag to resume it, or start a new --out")
        trained_on = resume.train_state.get("data_id")
        if trained_on is not None and trained_on != data.data_id:
            raise ConfigError(f"--resume: {resume.path} was trained on the binarized corpus {trained_on}, but the "
                              f"training data now gives {data.data_id} ({data.corpus.folder}); the corpus files or "
                              f"the cleaning flags (--max-len, --max-ratio) changed: restore them, or start a new --out")
    resolve_recipe(args, cfg)
    if cfg.vocab_size != vocab_size:
        raise ConfigError(f"the checkpoint's vocabulary ({cfg.vocab_size}) != the tokenizer's ({vocab_size})")
    return cfg


def _target_pieces(data, vocab_size, both_sides=False):
    """The pieces of the training data's target side (and source side, `both_sides`), with EOS (every
    sentence's last target) and the unknown piece (how a reference piece outside them is scored), as
    the config's output_vocab ranges."""
    ids = set(data.train.pieces(vocab_size).tolist()) | {UNK_ID, EOS_ID}
    if both_sides:
        ids |= set(data.train.pieces(vocab_size, side="source").tolist())
    return id_ranges(sorted(ids))


def new_state(args, data):
    return {"step": 0, "epoch": 0, "batch": 0, "forward_count": 0, "train_wall_s": 0.0, "train_tokens": 0,
            "nonfinite": 0, "data_id": data.data_id, "languages": [args.src, args.tgt]}


def _restore(run, resume):
    """Parameters, Adam's moments and step, the train state (and the loss scale) of a checkpoint."""
    run.model.load_state_dict(resume.params)
    run.opt.load_state_dict(resume.optimizer)
    run.state.update(resume.train_state)
    if run.scaler is not None and "loss_scale" in run.state:
        run.scaler.scale, run.scaler.good_steps = run.state["loss_scale"], run.state["good_steps"]


def _open_stream(run):
    """Plan the batches from the saved position on, and the stream of updates over them."""
    from .data import iterate_batches, token_batches
    args, world, pairs = run.args, run.world, run.data.train
    per_update = world.size * args.update_freq   # batches of one update, over all ranks
    max_tokens = run.cfg.batch_tokens(world.size, args.update_freq)
    if run.resume_path is not None and run.state.get("batch_tokens", max_tokens) != max_tokens:
        raise ConfigError(f"--resume: {run.resume_path} was trained with batches of {run.state['batch_tokens']} "
                          f"tokens, but {world.size} rank(s) x --update-freq {args.update_freq} make batches of "
                          f"{max_tokens} (the preset's {run.cfg.update_tokens} tokens per update split over them): "
                          f"resume with the run's ranks and --update-freq, or start a new --out")
    run.state["batch_tokens"] = max_tokens
    corpus = _bpe_dropout(run) or _both_directions(run)   # the pairs of each epoch, when they change
    lengths = corpus.lengths if corpus else (lambda epoch: (pairs.src_lens, pairs.tgt_lens))
    first = token_batches(*lengths(run.state["epoch"]), max_tokens, args.seed, run.state["epoch"])
    release_freed_memory()   # the sort's temporaries: hundreds of MB for a 36M-pair corpus
    run.epoch_len = len(first)   # for the log's fractional epoch (other epochs differ by a few batches)
    if run.state["epoch"] < run.cfg.bidirectional_epochs:
        run.epoch_len = (len(first) + 1) // 2   # of an epoch of one direction (an epoch of both has twice the batches)
    if per_update > run.epoch_len:
        raise ConfigError(f"{world.size} ranks x --update-freq {args.update_freq} = {per_update} batches per update, "
                          f"but an epoch has only {run.epoch_len}: use fewer ranks, a smaller --update-freq or "
                          f"--max-tokens")
    batches = iterate_batches(pairs.src_lens, pairs.tgt_lens, max_tokens, args.seed, run.state["epoch"],
                              run.state["batch"], first=first, after_plan=release_freed_memory, lengths=lengths)
    if run.lead:
        log(f"train: {len(pairs.src_lens):,} pairs in {run.epoch_len:,} batches per epoch; tokens per side (padding "
            f"included), at most: {max_tokens:,} per batch, {args.update_freq * max_tokens:,} per rank "
            f"({args.update_freq} batch{'es' if args.update_freq > 1 else ''}), {per_update * max_tokens:,} per update "
            f"({world.size} rank{'s' if world.size > 1 else ''})")
        note_a_short_run(run, start=True)
    if len(run.data.valid[0]):
        run.validation = Validation(run.data.valid, run.data.tokenizer, max_tokens, args.valid_bleu_sentences,
                                    args.decode_batch, world)
    run.stream = UpdateStream(batches, corpus.epoch if corpus else (lambda epoch: pairs), run.data.tokenizer,
                              per_update, args.update_freq, world.rank)


def _both_directions(run):
    """Bidirectional training's pairs of each epoch (None when the config's bidirectional_epochs is 0)."""
    epochs = run.cfg.bidirectional_epochs
    if not epochs:
        return None
    from .data.bidirectional import Bidirectional
    if run.lead:
        src, tgt, n = run.args.src, run.args.tgt, len(run.data.train)
        log(f"bidirectional training: {'epoch 1' if epochs == 1 else f'epochs 1-{epochs}'} on the {n:,} pairs in both "
            f"directions ({src} -> {tgt} and {tgt} -> {src}, {2 * n:,} pairs an epoch), then {src} -> {tgt} alone")
    return Bidirectional(run.data.train, epochs)


def _bpe_dropout(run):
    """The BPE-dropout resegmenter of the training pairs (None when the config's p are 0)."""
    p = (run.cfg.bpe_dropout_source, run.cfg.bpe_dropout_target)
    if not any(p):
        return None
    from .data.resegment import BPEDropout
    t0 = time.time()
    resegment = BPEDropout(run.data.train, run.data.tokenizer, p, run.args.seed)
    growth = resegment.growth(run.state["epoch"])
    if run.lead:
        log(f"BPE-dropout: {', '.join(f'{side} p {q}' for side, q in zip(('source', 'target'), p) if q)}; each epoch "
            f"segments the training sentences anew ({', '.join(f'{side} {g:.2f}x' for side, g in growth.items())} the "
            f"pieces of plain BPE in epoch {run.state['epoch']}; {time.time() - t0:.1f} s)")
    return resegment


# ------------------------------------------------------------------------------ the loop
def run_loop(run):
    """Updates until --max-steps, the --time-budget or a signal; returns why it stopped: "max_steps",
    "time_budget", or the signal ("SIGTERM", or "SIGTERM on another rank" under mpiexec)."""
    signals = StopSignals(run.world.size, notify=run.console.line_from_a_signal_handler if run.lead else None)
    run.model.train()
    with signals:
        while True:
            stop = should_stop(run, signals)
            if stop:
                return stop
            update = run.stream.next()   # collated while the last update computed
            done = take_step(run, update)
            if done is not None:
                after_step(run, *done)


def should_stop(run, signals):
    """One decision on every rank, at the top of each update: the step limit, the time budget (any
    rank over it stops them all), a signal on any rank."""
    args = run.args
    if args.max_steps and run.state["step"] >= args.max_steps:
        return "max_steps"
    if args.patience and run.state.get("valid_since_best", 0) >= args.patience:   # same on every rank
        return "patience"
    elapsed = run.elapsed()
    # One snapshot of the signals, read before the all-reduce and used after it: a signal landing
    # during the all-reduce is seen by every rank at the next update, never by this rank alone now
    # (which would leave the others waiting in the next update's all-reduce).
    received = list(signals.received)
    over_budget, term, interrupt, elapsed_sum, elapsed_lead = run.world.allreduce_numbers(
        [bool(args.time_budget and elapsed >= args.time_budget), "SIGTERM" in received, "SIGINT" in received,
         elapsed, elapsed if run.lead else 0.0])
    run.elapsed_mean = elapsed_sum / run.world.size
    run.elapsed_lead = elapsed_lead   # rank 0's plus zeros: exactly rank 0's on every rank
    if over_budget:
        return "time_budget"
    if received:
        return received[0]
    if term or interrupt:
        return f"{'SIGTERM' if term else 'SIGINT'} on another rank"
    return None


def take_step(run, update):
    """Forward, backward, the all-reduce and Adam's step of one update. Returns (loss_sum, nll_sum,
    tokens, lr), or None when the update was skipped (a float16 overflow, a non-finite loss)."""
    args, state, model, scaler = run.args, run.state, run.model, run.scaler
    epoch, index, total, micro = update
    loss_sum, nll_sum = forward_backward(model, micro, total, state["forward_count"], scaler)
    run.world.allreduce_sum(model.flat_grads)   # every rank now holds the update's whole gradient
    loss_sum, nll_sum, grads_finite = step_stats(model, loss_sum, nll_sum)
    loss_sum, nll_sum = run.world.allreduce_numbers([loss_sum, nll_sum])
    done = not _skipped(run, np.isfinite(loss_sum), grads_finite)
    if done:
        if scaler is not None:
            scaler.update(True)
            state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
        lr = run.opt.step(grad_divisor=scaler.scale if scaler else 1.0,
                          lr_scale=fade(run_progress(args, state["step"], run.elapsed_mean), run.cfg.lr_fade))
        state["step"] += 1
        state["train_tokens"] += total
    # the update is complete (made or skipped): only now does the saved position move past its batches
    state["epoch"], state["batch"] = epoch, index + 1
    state["forward_count"] += run.world.size * args.update_freq
    return (loss_sum, nll_sum, total, lr) if done else None


def _skipped(run, loss_finite, grads_finite):
    """The skip rules: a float16 overflow (smaller loss scale) or a non-finite loss (counted; too
    many in a row end the run). Logs the skip; True when the update is not made."""
    state, scaler = run.state, run.scaler
    if scaler is not None and loss_finite and not grads_finite:
        scaler.update(False)
        state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
        run.log.write({"step": state["step"], "event": "overflow_skipped", "loss_scale": scaler.scale})
        return True
    if not (loss_finite and grads_finite):
        state["nonfinite"] += 1
        run.log.write({"step": state["step"], "event": "nonfinite_loss_skipped", "count": state["nonfinite"]})
        if state["nonfinite"] >= run.args.max_nonfinite:
            raise MinitfError(f"{state['nonfinite']} non-finite losses in a row at step {state['step']}: "
                              f"lower --lr-factor or raise --warmup, then --resume")
        return True
    state["nonfinite"] = 0
    return False


def after_step(run, loss_sum, nll_sum, tokens, lr):
    """The log record every --log-every updates, validation every --valid-every, the checkpoint on
    the --save-every spacing."""
    args, state, w = run.args, run.state, run.window
    w["loss"] += loss_sum
    w["nll"] += nll_sum
    w["n"] += tokens
    run.console.update(state["step"], run.elapsed())
    if run.lead and not run.short_noted:   # the rate of 30 s of updates says how many the budget makes
        if run.budget_clock is None:
            run.budget_clock = (state["step"], run.elapsed())
        elif run.elapsed() - run.budget_clock[1] >= 30:
            note_a_short_run(run)
    if state["step"] % args.log_every == 0:
        dt = time.time() - w["t0"]
        rec = {"step": state["step"], "epoch": run.epochs(),
               "loss": round(w["loss"] / w["n"], 4), "nll": round(w["nll"] / w["n"], 4),
               "ppl": perplexity(w["nll"] / w["n"]), "lr": lr,
               "tokens_per_s": round(w["n"] / dt, 1), "wall_s": round(run.elapsed(), 1)}
        run.log.write(rec)
        run.console.show(rec)
        run.window = new_window()
    # every rank validates (its share) at the same steps: the minutes' grid reads rank 0's clock
    if run.validation and on_grid(state, "valid_interval", args.valid_every, args.valid_every_minutes,
                                  run.elapsed_lead):
        validate(run)
    if run.lead and on_save_grid(args, state, run.elapsed()):
        run.save(on_grid=True)


def short_run_ends(args, warmup, step, wall_s, clock):
    """(updates the run makes, how that is known) when that is under twice the learning-rate warmup,
    else None: --max-steps, and under a --time-budget the rate since `clock` (step, seconds of
    training; None: not known yet) projected to the budget's end."""
    ends = [(args.max_steps, f"--max-steps {args.max_steps:,}")] if args.max_steps else []
    if args.time_budget and clock is not None and wall_s > clock[1] and step > clock[0]:
        rate = (step - clock[0]) / (wall_s - clock[1])
        ends.append((int(step + rate * max(args.time_budget - wall_s, 0)),
                     f"{rate:.1f} updates/s for --time-budget {args.time_budget:g}s"))
    if not ends or min(ends)[0] >= 2 * warmup:
        return None
    return min(ends)


def note_a_short_run(run, start=False):
    """A run that ends inside its learning-rate warmup (or before twice its length) says so, once:
    at the start from --max-steps; under a --time-budget after 30 s of training, from the rate of
    those updates (after_step keeps the clock). Rank 0 only."""
    args = run.args
    if start:
        ends = short_run_ends(args, run.cfg.warmup, 0, 0.0, None)
        run.short_noted = ends is not None or not args.time_budget
    else:
        ends = short_run_ends(args, run.cfg.warmup, run.state["step"], run.elapsed(), run.budget_clock)
        run.short_noted = True
    if ends is None:
        return
    updates, why = ends
    where = "inside" if updates < run.cfg.warmup else "soon after the end of"
    log(f"note: this run makes about {plural(updates, 'update')} ({why}), ending {where} the learning rate's "
        f"{run.cfg.warmup:,}-update warmup: expect a much weaker model than a full run of the preset (the README "
        f"gives figures for short budgets); a longer budget, or a shorter --warmup, changes that")


def validate(run):
    """Validation loss, perplexity and greedy BLEU (every rank its share), logged and printed; a
    new best BLEU (the loss when BLEU is off) is saved by rank 0 as checkpoint_best.npz, without
    Adam's state."""
    state = run.state
    rec = {"step": state["step"], **run.validation.run(run.model)}
    state["valid_s"], state["valid_step"] = round(state.get("valid_s", 0.0) + rec["valid_s"], 2), state["step"]
    metric = "valid_bleu" if rec["valid_bleu"] is not None else "valid_loss"
    value = rec[metric] if metric == "valid_bleu" else -rec[metric]
    best = state.get("best_valid")
    note = ""
    state["valid_since_best"] = state.get("valid_since_best", 0) + 1   # validations since the best (--patience)
    if best is None or best["metric"] != metric or value > best["value"]:
        state["valid_since_best"] = 0
        state["best_valid"] = {"metric": metric, "value": value, "step": state["step"], "valid_bleu": rec["valid_bleu"],
                               "valid_loss": rec["valid_loss"]}
        if run.lead:
            save_checkpoint(os.path.join(run.args.out, BEST), run.model, tokenizer=run.data.tokenizer.to_bytes(),
                            train_state={**state, "best": True})
        note = f" | best so far -> {BEST}"
    elif run.args.patience:
        note = f" | no better than step {best['step']} for {plural(state['valid_since_best'], 'validation')} " \
               f"(--patience {run.args.patience})"
    run.log.write(rec)
    run.console.line(run.validation.describe(rec) + note)


def new_window():
    return {"loss": 0.0, "nll": 0.0, "n": 0, "t0": time.time()}


class StopSignals:
    """SIGTERM and Ctrl-C's SIGINT become a flag the loop reads at the top of each update: a run
    stops between two updates, never inside one (so its checkpoint is the position after the last
    completed update), and under mpiexec every rank at the same update, none mid all-reduce. In
    one process a second Ctrl-C stops at once (KeyboardInterrupt), without saving. The handlers
    before are back on leaving. `received`: the names of the signals that arrived, in order."""

    def __init__(self, world_size, notify=None):
        self.second_interrupt_raises, self.notify = world_size == 1, notify
        self.received, self.before = [], {}

    def _flag(self, signum, frame):
        name = signal.Signals(signum).name
        self.received.append(name)
        if self.notify is not None and len(self.received) == 1:
            again = " (Ctrl-C again: stop at once, without saving)" if self.second_interrupt_raises else ""
            self.notify(f"{name}: stopping after the update in progress, then saving{again}")
        if signum == signal.SIGINT and self.second_interrupt_raises:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __enter__(self):
        self.before = {s: signal.signal(s, self._flag) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.before.items():
            signal.signal(s, handler)


# ------------------------------------------------------------------------------ the end
def end(run, stop):
    """After the loop: on a signal, save and raise Interrupted; else the last checkpoint, then on
    rank 0 the average, the translations and the scores (finish)."""
    args, state = run.args, run.state
    if stop not in ("max_steps", "time_budget", "patience"):
        if run.lead:
            path = run.save(on_grid=False)
            run.log.close()
            log(f"interrupted ({stop}) at step {state['step']}: saved {path}; continue with --resume")
        raise Interrupted(stop.split()[0])
    validated = False
    if run.validation and (args.valid_every or args.valid_every_minutes) and state.get("valid_step") != state["step"]:
        validate(run)   # the final model too (every rank), so that checkpoint_best.npz is the best of the whole run
        validated = True
    if not run.lead:
        return None
    last = checkpoint_paths(args.out)
    saved = bool(last) and last[-1].endswith(f"{state['step']:07d}.npz")
    state["train_wall_s"] = run.elapsed()
    if not saved or validated:
        run.save(on_grid=saved and state.get("on_grid", False))   # off the spacing unless it was saved on it
    why = (f"patience: validation {'BLEU' if state['best_valid']['metric'] == 'valid_bleu' else 'loss'} no better "
           f"than step {state['best_valid']['step']}'s for {args.patience} validations" if stop == "patience" else stop)
    log(f"training stopped ({why}) at step {state['step']} after {state['train_wall_s']:.0f}s")
    state["epochs"] = run.epochs()
    try:
        with sigterm_raises():
            results = finish(run)
        print_summary(summary_lines(results, args.out, args.tgt))
        return results
    except (KeyboardInterrupt, Interrupted) as e:   # while averaging or translating: training itself is saved
        signame = e.signame if isinstance(e, Interrupted) else "SIGINT"
        chosen = os.path.join(args.out, "model.npz")
        log(f"interrupted ({signame}) during the final evaluation: the checkpoints in {args.out} are complete; "
            f"score {'the model the run chose' if os.path.exists(chosen) else 'one'} with `python -m minitf evaluate "
            f"--checkpoint {chosen if os.path.exists(chosen) else checkpoint_paths(args.out)[-1]} --src ... --ref ...`")
        raise Interrupted(signame) from None
    finally:
        run.log.close()


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Interrupted("SIGTERM") wherever it lands, as Ctrl-C raises KeyboardInterrupt
    (after training, where nothing is left to save)."""
    def handler(signum, frame):
        raise Interrupted("SIGTERM")
    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def averaging_window(paths, average_last):
    """The checkpoints averaged at the end: the run's final checkpoint and the evenly spaced ones
    before it (paper 6.1: the last K written at even intervals; fairseq too averages the last K,
    the final one included), at most `average_last` in all, and only from the second half of the
    run: a short run's first checkpoints, made in the warmup, would pull the average back. An
    off-spacing checkpoint before the final one (saved at an interrupt) is left out."""
    final = paths[-1]
    half = step_of(final) / 2
    spaced = [p for p in paths[:-1] if step_of(p) >= half and read_train_state(p).get("on_grid", True)]
    return (spaced[-(average_last - 1):] if average_last > 1 else []) + [final]


def step_of(path):
    return int(os.path.basename(path)[len("checkpoint_"):-len(".npz")])


def choose_model(run):
    """Average the window into OUT/averaged.npz, then report whichever of the average and the last
    checkpoint has the lower validation loss, written as OUT/model.npz (without Adam's state) and
    loaded into run.model. Returns what results.json says about it."""
    args, model = run.args, run.model
    paths = checkpoint_paths(args.out)
    last, window = paths[-1], averaging_window(paths, args.average_last)
    avg_path = os.path.join(args.out, "averaged.npz")
    average_checkpoints(window, avg_path)
    candidates = {"averaged": load_checkpoint(avg_path)}
    if len(window) > 1:
        candidates["last"] = load_checkpoint(last)
    losses = {}   # name -> (loss, nll) on the validation set
    for name, ckpt in candidates.items() if run.validation else ():
        model.load_state_dict(ckpt.params)
        losses[name] = evaluate_loss(model, run.validation.batches)
    chosen = min(losses, key=lambda name: (losses[name][0], name != "averaged")) if losses else "averaged"
    ckpt, used = candidates[chosen], [os.path.basename(c) for c in (window if chosen == "averaged" else [last])]
    model.load_state_dict(ckpt.params)
    model.eval()
    save_checkpoint(os.path.join(args.out, "model.npz"), params=ckpt.params, config=ckpt.config, tokenizer=ckpt.tokenizer,
                    train_state={"model": chosen, "from": used, "step": run.state["step"],
                                 "languages": run.state["languages"]})
    spacing = f"every {args.save_every_minutes:g} min" if args.save_every_minutes else f"every {args.save_every} steps"
    names = ", ".join(os.path.basename(c) for c in window)
    log(f"averaged {plural(len(window), 'checkpoint')} ({spacing} and the final one, from the run's second half: "
        f"{names}) -> {avg_path}")
    if len(losses) > 1:
        log(f"validation loss: {losses['averaged'][0]:.4f} the average, {losses['last'][0]:.4f} the last checkpoint "
            f"({os.path.basename(last)}); the run reports {'the average' if chosen == 'averaged' else 'the last checkpoint'}"
            f" (OUT/model.npz)")
    loss = {name: round(losses[name][0], 4) if name in losses else None for name in ("averaged", "last")}
    if len(window) == 1:
        loss["last"] = loss["averaged"]   # the average of the last checkpoint alone
    nll = losses[chosen][1] if losses else None
    return {"model": chosen, "model_checkpoints": used, "averaged_checkpoints": [os.path.basename(c) for c in window],
            "valid_loss_averaged": loss["averaged"], "valid_loss_last": loss["last"], "valid_loss": loss[chosen],
            "valid_ppl": perplexity(nll) if losses else None}


def plural(n, word):
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def finish(run):
    """The model the run reports (choose_model), then the valid and test sets translated with
    beam search and scored: OUT/<set>.hyp.<tgt>, OUT/results.json, which names the model."""
    from .translate import score, translate_lines
    args, model, tok, data, state = run.args, run.model, run.data.tokenizer, run.data, run.state
    results = {"steps": state["step"], "epochs": state["epochs"], "train_wall_s": round(state["train_wall_s"], 1),
               "train_tokens_per_s": round(state["train_tokens"] / max(state["train_wall_s"], 1e-9), 1),
               **choose_model(run), "beam": args.beam, "alpha": args.alpha,
               "bleu": {}, "chrf": {}, "sacrebleu_signature": None, "chrf_signature": None,
               "bleu_paper": {}, "bleu_paper_method": None, "validation_s": state.get("valid_s", 0.0),
               "best_valid": state.get("best_valid")}
    which = "the average" if results["model"] == "averaged" else f"the last checkpoint, {results['model_checkpoints'][0]}"
    sets = {"valid": data.valid, **data.tests}
    for name, (src, ref) in sets.items():
        t0 = time.time()
        hyps = translate_lines(model, tok, src, args.beam, args.alpha, args.decode_batch, progress=not args.quiet)
        s = score(hyps, ref, lang=args.tgt)
        atomic_write(os.path.join(args.out, f"{name}.hyp.{args.tgt}"), lambda f: f.write("".join(h + "\n" for h in hyps).encode()))
        results["bleu"][name], results["chrf"][name] = s["bleu"], s["chrf"]
        results["sacrebleu_signature"], results["chrf_signature"] = s["bleu_signature"], s["chrf_signature"]
        results["bleu_paper"][name], results["bleu_paper_method"] = s["bleu_paper"], s["bleu_paper_method"]
        run.log.write({"step": state["step"], "eval": name, "model": results["model"], "bleu": s["bleu"],
                       "chrf": s["chrf"], "bleu_paper": s["bleu_paper"], "decode_s": round(time.time() - t0, 1)})
        paper = f" (paper's tokenized BLEU {s['bleu_paper']})" if s["bleu_paper"] is not None else ""
        log(f"{name}: BLEU {s['bleu']}{paper} chrF {s['chrf']} (sacreBLEU, beam {args.beam}, all {len(src):,} "
            f"sentences, {time.time() - t0:.0f}s; {which})")
    if results["bleu_paper"] and None in results["bleu_paper"].values():
        log(f"note: the paper's tokenized BLEU was {results['bleu_paper_method']}")
    atomic_write(os.path.join(args.out, "results.json"), lambda f: f.write(json.dumps(results, indent=2).encode()))
    return results
