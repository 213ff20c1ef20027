"""The training loop behind train_wmt.py: data -> tokenizer -> batches -> Adam with the
paper's schedule (5.3) -> checkpoints -> averaged model -> beam search -> sacreBLEU (6.1).

`train` reads as its three steps: `set_up` (device, data, the checkpoint to resume, model,
optimizer, the batch feed: a `Run`), `run_loop` (each update: `should_stop`, `take_step`,
`after_step`), and `end` (the last checkpoint, then `finish`: averaging, decoding, scores).

Resumable exactly: a checkpoint stores the parameters, Adam's moments and step, the data
position (epoch, batch index), and the dropout masks' position (model.forward_count), so
`--resume` replays the same batches, masks and losses as a run that never stopped.
"""
import argparse
import contextlib
from dataclasses import dataclass, field
import hashlib
import json
import os
import signal
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np

from .backend import dtype_named, get_xp, gpu_arch, is_gpu, to_numpy
from .checkpoint import load_checkpoint, save_checkpoint
from .config import FLAG_FIELDS, Config, shown
from .data.binarized import StaleData
from .data.pipeline import DataSettings, load_data
from .data.prepare import dropped_note
from .data.tokenizer import tokenizer_from_bytes
from . import distributed, gemm
from .errors import (SIGNAL_EXIT, CheckpointError, ConfigError, Interrupted, MinitfError, nothing_half_written,
                     out_of_memory, signals_held, sigterm_raises)
from .feed import UpdateFeed, open_feed
from .kernels import accum_dtype
from .modelfile import read_model
from .architectures import build_model
from .optim import Adam, LossScaler, UpdateCheck
from .recipe import on_grid, on_save_grid, resolve_config, run_progress, short_run_ends
from .runfolder import (BEST, RECORD, RESUMED_GROUPS, RUN_PATHS, check_fresh_out, check_resumed, check_resumed_flags,
                        checkpoint_paths, choose_model, prepare_out, read_run_record, save, settle_leftovers)
from .schedule import NoamSchedule, fade, learning_rate
from .fileio import WriteFailed, atomic_write, folder_lock, refuse_if_busy
from .trainlog import Console, TrainLog, log, plural, print_summary, reported_model, summary_lines
from .translate import paper_bleu_available
from .validation import Validation, perplexity


# ------------------------------------------------------------------------------ one update
def forward_backward(model, micro, total, forward_count, scaler=None, check=None):
    """The gradient of one update: zero the gradients, then forward and backward each of its
    micro-batches [(j, (src, tgt_in, tgt_out, n))]. The update's loss is the token-weighted
    mean over them, so micro-batch j's backward weighs n / total (n its tokens, total the
    update's), times the float16 loss scale: the host's (scaler.scale; Adam.step's grad_divisor
    undoes it), or with an UpdateCheck the one on the device (check.loss_scale; Adam's kernel
    divides by it).
    Returns the token-summed loss and NLL (device scalars on a GPU: no sync)."""
    model.zero_grad()
    loss_sum = nll_sum = None
    on_device = check is not None
    for j, (src, tgt_in, tgt_out, n) in micro:
        model.forward_count = forward_count + j   # dropout masks: (seed, global batch index)
        weight = (scaler.scale if scaler and not on_device else 1.0) * n / total
        model.forward_backward(src, tgt_in, tgt_out, loss_weight=weight,
                               loss_scale=check.loss_scale if on_device else None)
        stats = model.last_stats   # the loss times the batch's n tokens, and the NLL sum
        loss_sum = stats["loss_sum"] if loss_sum is None else loss_sum + stats["loss_sum"]
        nll_sum = stats["nll_sum"] if nll_sum is None else nll_sum + stats["nll_sum"]
    return loss_sum, nll_sum


def step_stats(model, loss_sum, nll_sum):
    """(loss_sum, nll_sum, grads_finite) on the host with ONE device->host copy (as torch's
    GradScaler reads its overflow flag): how an update ends where the outcome is not decided on
    the device (the CPU; a GPU without the fused Adam or with MINITF_HOST_CHECK=1). On a GPU that
    copy waits for the GPU."""
    xp = model.xp
    dt = accum_dtype(model.dtype) if is_gpu(xp) else np.float64   # the values' own precision (float32 for a float32 or 16-bit model)
    both = xp.stack([xp.asarray(loss_sum, dtype=dt), xp.asarray(nll_sum, dtype=dt),
                     xp.isfinite(model.flat_grads).all().astype(dt)])
    loss_sum, nll_sum, finite = (float(v) for v in to_numpy(both))
    return loss_sum, nll_sum, finite == 1.0


# ------------------------------------------------------------------------------ the run
@dataclass
class Pending:
    """An update whose outcome is on the device: its batches' place, its tokens and rate, and the
    copy of UpdateCheck's outcome the host reads an update later (settle)."""
    epoch: int
    index: int
    total: int
    lr: float
    outcome: object   # backend.HostCopy


@dataclass
class Run:
    """What the steps of a run pass along. `state` is what a checkpoint saves besides the model
    and Adam: step, data position (epoch, batch), the dropout masks' position, wall time, ..."""
    args: argparse.Namespace
    world: distributed.World
    data: object                   # data.pipeline.Data: tokenizer, training pairs, valid and test text
    cfg: Config
    model: object
    opt: Adam
    scaler: Optional[LossScaler]
    state: dict
    resume_path: Optional[str] = None
    feed: Optional[UpdateFeed] = None   # the updates' batches
    epoch_len: int = 1             # batches in an epoch (for the log's fractional epoch)
    both_len: int = 0              # batches in this start's first epoch where it reads both directions, else 0
    validation: Optional[Validation] = None   # on every rank: each validates its share
    log: Optional[TrainLog] = None
    console: Optional[Console] = None
    start_wall: float = 0.0
    elapsed_mean: float = 0.0      # the ranks' mean seconds of training at the top of this update
    elapsed_lead: float = 0.0      # rank 0's, the same number on every rank (the validations' clock)
    window: dict = field(default_factory=dict)   # the losses since the last log record
    short_noted: bool = False      # note_a_short_run has spoken (or found the run long enough)
    budget_clock: Optional[tuple] = None   # (step, seconds of training) after this process's first update
    check: Optional[UpdateCheck] = None   # a GPU's: each update's outcome decided on the device (take_step)
    pending: Optional[Pending] = None     # the update the device has decided and the host not yet read

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
        """A checkpoint of this step (rank 0 only); `on_grid`: on the --save-every spacing. Saved again at the same step
        (after the final validation, at a signal), a checkpoint saved on the spacing stays on it."""
        again = os.path.isfile(os.path.join(self.args.out, f"checkpoint_{self.state['step']:07d}.npz"))
        on_grid = on_grid or (again and self.state.get("on_grid", False))
        self.state["train_wall_s"], self.state["on_grid"] = self.elapsed(), on_grid
        w = self.window   # the log's sums since its last record: a resumed run's next record averages the same updates
        self.state["log_window"] = {"loss": float(w["loss"]), "nll": float(w["nll"]), "n": int(w["n"]),
                                    **({"lr": float(w["lr"])} if w.get("lr") is not None else {})}
        try:
            return save(self.args.out, self.state["step"], self.model, self.opt, self.data.tokenizer, self.state,
                        self.args.keep_last)
        except WriteFailed as e:   # the file-size limit, an I/O error: where to go on from
            last = checkpoint_paths(self.args.out)
            raise MinitfError(f"{e}; the run stopped: --resume continues from {last[-1] if last else 'the start'}") \
                from None


MEMORY_KNOBS = "--max-tokens, the model size (--preset, --d-model, ...) or --decode-batch"   # what sizes a run's memory


def train(args):
    """Train as train_wmt.py's flags say; under mpiexec, on every rank (distributed.py). An error on
    any rank prints that rank's message and aborts the whole job (MPI Abort), never a hang."""
    world = distributed.init()
    try:
        try:
            return _train(args, world)
        except OSError as e:   # a read-only folder, a link to nowhere: one line naming the file, as the others
            if e.filename is None:
                raise
            raise MinitfError(f"{e.filename}: {e.strerror or e}") from None
    except MinitfError as e:
        if world.size == 1:
            raise
        distributed.said_once(world, f"error: {e}")
        world.abort(2)
    except KeyboardInterrupt as e:   # Ctrl-C or SIGTERM outside the update loop's agreed stop (the data being
        if world.size == 1:          # prepared): the other ranks may be waiting in a collective, so the job is ended
            raise
        name = getattr(e, "signame", "SIGINT")   # errors.Terminated's
        distributed.said_once(world, f"interrupted ({name}) before training began: {nothing_half_written(e)}; "
                                     f"run the command again" + (" (with --resume to continue)" if args.resume else ""))
        world.abort(SIGNAL_EXIT[name])
    except MemoryError as e:   # the one line a single process gives (train_cli.main), from the rank that ran out
        if world.size == 1:
            raise
        log(f"rank {world.rank}: error: {out_of_memory(e, MEMORY_KNOBS)}")
        world.abort(2)
    except Exception:
        if world.size == 1:
            raise
        import traceback
        log(f"rank {world.rank}: unexpected error:\n{traceback.format_exc()}")
        world.abort(1)


# flags outside the config that every rank must share: the loop's stops, spacings and validation run as collectives (a
# --valid-every of its own had crashed MPICH, a --patience of its own hung the job), rank 0 writes --out
AGREED_FLAGS = ("max_steps", "save_every", "save_every_minutes", "time_budget", "valid_every", "valid_every_minutes",
                "valid_bleu_sentences", "patience", "decode_batch", "max_nonfinite", "log_every", "out", "keep_last",
                "average_last", "beam", "alpha")


def _agree(world, **facts):
    """ConfigError on every rank when the ranks were launched with different data or flags; the
    message names only what differs (`--dropout 0.1 (rank 0) vs 0.3 (rank 1)`), the config's fields
    one by one, by the flag that sets each (config.FLAG_FIELDS), else as "the config's <field>"."""
    flag = {field: name for name, field in FLAG_FIELDS.items()}
    plain = {"data_id": "the data (data_id)", "resume_step": "the resumed step"}

    def named(f):   # {what the user calls it: value}
        out = {}
        for k, v in f.items():
            for key, value in (v.items() if k == "config" else [(k, v)]):
                if k == "config" and key not in flag and key not in plain:
                    out[f"the config's {key}"] = key, value
                    continue
                label = plain.get(key) or "--" + flag.get(key, key).replace("_", "-")
                out[f"the config's {key}" if k == "config" and key in f else label] = key, value
        return out

    every = [named(f) for f in world.allgather(facts)]
    for rank, other in enumerate(every):
        diff = [f"{k} {shown(key, v)} (rank 0) vs {shown(key, other.get(k, (key, None))[1])} (rank {rank})"
                for k, (key, v) in every[0].items() if other.get(k, (key, None))[1] != v]
        if diff:
            raise ConfigError(f"the ranks disagree: {'; '.join(diff)}; launch every rank with the same flags and "
                              f"files")


def _train(args, world):
    """The run under --out's lock (one run writes a folder at a time; rank 0 holds it for the job)."""
    with folder_lock(args.out, refuse_if_busy("--out", args.out)) if world.rank == 0 else contextlib.nullcontext():
        return _locked_train(args, world)


def _locked_train(args, world):
    """The run: set-up, the update loop, the end."""
    run = set_up(args, world)
    try:
        try:
            stop = run_loop(run)
        except BaseException as e:
            _close_the_loop(run)
            if isinstance(e, KeyboardInterrupt):   # a second Ctrl-C: stopped at once, mid-update, so nothing is saved
                _stopped_unsaved(run, getattr(e, "signame", "SIGINT"), "again")
            raise
        # the loop has given its signal handlers back: a first signal while the run's end is recorded is held, then
        # stops the run as one in the last update does (saved: it had been taken for a second Ctrl-C, unsaved)
        with signals_held() as got:
            try:
                if stop in ENDS and run.window["n"] > 0:   # updates since the last record (--log-every): the run's
                    log_record(run, tail=True)   # end is recorded too, while the console shows it (again by a resume
                    # that makes the end again: the record was dropped with the end's scores, its window kept)
            finally:
                _close_the_loop(run)
        if got and stop in ENDS:
            signame = signal.Signals(got[0]).name
            if world.size > 1:   # the other ranks may be in the end's collectives already: the job ends, unsaved
                if not run.lead:
                    log(f"rank {world.rank}: interrupted ({signame}) as training ended: the job ends; --resume "
                        f"continues from the last checkpoint")
                _stopped_unsaved(run, signame)
            stop = signame
        return end(run, stop)
    except KeyboardInterrupt as e:   # a signal outside the windows that hold or agree on them
        _stopped_unsaved(run, getattr(e, "signame", "SIGINT"))


def _close_the_loop(run):
    """The batch feed's worker and the console's progress line, ended."""
    run.feed.close()
    run.console.close()


def _stopped_unsaved(run, signame, again=""):
    """A signal that stopped the run where it could not save: the last checkpoint is what --resume continues from;
    raises Interrupted (under mpiexec the job ends, with the signal's status)."""
    if run.lead:
        run.log.close()
        last = checkpoint_paths(run.args.out)
        log(f"interrupted{' ' + again if again else ''} ({signame}) at step {run.state['step']}: stopped without "
            f"saving; --resume continues from {last[-1] if last else 'the start'}")
    if run.world.size > 1 and not again:   # (a second Ctrl-C comes only to one process)
        run.world.abort(SIGNAL_EXIT[signame])
    raise Interrupted(signame) from None


# ------------------------------------------------------------------------------ set-up
def _resumed(out, ckpts):
    """The checkpoint --resume continues from, the last of `ckpts`; where it cannot be read, the error says which
    one --resume takes once it is moved away."""
    try:
        return load_checkpoint(ckpts[-1])
    except CheckpointError as e:
        earlier = (f"; move it out of {out}, and --resume continues from {ckpts[-2]}, the checkpoint before it"
                   if len(ckpts) > 1 else "")
        raise CheckpointError(f"--resume: {e}{earlier}") from None


def set_up(args, world):
    """Device, data (and the checkpoint to resume), model, optimizer, the batch feed, the log."""
    lead = world.rank == 0
    if lead and getattr(args, "restored", None):   # said first: the data it names is read next
        log(f"the run's recorded flags, from {os.path.join(args.out, 'config.json')} (flags given now take their "
            f"place): {' '.join(args.restored)}")
    _prepare_device(args, world)
    ckpts = checkpoint_paths(args.out)
    if ckpts and not args.resume:
        raise ConfigError(f"--out {args.out} already holds checkpoints: pass --resume to continue, "
                          f"or choose another --out")
    if not ckpts:
        check_fresh_out(args.out)
        if getattr(args, "restarted", False) and lead:
            log(f"note: --resume: {args.out} holds no checkpoint yet (the run stopped before its first): it starts "
                f"from the beginning, with its recorded flags")
    resume = _resumed(args.out, ckpts) if args.resume and ckpts else None
    if resume is not None:
        check_resumed(args.out, resume)
        check_resumed_flags(args, resume, "float64" if compute_dtype(args) == "float64" else "float32")
    init = init_from(args, lead) if resume is None else None
    data = _load_data(args, world, resume, init.tokenizer if init else None)
    flags = args
    cfg, args = resolve_config(args, data, resume, lead, init.config if init else None)   # args: settled, read-only
    if resume is not None and lead:
        log(f"resuming from {resume.path} (step {resume.train_state['step']})")
        if args.max_steps and args.max_steps <= resume.train_state["step"]:
            log(f"note: --max-steps {args.max_steps:,} is not above the run's step {resume.train_state['step']:,}: no "
                f"update is made; the run's end (the average and the scores) is made again")
        spent = resume.train_state.get("train_wall_s") or 0
        if args.time_budget and spent >= args.time_budget:   # it would end at once, and only say "time_budget"
            log(f"note: --time-budget {args.time_budget:g} counts the run's training over all its starts, and it has "
                f"trained {spent:.{1 if spent < 10 else 0}f} s: it ends at once; give a larger --time-budget (or --max-steps, which drops the "
                f"first start's budget) to go on")
    fp16 = getattr(args, "fp16", False)
    dtype = compute_dtype(args)
    _agree(world, data_id=data.data_id, config=cfg.to_dict(), seed=args.seed, update_freq=args.update_freq,
           dtype=dtype, fp16=fp16, resume_step=resume.train_state["step"] if resume else 0,
           **{name: getattr(args, name) for name in AGREED_FLAGS})
    model = build_model(cfg, device=args.device, dtype=dtype, seed=args.seed)
    run = Run(args, world, data, cfg, model, Adam(model, lr=NoamSchedule(cfg.d_model, cfg.warmup, cfg.lr_factor),
                                                 weight_decay=cfg.weight_decay),
              LossScaler() if fp16 else None, new_state(args, data), resume.path if resume else None)
    if resume is not None:
        _restore(run, resume)
    elif init is not None:
        run.model.load_state_dict(init.params)
        if lead:
            log(f"init: the weights of {flags.init_from}")
    if UpdateCheck.applies(run.opt):   # the step without a sync (take_step)
        run.check = UpdateCheck(model, run.scaler)
    if lead:
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
    _open_feed(run)   # a resume the batches refuse (other ranks, --update-freq) stops here: --out not yet touched
    if lead:
        prepare_out(args.out)
        settle_leftovers(args.out, resume)
        if resume is not None:
            _note_fade_moved(run, read_run_record(args.out, strict=False))   # before this start's flags replace it
        _write_run_config(args, flags, cfg, world, data, resume)
    run.log = TrainLog(os.path.join(args.out, "train_log.jsonl"), enabled=lead)
    if lead and run.log.dropped:
        log(f"{run.log.path}: dropped its torn last line ({run.log.dropped} bytes, a record cut by a kill or a "
            f"full disk)")
    run.start_wall = time.time() - run.state["train_wall_s"]
    run.console = Console(run.state, args.max_steps, args.time_budget, quiet=args.quiet, enabled=lead)
    run.window = new_window()
    kept = run.state.get("log_window")
    if resume is not None and isinstance(kept, dict):
        run.window.update((k, kept[k]) for k in ("loss", "nll", "n", "lr") if isinstance(kept.get(k), (int, float)))
    return run


def _note_fade_moved(run, record):
    """A note where a resume's other end (--max-steps, --time-budget given again) moves --lr-fade's fade back, so
    that the learning rate goes up again (it had, 4.8x, without a word). `record`: the run's config.json before this
    start (its ends), or None. The fade alone is compared, at the run's step and seconds, under both ends (the
    warmup's own rise is no news)."""
    cfg, step, wall = run.cfg, run.state["step"], run.state["train_wall_s"]
    if not cfg.lr_fade or not step or record is None:
        return
    before = SimpleNamespace(max_steps=record["args"].get("max_steps"), time_budget=record["args"].get("time_budget"))
    if not all(v is None or isinstance(v, (int, float)) for v in vars(before).values()):
        return
    def said(key, value):
        if not value:
            return f"no --{key.replace('_', '-')}"
        shown = f"{int(value):,}" if float(value).is_integer() else f"{value:g}"   # 1,000,000 steps, not 1e+06
        return f"--{key.replace('_', '-')} {shown}"
    moved = [f"{said(key, getattr(run.args, key))} (before: {said(key, getattr(before, key))})"
             for key in ("max_steps", "time_budget") if (getattr(before, key) or 0) != (getattr(run.args, key) or 0)]
    p_before, p_now = run_progress(before, step, wall), run_progress(run.args, step, wall)
    if not moved or fade(p_now, cfg.lr_fade) <= 1.05 * fade(p_before, cfg.lr_fade):
        return
    rate = [learning_rate(step + 1, cfg.d_model, cfg.warmup, cfg.lr_factor, cfg.lr_fade, p) for p in (p_now, p_before)]
    log(f"note: --lr-fade {cfg.lr_fade:g} fades the learning rate over the run's new end, {' and '.join(moved)}: "
        f"from step {step + 1:,} it is {rate[0]:.3g}, where the earlier end would have made it {rate[1]:.3g}; it "
        f"fades to 0 again from there")


def _write_run_config(args, flags, cfg, world, data, resume):
    """OUT/config.json: the model, the settled flags, the ranks, the config fields the flags set (config.FLAG_FIELDS;
    the others are the preset's) and the tokenizer's hash. A resumed run keeps what the run's first start recorded of
    its flags (a resume gives few: the model's come from the checkpoint) and adds what it sets itself."""
    path = os.path.join(args.out, RECORD)
    settled = {k: v for k, v in vars(args).items() if k not in ("restored", "given")}
    for dest in RUN_PATHS:   # absolute: a resume from another folder reads the same files
        if isinstance(settled.get(dest), str):
            settled[dest] = os.path.abspath(settled[dest])
    settled["test"] = [(name, os.path.abspath(prefix)) for name, prefix in settled.get("test") or ()]
    set_by_flags = {field: flag for flag, field in FLAG_FIELDS.items() if getattr(flags, flag, None) is not None}
    before = read_run_record(args.out, strict=False) if resume is not None else None   # unreadable: this start's alone
    if before is not None:
        merged = dict(before["args"])
        merged.update((k, v) for k, v in settled.items() if v is not None or k not in merged)
        for group in RESUMED_GROUPS:   # a group this start set (a member given) is recorded whole, None included
            if any(settled.get(k) != before["args"].get(k) for k in group):
                merged.update((k, settled.get(k)) for k in group)
        settled = merged
        if isinstance(before.get("set_by_flags"), dict):
            set_by_flags = {**before["set_by_flags"], **set_by_flags}
    atomic_write(path, lambda f: f.write(json.dumps(
        {"model": cfg.to_dict(), "args": settled, "ranks": world.size, "set_by_flags": set_by_flags,
         "tokenizer_sha256": hashlib.sha256(data.tokenizer.to_bytes()).hexdigest()}, indent=2).encode()))


def _prepare_device(args, world):
    if args.device == "gpu" and world.size > 1:
        world.use_gpu()   # the GPU of this rank's local rank, and the NCCL communicator
    if args.device == "cpu" and world.size > 1:
        threads = world.share_cores()   # this machine's cores split between its ranks' BLAS
        if world.rank == 0 and threads:
            log(f"{world.local_size} ranks on this machine: {threads} BLAS thread(s) each")
    get_xp(args.device)  # fail fast (before data and tokenizer work) when the device is unusable
    dtype_named(compute_dtype(args))   # ... or bfloat16 has no dtype (no ml_dtypes)
    if args.device == "gpu" and compute_dtype(args) == "float32":
        _choose_tf32(args, world)
    if args.device == "gpu" and compute_dtype(args) == "bfloat16" and world.rank == 0:
        arch = gpu_arch()
        if arch < 80:
            log(f"warning: --bf16 on sm_{arch}: this GPU has no bfloat16 tensor cores (Ampere, sm_80, and newer have "
                f"them), so its bfloat16 products run on the slower paths; --fp16 is the faster choice here")
    if world.rank == 0 and getattr(args, "fp16", False) and args.device == "cpu":
        log("warning: --fp16 on the CPU is slower than float32 (NumPy has no float16 arithmetic of its own: every "
            "product and sum converts to float32 and back); it is meant for GPUs")


def _choose_tf32(args, world):
    """A float32 run on a GPU makes its products on TF32 tensor cores unless --no-tf32 or the environment's
    CUPY_TF32 says otherwise (gemm.choose_tf32, before the first product), and says which."""
    told = getattr(args, "no_tf32", False)
    on = gemm.choose_tf32(False if told else None)
    if world.rank == 0:
        arch = gpu_arch()
        why = "--no-tf32" if told else "the environment's CUPY_TF32"
        if on and arch < 80:
            log(f"float32 products in full float32 (TF32 needs an Ampere GPU or newer; this one is sm_{arch})")
        else:
            log("float32 products on TF32 tensor cores (--no-tf32 for full float32)" if on else
                f"float32 products in full float32 ({why})")


def compute_dtype(args):
    """The dtype of the activations and matmuls: float16 under --fp16 (loss-scaled), bfloat16 under
    --bf16 (no loss scaling: bfloat16 has float32's exponent range), else --dtype."""
    if getattr(args, "fp16", False):
        return "float16"
    if getattr(args, "bf16", False):
        return "bfloat16"
    return getattr(args, "dtype", "float32")


def init_from(args, lead=True):
    """--init-from: the model's config, params and tokenizer (checkpoint.StoredModel) of a minitf checkpoint or of a
    Marian model (its tokenizer told which side is the source); None without the flag."""
    path = getattr(args, "init_from", None)
    if path is None:
        return None
    stored = read_model(path)
    if stored.marian:
        stored.tokenizer.source_language = args.src
    elif stored.tokenizer is None:
        raise ConfigError(f"--init-from {path}: the checkpoint holds no tokenizer, so the corpus cannot be encoded as "
                          f"the model reads it; name a checkpoint that train_wmt.py wrote (or an export of one)")
    languages = stored.train_state.get("languages")
    if languages and list(languages) != [args.src, args.tgt] and lead:
        log(f"note: --init-from {path} was trained {languages[0]} -> {languages[1]}; this run trains "
            f"{args.src} -> {args.tgt}")
    return stored


def _load_data(args, world, resume, tokenizer=None):
    """A resumed run encodes with its checkpoint's tokenizer, so its cache holds the same ids (and
    --init-from with its Marian model's); rank 0 prepares the cache (and trains the tokenizer)
    once, the others then open it."""
    lead = world.rank == 0
    if resume is not None and resume.tokenizer:
        tokenizer = tokenizer_from_bytes(resume.tokenizer)
    for turn in range(2 if world.size > 1 else 1):
        if lead == (turn == 0):
            try:
                state = resume.train_state if resume else {}
                corpus = state.get("corpus_sha256")
                data = load_data(DataSettings.of(args), tokenizer=tokenizer, log=log if lead else (lambda msg: None),
                                 expect_data_id=state.get("data_id"), notes=lead,
                                 expect_corpus=corpus if isinstance(corpus, list) else None)
            except StaleData as e:
                raise ConfigError(f"--resume: {resume.path} was trained on other data: {e}; restore it, "
                                  f"or start a new --out") from None
        world.quiet_barrier()
    return data


def new_state(args, data):
    return {"step": 0, "epoch": 0, "batch": 0, "forward_count": 0, "train_wall_s": 0.0, "train_tokens": 0,
            "nonfinite": 0, "data_id": data.data_id, "languages": [args.src, args.tgt], "valid_sha256": _valid_id(data),
            "corpus_sha256": [f["sha256"] for f in data.corpus.manifest["corpus"]]}   # a resume's first check


def _valid_id(data):
    """The SHA-256 of the validation set's lines, both sides: the set the run's best and --patience compare on."""
    h = hashlib.sha256()
    for side in data.valid:
        for line in side:
            h.update(line.encode("utf-8", "surrogatepass") + b"\n")
        h.update(b"\0")
    return h.hexdigest()


def _restore(run, resume):
    """Parameters, Adam's moments and step, the train state (and the loss scale) of a checkpoint. A validation set
    other than the one the run validated on so far is said, and the run goes on with it."""
    run.model.load_state_dict(resume.params)
    run.opt.load_state_dict(resume.optimizer)
    now = run.state["valid_sha256"]
    run.state.update(resume.train_state)
    before = resume.train_state.get("valid_sha256")
    if run.lead and before and before != now and resume.train_state.get("best_valid"):
        log(f"note: the validation set is not the one this run validated on before step {resume.train_state['step']}: "
            f"the best so far (step {resume.train_state['best_valid']['step']}'s) and --patience compare scores of "
            f"the two sets")
    run.state["valid_sha256"] = now
    if run.scaler is not None and "loss_scale" in run.state:
        run.scaler.scale, run.scaler.good_steps = run.state["loss_scale"], run.state["good_steps"]


def _open_feed(run):
    """The batches of the updates (feed.open_feed), the run's first line about them, and the validation."""
    args, world, pairs = run.args, run.world, run.data.train
    run.feed, max_tokens = open_feed(run)
    per_update = world.size * args.update_freq
    if run.lead:
        both = (f" ({2 * len(pairs.src_lens):,} pairs in {run.both_len:,} batches while --bidirectional-epochs reads "
                f"both directions)" if run.both_len else "")
        log(f"train: {len(pairs.src_lens):,} pairs{dropped_note(run.data.corpus.manifest)} in {run.epoch_len:,} batches "
            f"per epoch{both}; tokens per side (padding "
            f"included), at most: {max_tokens:,} per batch, {args.update_freq * max_tokens:,} per rank "
            f"({args.update_freq} batch{'es' if args.update_freq > 1 else ''}), {per_update * max_tokens:,} per update "
            f"({world.size} rank{'s' if world.size > 1 else ''})")
        note_a_short_run(run, start=True)
    if len(run.data.valid[0]):
        run.validation = Validation(run.data.valid, run.data.tokenizer, max_tokens, args.valid_bleu_sentences,
                                    args.decode_batch, world, lang=args.tgt)


# ------------------------------------------------------------------------------ the loop
def run_loop(run):
    """Updates until --max-steps, the --time-budget, --patience or a signal; returns why it stopped:
    "max_steps", "time_budget", "patience", or the signal ("SIGTERM" or "SIGINT", or "SIGTERM on another
    rank" or "SIGINT on another rank" under mpiexec)."""
    signals = StopSignals(run.world.size, notify=run.console.line_from_a_signal_handler if run.lead else None)
    run.model.train()
    with signals:
        while True:
            stop = should_stop(run, signals)
            if stop:
                settle(run)   # the last update's outcome, read before the run ends
                return late_signal(run, signals) or stop if stop in ENDS else stop
            update = run.feed.next()   # collated while the last update computed
            take_step(run, update)


def late_signal(run, signals):
    """A signal that came while the run's end was decided (after should_stop read the signals, or while the last
    update was settled: its validation, its checkpoint), agreed on by every rank (one more all-reduce, on every
    rank alike): the name should_stop would give it, or None. It had been announced, then dropped: the run went
    through its end and exited 0."""
    received = list(signals.received)
    term, interrupt = run.world.allreduce_numbers(["SIGTERM" in received, "SIGINT" in received])
    return _signal_stop(received, term, interrupt)


def _signal_stop(received, term, interrupt):
    """The stop a signal makes, once the ranks have agreed on it: this rank's own (`received`, first come), else
    "SIGTERM on another rank" / "SIGINT on another rank" (`term`, `interrupt`: any rank's), else None."""
    if received:
        return received[0]
    if term or interrupt:
        return f"{'SIGTERM' if term else 'SIGINT'} on another rank"
    return None


def should_stop(run, signals):
    """One decision on every rank, at the top of each update: the step limit, --patience, the time
    budget (any rank over it stops them all), a signal on any rank."""
    args = run.args
    if run.pending is not None and args.max_steps and run.state["step"] + 1 >= args.max_steps:
        settle(run)   # whether the pending update was the last one depends on its outcome
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
    # a signal first: one in the last update (or the one reaching the budget or --patience) saves and stops as it
    # said it would, where the run had gone on through its end (validation, averaging, beam search) and exited 0
    signalled = _signal_stop(received, term, interrupt)
    if signalled:
        return signalled
    if args.max_steps and run.state["step"] >= args.max_steps:   # the same on every rank
        return "max_steps"
    if patience_reached(run):
        return "patience"
    if over_budget:
        return "time_budget"
    return None


def patience_reached(run):
    """--patience validations in a row without a better one (validate counts them)."""
    return bool(run.args.patience) and run.state.get("valid_since_best", 0) >= run.args.patience


def take_step(run, update):
    """Forward, backward and the all-reduce of one update, then its end: on the CPU (or a GPU
    without the fused Adam, or with MINITF_HOST_CHECK=1) `finish_on_host`, on a GPU
    `finish_on_device`, which never waits for the GPU. finish_on_host steps Adam unless the update is skipped (a float16 overflow, a non-finite
    loss or gradient), then runs after_step; finish_on_device queues Adam's kernel, which steps only
    if the device's outcome says so, and settles (and runs after_step for) the previous update."""
    args, state, model = run.args, run.state, run.model
    # the dropout masks' position: past a pending update's batches, whatever its outcome
    forward_count = state["forward_count"] + (run.world.size * args.update_freq if run.pending else 0)
    loss_sum, nll_sum = forward_backward(model, update[3], update[2], forward_count, run.scaler, run.check)
    run.world.allreduce_sum(model.flat_grads)   # every rank now holds the update's whole gradient
    if run.check is None:
        finish_on_host(run, update, loss_sum, nll_sum)
    else:
        finish_on_device(run, update, loss_sum, nll_sum)


def finish_on_host(run, update, loss_sum, nll_sum):
    """The host reads the outcome at once (step_stats: loss, NLL, whether every gradient is finite),
    applies the skip rules, and makes Adam's step unless they skip the update."""
    epoch, index, total, _ = update
    scaler = run.scaler
    loss_sum, nll_sum, grads_finite = step_stats(run.model, loss_sum, nll_sum)
    loss_sum, nll_sum = run.world.allreduce_numbers([loss_sum, nll_sum])
    done = not _skipped(run, np.isfinite(loss_sum), grads_finite)
    lr = None
    if done:
        lr = update_rate(run)
        run.opt.step(grad_divisor=scaler.scale if scaler else 1.0, lr=lr)
    _count(run, done, epoch, index, total)
    if done:
        after_step(run, loss_sum, nll_sum, total, lr)


def finish_on_device(run, update, loss_sum, nll_sum):
    """Nothing waits for the GPU: the device decides the outcome (UpdateCheck.check: the same skip
    and loss-scale rules) and Adam's kernel steps only if it says so. The host settles the LAST
    update now, its outcome copied back while this one's forward and backward run, and leaves this
    one pending for the next call (or the run's end), so the GPU always has work queued."""
    epoch, index, total, _ = update
    outcome = run.check.check(loss_sum, nll_sum, run.world)
    settle(run)
    if patience_reached(run):
        return    # the last update's validation ended the run: this one is dropped, nothing of it kept
    lr = update_rate(run)
    run.opt.step(lr=lr, check=run.check)   # made on the device only if the outcome says so
    run.pending = Pending(epoch, index, total, lr, outcome)


def update_rate(run):
    """The next update's rate: schedule x fade, at the run's progress before it."""
    cfg = run.cfg
    return learning_rate(run.opt.step_count + 1, cfg.d_model, cfg.warmup, cfg.lr_factor, cfg.lr_fade,
                         run_progress(run.args, run.state["step"], run.elapsed_mean))


def settle(run):
    """The pending update's outcome, read from the device (UpdateCheck's copy, an update late): the
    skip rules as on the CPU, the step taken back from Adam when the kernel skipped it, the counts,
    then after_step. Nothing to do without a pending update."""
    p, run.pending = run.pending, None
    if p is None:
        return
    o = dict(zip(UpdateCheck.OUTCOME, p.outcome.result()))
    done = not _skipped(run, bool(o["loss_finite"]), bool(o["grads_finite"]))
    if not done:
        run.opt.step_count -= 1   # Adam.step counted it; its kernel made no update
    _count(run, done, p.epoch, p.index, p.total)
    if done:
        after_step(run, float(o["loss_sum"]), float(o["nll_sum"]), p.total, p.lr)


def _count(run, done, epoch, index, total):
    """An update is complete (made or skipped): the step and token counts, the loss scale's good
    updates, and only now the saved position past its batches and dropout masks."""
    state, scaler = run.state, run.scaler
    if done:
        if scaler is not None:
            scaler.update(True)
            state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
        state["step"] += 1
        state["train_tokens"] += total
    state["epoch"], state["batch"] = epoch, index + 1
    state["forward_count"] += run.world.size * run.args.update_freq


def _skipped(run, loss_finite, grads_finite):
    """The skip rules: a float16 overflow (smaller loss scale), or a non-finite loss, or a non-finite
    gradient without float16 loss scaling (counted; too many in a row end the run). Logs the skip; True when the update is not made."""
    state, scaler = run.state, run.scaler
    if scaler is not None and loss_finite and not grads_finite:
        scaler.update(False)
        state["loss_scale"], state["good_steps"] = scaler.scale, scaler.good_steps
        run.log.write({"step": state["step"], "event": "overflow_skipped", "loss_scale": scaler.scale})
        return True
    if not (loss_finite and grads_finite):
        state["nonfinite"] += 1
        run.log.write({"step": state["step"], "event": "nonfinite_loss_skipped", "count": state["nonfinite"]})
        if state["nonfinite"] >= run.args.max_nonfinite:   # a resume keeps the checkpoint's recipe: no new schedule
            kept = checkpoint_paths(run.args.out)
            how = (f"--resume goes on from {os.path.basename(kept[-1])} with the same schedule (--max-nonfinite "
                   f"{run.args.max_nonfinite} allows that many in a row), or " if kept else "")
            raise MinitfError(f"{state['nonfinite']} non-finite updates (loss or gradients) in a row at step "
                              f"{state['step']}: the run diverged; {how}"
                              + ("start a new --out" if kept else "run the command again")   # no checkpoint: --out
                              + " with a lower --lr-factor or a longer --warmup")             # is started afresh
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
    w["timed"] += tokens
    w["lr"] = lr
    run.console.update(state["step"], run.elapsed())
    if run.lead and not run.short_noted:   # the rate of 30 s of updates says how many the budget makes
        if run.budget_clock is None:
            run.budget_clock = (state["step"], run.elapsed())
        elif run.elapsed() - run.budget_clock[1] >= 30:
            note_a_short_run(run)
    if state["step"] % args.log_every == 0:
        log_record(run)
    # every rank validates (its share) at the same steps: the minutes' grids read rank 0's clock at the top of the
    # update (agreed in should_stop), the checkpoints' too, so that a validation on the checkpoints' spacing comes
    # with its checkpoint (read after the update, it had saved one update before each validation); the next
    # record's tokens/s is of updates: the time of a validation or a save is left out of its window (the line after
    # a validation had shown a rate of half the updates')
    if run.validation and on_grid(state, "valid_interval", args.valid_every, args.valid_every_minutes,
                                  run.elapsed_lead):
        t = time.time()
        validate(run)
        run.window["t0"] += time.time() - t
    if run.lead and on_save_grid(args, state, run.elapsed_lead):
        t = time.time()
        run.save(on_grid=True)
        run.window["t0"] += time.time() - t


def log_record(run, tail=False):
    """The log's record (and the console's line) of the updates since the last one, then a new window; `tail`: the
    run's end between two --log-every records, marked so (`"tail": true`), its window kept for the checkpoint (a run
    extended from there drops this record, as the end's scores, and logs on as one that never stopped)."""
    w = run.window
    rec = {"step": run.state["step"], "epoch": run.epochs(),
           "loss": round(w["loss"] / w["n"], 4), "nll": round(w["nll"] / w["n"], 4),
           "ppl": perplexity(w["nll"] / w["n"]), **({"lr": w["lr"]} if w.get("lr") is not None else {}),
           # (none where this process made none of the updates: a resume that makes the run's end again)
           **({"tokens_per_s": round(w["timed"] / (time.time() - w["t0"]), 1)} if w["timed"] else {}),
           "wall_s": round(run.elapsed(), 1)}
    run.log.write({**rec, "tail": True} if tail else rec)
    if w["timed"]:
        run.console.show(rec)
    if not tail:
        run.window = new_window()


def note_a_short_run(run, start=False):
    """A run that ends inside its learning-rate warmup (or before twice its length) says so, once:
    at the start from --max-steps; under a --time-budget after 30 s of training, from the rate of
    those updates (after_step keeps the clock). Rank 0 only."""
    args = run.args
    if args.max_steps and run.state["step"] >= args.max_steps:   # a resume that only ends the run: no update to come
        run.short_noted = True
        return
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
        f"{run.cfg.warmup:,}-update warmup: expect a much weaker model than a full run of the preset; "
        f"a longer budget, or a shorter --warmup, changes that")


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
    """The log's sums since its last record: loss and NLL over n target tokens; the rate counts the tokens of this
    process since t0 (`timed`: a resumed run's first window holds updates made before it started)."""
    return {"loss": 0.0, "nll": 0.0, "n": 0, "t0": time.time(), "timed": 0}


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
            again = (" (Ctrl-C again: stop at once, without saving)" if self.second_interrupt_raises
                     and signum == signal.SIGINT else "")   # after a SIGTERM a Ctrl-C is a first one
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
ENDS = ("max_steps", "time_budget", "patience")   # the stops that end a run (the others are signals: --resume goes on)


def end(run, stop):
    """After the loop: on a signal, save and raise Interrupted; else the last checkpoint, then on
    rank 0 the average, the translations and the scores (finish)."""
    args, state = run.args, run.state
    if stop not in ENDS:
        if run.lead:
            with signals_held():   # another signal now would cut the checkpoint this stop saves
                # (a signal in an update on the --save-every spacing: that update's checkpoint is already the last)
                path = saved_at_this_step(run) or run.save(on_grid=False)
            run.log.close()
            log(f"interrupted ({stop}) at step {state['step']}: saved {path}; continue with --resume")
        raise Interrupted(stop.split()[0])
    validated = False
    if run.validation and (args.valid_every or args.valid_every_minutes) and state.get("valid_step") != state["step"]:
        _final_validation(run)   # the final model too (every rank), so that checkpoint_best.npz is the best of the run
        validated = True
    if not run.lead:   # rank 0 averages and scores alone: wait for it, a signal meanwhile ending the job as one
        got, done = run.world.wait_for_lead()
        if got and not done:   # rank 0 did not end the job within the grace: it was signalled alone, or not at all
            log(f"rank {run.world.rank}: interrupted ({got[0]}) while rank 0 scored the run: its checkpoints are "
                f"complete; --resume validates and ends the run")
            run.world.abort(SIGNAL_EXIT[got[0]])
        if got:   # (it had been dropped without a word)
            log(f"rank {run.world.rank}: {got[0]} came as rank 0 finished the run, which is complete")
        return None
    with signals_held() as got:   # a signal while the end's checkpoint is written is answered once it is whole
        path = _save_the_end(run, stop, validated)
    if got:
        signame = signal.Signals(got[0]).name
        run.log.close()
        log(f"interrupted ({signame}) at the end of training, step {state['step']}: its checkpoint is saved "
            f"({path}); `--out {args.out} --resume` scores the run's end")
        if run.world.size > 1:   # the other ranks wait in wait_for_lead: the job ends here, with the signal's status
            run.world.abort(SIGNAL_EXIT[signame])
        raise Interrupted(signame)
    state["epochs"] = run.epochs()
    try:
        with sigterm_raises(_sigterm):
            results = finish(run, stop)
        print_summary(summary_lines(results, args.out, args.tgt))
        run.world.quiet_barrier()   # the other ranks wait for this (wait_for_lead)
        return results
    except (KeyboardInterrupt, Interrupted) as e:   # while averaging or translating: training itself is saved
        signame = e.signame if isinstance(e, Interrupted) else "SIGINT"
        chosen = os.path.join(args.out, "model.npz")
        log(f"interrupted ({signame}) during the final evaluation: the checkpoints in {args.out} are complete; "
            f"`--out {args.out} --resume` scores the run's end again (its results.json), or score "
            f"{'the model the run chose' if os.path.exists(chosen) else 'one'} with `python -m minitf evaluate "
            f"--checkpoint {chosen if os.path.exists(chosen) else checkpoint_paths(args.out)[-1]} --src FILE --ref FILE`")
        if run.world.size > 1:   # the other ranks wait in wait_for_lead: the job ends here, with the signal's status
            run.log.close()
            run.world.abort(SIGNAL_EXIT[signame])
        raise Interrupted(signame) from None
    finally:
        run.log.close()


def _save_the_end(run, stop, validated):
    """Rank 0 at the end of training: this step's checkpoint, saved unless the spacing saved it already (then again
    where the final validation ran, or where a --time-budget stop's checkpoint records less than the budget: saved on
    the spacing just before, a resume would take the budget for unspent and train on), and the stop's line. Returns
    the checkpoint's path."""
    args, state = run.args, run.state
    saved = saved_at_this_step(run)
    recorded, state["train_wall_s"] = state["train_wall_s"], run.elapsed()   # the time its last checkpoint records
    under = stop == "time_budget" and recorded < args.time_budget
    path = run.save(on_grid=False) if not saved or validated or under else saved   # off the spacing unless it was on it
    why = (f"patience: validation {'BLEU' if state['best_valid']['metric'] == 'valid_bleu' else 'loss'} no better "
           f"than step {state['best_valid']['step']}'s for {args.patience} validations" if stop == "patience" else stop)
    wall = round(round(state["train_wall_s"], 1))   # results.json's 0.1 s rounded, as the summary rounds it
    log(f"training stopped ({why}) at step {state['step']} after {wall}s")
    return path


def saved_at_this_step(run):
    """The path of this step's checkpoint where it is the run's last (saved on the spacing after this step's update,
    or the one a resume started from), else None."""
    last = checkpoint_paths(run.args.out)
    return last[-1] if last and last[-1].endswith(f"{run.state['step']:07d}.npz") else None


def _final_validation(run):
    """validate(run) at the end; Ctrl-C or SIGTERM there saves this step's checkpoint (the updates since the last
    one are kept) and raises Interrupted: --resume validates and ends the run. Under MPI the signals are flagged, as
    in the update loop, and agreed once the validation's collectives are done, so every rank stops together (a
    rank raising alone would leave the others waiting in a collective)."""
    if run.world.size > 1:
        with StopSignals(run.world.size, notify=run.console.line_from_a_signal_handler if run.lead else None) as signals:
            validate(run)
        term, interrupt = run.world.allreduce_numbers(["SIGTERM" in signals.received, "SIGINT" in signals.received])
        if term or interrupt:
            _stopped_in_final_validation(run, "SIGTERM" if term else "SIGINT")
        return
    try:
        with sigterm_raises(_sigterm):
            validate(run)
    except (KeyboardInterrupt, Interrupted) as e:
        _stopped_in_final_validation(run, e.signame if isinstance(e, Interrupted) else "SIGINT")


def _stopped_in_final_validation(run, signame):
    if run.lead:
        with signals_held():   # another signal now would cut the checkpoint this stop saves
            path = run.save(on_grid=False)
        run.log.close()
        log(f"interrupted ({signame}) in the final validation at step {run.state['step']}: saved {path}; "
            f"--resume validates and ends the run")
    raise Interrupted(signame)


def _sigterm():
    """What SIGTERM raises after training, where nothing is left to save (errors.sigterm_raises)."""
    return Interrupted("SIGTERM")


def finish(run, stop=None):
    """The model the run reports (choose_model), then the valid and test sets translated with
    beam search and scored: OUT/<set>.hyp.<tgt>, OUT/results.json, which names the model and why training stopped
    (`stop`: max_steps, time_budget or patience)."""
    from .translate import metrics, translate_lines
    args, model, tok, data, state = run.args, run.model, run.data.tokenizer, run.data, run.state
    results = {"steps": state["step"], "stopped": stop, "epochs": state["epochs"],
               "train_wall_s": round(state["train_wall_s"], 1),
               "train_tokens_per_s": round(state["train_tokens"] / max(state["train_wall_s"], 1e-9), 1),
               **choose_model(run), "beam": args.beam, "alpha": args.alpha,
               "bleu": {}, "chrf": {}, "sacrebleu_signature": None, "chrf_signature": None,
               "bleu_paper": {}, "bleu_paper_method": None, "validation_s": state.get("valid_s", 0.0),
               "best_valid": state.get("best_valid")}
    which = reported_model(results)
    sets = {"valid": data.valid, **data.tests}
    for name, (src, ref) in sets.items():
        t0 = time.time()
        hyps = translate_lines(model, tok, src, args.beam, args.alpha, args.decode_batch, progress=not args.quiet)
        s = metrics(hyps, ref, lang=args.tgt)
        atomic_write(os.path.join(args.out, f"{name}.hyp.{args.tgt}"), lambda f: f.write("".join(h + "\n" for h in hyps).encode()))
        results["bleu"][name], results["chrf"][name] = s["bleu"], s["chrf"]
        results["sacrebleu_signature"], results["chrf_signature"] = s["bleu_signature"], s["chrf_signature"]
        results["bleu_paper"][name], results["bleu_paper_method"] = s["bleu_paper"], s["bleu_paper_method"]
        run.log.write({"step": state["step"], "eval": name, "model": results["model"], "bleu": s["bleu"],
                       "chrf": s["chrf"], "bleu_paper": s["bleu_paper"], "decode_s": round(time.time() - t0, 1)})
        paper = f" (paper's tokenized BLEU {s['bleu_paper']:.2f})" if s["bleu_paper"] is not None else ""
        log(f"{name}: BLEU {s['bleu']:.2f}{paper} chrF {s['chrf']:.2f} (sacreBLEU, beam {args.beam}, all {len(src):,} "
            f"sentences, {time.time() - t0:.0f}s; {which})")
    if results["bleu_paper"] and None in results["bleu_paper"].values():
        log(f"note: the paper's tokenized BLEU was {results['bleu_paper_method']}")
    atomic_write(os.path.join(args.out, "results.json"), lambda f: f.write(json.dumps(results, indent=2).encode()))
    return results
