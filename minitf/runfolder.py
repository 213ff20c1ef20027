"""The run folder (--out): the checkpoints a run writes and keeps, the check that a checkpoint
to resume is this run's, the removal of a killed save's temporary files, and at the end the
average of the last checkpoints and the choice of the model the run reports (OUT/model.npz)."""
import glob
import hashlib
import json
import os
import re

from .checkpoint import UPDATE_STATE, average_checkpoints, load_checkpoint, read_train_state, save_checkpoint
from .config import id_ranges, parse_id_ranges, shown
from .errors import CheckpointError, ConfigError, MinitfError
from .fileio import leftover_temp_files
from .trainlog import cut_after, log, plural
from .validation import evaluate_loss, perplexity

# what a run writes into --out (atomic_write's temporary files of these are its leftovers)
STEP_CHECKPOINT = re.compile(r"checkpoint_\d+\.npz")
BEST = "checkpoint_best.npz"   # the model of the best validation BLEU so far (the loss with --valid-bleu-sentences 0; no optimizer state)
OUTPUT_NAMES = re.compile(r"checkpoint_\d+\.npz|checkpoint_best\.npz|averaged\.npz|model\.npz|config\.json|results\.json|train_log\.jsonl|[\w.-]+\.hyp\.[\w-]+")


def checkpoint_paths(out):
    """The training checkpoints in `out` (checkpoint_<step>.npz), oldest first; not checkpoint_best.npz."""
    return sorted(p for p in glob.glob(os.path.join(out, "checkpoint_*.npz")) if STEP_CHECKPOINT.fullmatch(os.path.basename(p)))


def save(out, step, model, opt, tok, state, keep_last):
    """checkpoint_<step>.npz, then checkpoints removed until keep_last stay: the newest always, and of the others
    those saved off the --save-every spacing (at a stop) go first, oldest first, then the oldest on it; so the ones
    the end averages (averaging_window) stay."""
    path = os.path.join(out, f"checkpoint_{step:07d}.npz")
    save_checkpoint(path, model, opt, tokenizer=tok.to_bytes(), train_state=state)
    paths = checkpoint_paths(out)
    excess = len(paths) - keep_last
    if excess > 0:
        older = paths[:-1]
        spaced = [read_train_state(p).get("on_grid", True) for p in older]
        for old in ([p for p, s in zip(older, spaced) if not s] + [p for p, s in zip(older, spaced) if s])[:excess]:
            os.unlink(old)
    return path


# What --resume takes from the run's first start (OUT/config.json's record of its flags, kept up to date by each start:
# train._write_run_config) where the command line does not give it: the data, the device and precision, the batches and
# the run's schedule, so that `--out OUT --resume` alone continues the run. A group is taken whole or not at all (flags
# that exclude or bound each other), and a start that gives a member records its whole group. --max-steps given sets a
# new end (the first start's --time-budget is not taken); --time-budget given sets a time limit beside the run's
# --max-steps (the checkpoint's). --test is taken where the data flags are the first start's. The model's and the
# recipe's flags come from the checkpoint instead (recipe.resolve_config); --out, --init-from and --quiet are each
# start's own.
RESUMED_GROUPS = (("dataset", "train", "valid"), ("test",), ("data_dir",), ("offline",), ("src",), ("tgt",),
                  ("tokenizer", "vocab_size", "subword"), ("max_len",), ("max_ratio",), ("cache_dir",), ("device",),
                  ("dtype", "fp16", "bf16", "no_tf32"), ("preset",), ("max_tokens",), ("update_freq",), ("seed",),
                  ("max_steps", "time_budget"), ("valid_every", "valid_every_minutes"),
                  ("save_every", "save_every_minutes"), ("keep_last", "average_last"), ("valid_bleu_sentences",),
                  ("patience",), ("log_every",), ("beam",), ("alpha",), ("decode_batch",), ("max_nonfinite",))
RUN_PATHS = ("data_dir", "train", "valid", "tokenizer", "cache_dir", "init_from")   # and --test's prefixes: recorded absolute

RESULTS = ("model.npz", "averaged.npz", "results.json")   # what a run leaves at its end beside its checkpoints


RECORD = "config.json"   # a run's record of itself, kept up to date by each start (train._write_run_config)


class UnreadableRecord(Exception):
    """OUT/config.json is there but cannot be read as a run's record: `path`, and `reason` in a few words."""

    def __init__(self, path, reason):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def read_run_record(out, strict=True):
    """OUT/config.json, the record a run's starts keep of it: a dict whose "model" (the config) and "args" (the settled
    flags) are dicts, beside "ranks", "set_by_flags" and "tokenizer_sha256". None where the folder has none (a run
    killed before writing it, or not a run's folder); UnreadableRecord where it is there but unreadable, not JSON, or
    not such a record (a link to nowhere included), or None for that too with strict=False (a caller that goes on
    without the record)."""
    if not strict:
        try:
            return read_run_record(out)
        except UnreadableRecord:
            return None
    path = os.path.join(out, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise UnreadableRecord(path, "a link to nowhere") from None
        return None
    except (OSError, ValueError) as e:   # UnicodeDecodeError and json's errors are ValueErrors
        raise UnreadableRecord(path, f"{type(e).__name__}: {e}") from None
    if not (isinstance(record, dict) and isinstance(record.get("model"), dict) and isinstance(record.get("args"), dict)):
        raise UnreadableRecord(path, "not a run's record: a JSON object with its model and args")
    return record


def check_fresh_out(out):
    """A ConfigError where a new run in `out` (which holds no training checkpoint) would replace files it did not write:
    a run's results whose checkpoints were deleted (its model.npz, results.json, ...), or a config.json of something
    else. A folder of other files, or one a run left before its first checkpoint (config.json, train_log.jsonl), is
    taken."""
    kept = [name for name in RESULTS if os.path.lexists(os.path.join(out, name))]
    if kept:
        raise ConfigError(f"--out {out} holds {', '.join(kept)} of an earlier run (its checkpoints gone): a new run "
                          f"there would replace {'it' if len(kept) == 1 else 'them'}; choose another --out, or move "
                          f"{'it' if len(kept) == 1 else 'them'} away")
    try:
        read_run_record(out)
    except UnreadableRecord as e:
        raise ConfigError(f"--out {out} holds a config.json that no minitf run wrote ({e.reason}): a run there would "
                          f"replace it; choose another --out") from None


def settle_leftovers(out, resume=None):
    """What a run stopped early left in `out` that this start would take as its own, set right (rank 0, before the
    log is opened). A new run (resume None; check_fresh_out found no checkpoint and no results): the log and
    checkpoint_best.npz of a run stopped before its first checkpoint are removed. A resumed one (`resume`, the
    Checkpoint it continues from): the log's records after its step are dropped, and a checkpoint_best.npz of a later
    step (the work after the last checkpoint, done again now) is made again from the checkpoint of the best validation
    the resumed run knows, where that is kept, or else removed."""
    log_path, best = os.path.join(out, "train_log.jsonl"), os.path.join(out, BEST)
    if resume is None:
        gone = [p for p in (log_path, best) if os.path.isfile(p) and not os.path.islink(p)]   # a link: the user's
        for p in gone:
            os.unlink(p)
        if gone:
            log(f"note: removed {', '.join(os.path.basename(p) for p in gone)} of a run in {out} stopped before its "
                f"first checkpoint: this run starts afresh")
        return
    step = resume.train_state["step"]
    later, scores, tails = cut_after(log_path, step)
    if later:
        log(f"note: {log_path}: dropped {plural(later, 'record')} after step {step}, where this run resumes (a run "
            f"stopped after its last checkpoint had gone on)")
    if scores or tails:
        what = " and ".join(([plural(scores, "score")] if scores else []) + (["its last training record"] if tails else []))
        log(f"note: {log_path}: dropped the records of the run's end at step {step} ({what}): it ended there, and this "
            f"start goes on from there and records its own end")
    best_step = read_train_state(best).get("step") if os.path.isfile(best) else None
    if best_step is None or best_step <= step:
        return
    known = (resume.train_state.get("best_valid") or {}).get("step")
    source = os.path.join(out, f"checkpoint_{known:07d}.npz") if isinstance(known, int) else None
    if source and os.path.isfile(source):
        c = load_checkpoint(source, optimizer=False)
        save_checkpoint(best, params=c.params, config=c.config, tokenizer=c.tokenizer,
                        train_state={**c.train_state, "best": True})
        log(f"note: {best} was of step {best_step}, after step {step} where this run resumes: made again from "
            f"{os.path.basename(source)}, the best validation up to there")
    else:
        os.unlink(best)
        log(f"note: removed {best} of step {best_step}, after step {step} where this run resumes (the checkpoint of the "
            f"best validation before it is not kept); its next better validation writes it again")


def prepare_out(out):
    """--out is made once the data is ready (a failed download leaves no empty folder); the temporary
    files of a run killed while saving are removed."""
    os.makedirs(out, exist_ok=True)
    stale = leftover_temp_files(out, lambda name: bool(OUTPUT_NAMES.fullmatch(name)))
    for path in stale:
        os.unlink(path)
    if stale:
        log(f"removed {plural(len(stale), 'temporary file')} of an earlier run killed while saving: "
            f"{', '.join(os.path.basename(p) for p in stale)}")


def check_resumed_flags(args, resume, weights_dtype):
    """What a resume cannot change beside the model's and the recipe's flags (recipe.resolve_config): the direction
    (--src, --tgt), the precision of the weights (`weights_dtype`: float64 under --dtype float64, else float32, which
    --fp16 and --bf16 keep as master weights; the run's average would mix two) and, given again, the tokenizer its
    checkpoints encode with (--tokenizer, --vocab-size, --subword: they had been ignored without a word; the values the
    first start gave are taken, a tokenizer trained smaller than its --vocab-size asked among them)."""
    where = f"the checkpoint {resume.path}"
    languages = resume.train_state.get("languages")
    if languages and list(languages) != [args.src, args.tgt]:
        raise ConfigError(f"--src {args.src} --tgt {args.tgt}: {where} translates {languages[0]} -> {languages[1]}; "
                          f"resume it with --src {languages[0]} --tgt {languages[1]} (or without them), or start a new "
                          f"--out")
    stored = next(iter(resume.params.values())).dtype.name if resume.params else weights_dtype
    if stored != weights_dtype:
        told = "--dtype float64" if weights_dtype == "float64" else "--dtype float32 (or --fp16, --bf16)"
        raise ConfigError(f"{told}: {where} holds {stored} weights, and a run's checkpoints are averaged at its end: "
                          f"resume it with --dtype {stored}{' (--fp16 and --bf16 too)' if stored == 'float32' else ''}, "
                          f"or start a new --out")
    given = set(getattr(args, "given", ()))
    if not resume.tokenizer or not given.intersection(("tokenizer", "vocab_size", "subword")):
        return
    from .data.tokenizer import tokenizer_from_bytes
    tok = tokenizer_from_bytes(resume.tokenizer)
    if "tokenizer" in given:
        try:
            with open(args.tokenizer, "rb") as f:
                same = f.read() == resume.tokenizer
        except OSError as e:
            raise ConfigError(f"--tokenizer {args.tokenizer}: {e.strerror or e}") from None
        if not same:
            raise ConfigError(f"--tokenizer {args.tokenizer} is not the tokenizer {where} encodes with (it holds its "
                              f"own); drop --tokenizer to resume it, or start a new --out")
    record = read_run_record(args.out, strict=False)
    first = record["args"] if record is not None else {}   # what the first start asked (a tokenizer may have fewer)
    for flag, value, own in (("vocab_size", args.vocab_size, tok.vocab_size), ("subword", args.subword, tok.model_type)):
        if flag in given and value not in (own, first.get(flag)):
            dashed = "--" + flag.replace("_", "-")
            raise ConfigError(f"{dashed} {value}: {where} encodes with its own tokenizer ({dashed} {own}); drop "
                              f"{dashed} to resume it, or start a new --out")


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
    recorded_run = read_run_record(out, strict=False)
    if recorded_run is None:
        return   # no (readable) config.json: a run killed before writing it, or an older minitf
    model = recorded_run["model"]
    ours = resume.config.to_dict()
    if isinstance(model.get("output_vocab"), str):   # spelled as the config spells it ("3,4,5" as "3-5")
        try:
            model = dict(model, output_vocab=id_ranges(parse_id_ranges(model["output_vocab"], ours["vocab_size"])))
        except MinitfError:
            pass
    diff = [f"{k} {shown(k, model.get(k))!r} in config.json, {shown(k, ours.get(k))!r} in the checkpoint"
            for k in sorted(set(model) | set(ours)) if model.get(k) != ours.get(k)]
    if diff:
        raise ConfigError(f"--resume: {resume.path} is not this run's model: {'; '.join(diff[:4])}"
                          f"{' ...' if len(diff) > 4 else ''}; move it out of {out} (or start a new --out)")
    sha = recorded_run.get("tokenizer_sha256")
    if sha and resume.tokenizer and hashlib.sha256(resume.tokenizer).hexdigest() != sha:
        raise ConfigError(f"--resume: {resume.path} holds another tokenizer than the run's (config.json): it is "
                          f"not this run's checkpoint; move it out of {out} (or start a new --out)")


def averaging_window(paths, average_last):
    """The checkpoints averaged at the end: the run's final checkpoint and the evenly spaced ones
    before it (paper 6.1: the last few written at even intervals; fairseq too averages the last few,
    the final one included), at most `average_last` in all, and only from the second half of the
    run: a short run's first checkpoints, made in the warmup, would pull the average back. An
    off-spacing checkpoint before the final one (saved at an interrupt) is left out."""
    final = paths[-1]
    half = step_of(final) / 2
    spaced = [p for p in paths[:-1] if step_of(p) >= half and _on_grid(p)]
    return (spaced[-(average_last - 1):] if average_last > 1 else []) + [final]


def _on_grid(path):
    """Whether checkpoint `path` was saved on the spacing; a damaged one is taken as saved there (averaged_from leaves
    it out, saying so)."""
    try:
        return read_train_state(path).get("on_grid", True)
    except CheckpointError:
        return True


def averaged_from(paths, average_last, output):
    """The averaging window of the checkpoints `paths` averaged into `output` (average_checkpoints), the checkpoints
    before the final one that cannot be read left out with a note and the window taken again without them, so older
    ones take their places (a damaged file had stopped the run's end, and every --resume after it, at the average);
    returns the window averaged."""
    window = averaging_window(paths, average_last)
    try:
        average_checkpoints(window, output)
        return window
    except CheckpointError:
        damaged = {}
        for p in window[:-1]:
            try:
                load_checkpoint(p, optimizer=False)
            except CheckpointError as e:
                damaged[p] = e
        if not damaged:
            raise
    for p, e in damaged.items():
        log(f"note: {e}: the average is made without it")
    return averaged_from([p for p in paths if p not in damaged], average_last, output)


def step_of(path):
    return int(os.path.basename(path)[len("checkpoint_"):-len(".npz")])


def choose_model(run):
    """Average the window into OUT/averaged.npz, then report whichever of the average and the last
    checkpoint has the lower validation loss, written as OUT/model.npz (without Adam's state) and
    loaded into run.model. Returns what results.json says about it."""
    args, model = run.args, run.model
    paths = checkpoint_paths(args.out)
    last, avg_path = paths[-1], os.path.join(args.out, "averaged.npz")
    window = averaged_from(paths, args.average_last, avg_path)
    candidates = {"averaged": load_checkpoint(avg_path)}
    if len(window) > 1:
        candidates["last"] = load_checkpoint(last, optimizer=False)
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
                                 "languages": run.state["languages"],
                                 **{k: run.state[k] for k in UPDATE_STATE if k in run.state}})
    spacing = (f"every {args.save_every_minutes:g} min" if args.save_every_minutes
               else f"every {plural(args.save_every, 'step')}")
    names = ", ".join(os.path.basename(c) for c in window)
    if len(window) > 1:
        log(f"averaged {plural(len(window), 'checkpoint')} ({spacing} and the final one, from the run's second half: "
            f"{names}) -> {avg_path}")
    else:   # nothing to average with: the final checkpoint's weights as they are
        log(f"the final checkpoint alone ({names}; no other one {spacing} in the run's second half) -> {avg_path}")
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
