"""What a model file is, without building the model (`python -m minitf info`): its kind (a run's reported model,
an average, a training checkpoint, a .safetensors export, a Marian model), languages, architecture and size,
vocabulary, training and recipe."""
import json
import os

from .checkpoint import check_opens, checkpoint_in, role
from .config import parse_id_ranges
from .errors import DataError, MinitfError
from .modelfile import read_model
from .runfolder import BEST, RECORD, RESULTS, checkpoint_paths, read_run_record
from .trainlog import plural


def model_facts(path):
    """{path, kind, languages, parameters, dtype, tokenizer, config, train_state} of a minitf checkpoint (.npz or
    .safetensors) or a Marian model folder; its weights are read and their digests checked (Adam's moments are not
    read: --resume checks those), no model is built."""
    stored = read_model(path)
    params, state, tokenizer = stored.params, stored.train_state, stored.tokenizer
    kind = ("a Marian model (OPUS-MT's layout)" if stored.marian
            else _kind(state, stored.has_optimizer, path.endswith(".safetensors")))
    return {"path": path, "kind": kind, "marian": stored.marian, "languages": state.get("languages"),
            "parameters": int(sum(int(a.size) for a in params.values())),
            "dtype": str(next(iter(params.values())).dtype) if params else None,
            "tokenizer": None if tokenizer is None else {"type": tokenizer.model_type, "pieces": tokenizer.vocab_size},
            "resumable": stored.has_optimizer, "config": stored.config.to_dict(), "train_state": state}


def _kind(state, optimizer, exported):
    """What a checkpoint is, in words, from its train_state (checkpoint.role)."""
    which = role(state)
    if which == "reported" and state["model"] == "averaged" and len(state.get("from", [])) != 1:
        kind = f"a run's reported model: the average of {plural(len(state.get('from', [])), 'checkpoint')}"
    elif which == "reported":
        kind = "a run's reported model: its last checkpoint" + "".join(f" ({name})" for name in state.get("from", [])[:1])
    elif which == "average":
        kind = f"an average of {plural(len(state['averaged_from']), 'checkpoint')}"
    elif which == "best":
        kind = "the best validation checkpoint of a run"
    elif optimizer:
        kind = "a training checkpoint that holds Adam's moments (--resume continues from a run's last one)"
    else:
        kind = "a model's weights"
    return kind + (", exported as .safetensors" if exported else "")


def info_lines(f):
    """The facts of model_facts as the lines `python -m minitf info` prints."""
    c, state = f["config"], f["train_state"]
    layers = f"{c['n_layers']}+{c['n_decoder_layers']} layers"
    if c["arch"] == "rnn":
        model = f"recurrent (bi-LSTM encoder, {c['attention']} attention), {layers}, D {c['d_model']}, hidden {c['rnn_hidden']}"
    else:
        model = (f"Transformer, {layers}, {c['norm_position']}-norm, D {c['d_model']}, {c['n_heads']} heads of "
                 f"{c['d_k']}, F {c['d_ff']}, {c['activation']}, "
                 + (f"learned positions (at most {c['max_len']})" if c["positional"] == "learned"
                    else "sinusoidal positions"))   # sinusoids reach any length
    lines = [f"{f['path']}: {f['kind']}"]
    if f["languages"]:
        lines.append(f"  languages: {f['languages'][0]} -> {f['languages'][1]}")
    lines.append(f"  model: {model}; {f['parameters']:,} parameters ({f['dtype']})")
    tok = f["tokenizer"]
    kinds = {"unigram": "a SentencePiece unigram model", "bpe": "a SentencePiece BPE model",
             "marian": "Marian's vocabulary over source.spm and target.spm"}
    vocab = f"{c['vocab_size']:,} pieces ({kinds.get(tok['type'], tok['type']) if tok else 'no tokenizer kept'})"
    if c["output_vocab"]:
        vocab += f"; the output layer scores {parse_id_ranges(c['output_vocab'], c['vocab_size']).size:,} of them"
    lines.append(f"  vocabulary: {vocab}")
    if "step" in state:
        done = [f"{plural(state['step'], 'update')}"]
        if "train_tokens" in state:
            done.append(f"{state['train_tokens']:,} target tokens")
        if state.get("train_wall_s"):
            done.append(f"{state['train_wall_s']:,.0f} s of training")
        if state.get("data_id"):
            done.append(f"corpus {state['data_id']}")
        lines.append(f"  training: {', '.join(done)}")
    if not f["marian"]:   # a Marian model records no recipe of minitf's (one fine-tuned here does)
        lines.append(f"  recipe: dropout {c['dropout']:g}, label smoothing {c['label_smoothing']:g}, warmup "
                     f"{c['warmup']:,}, learning-rate factor {c['lr_factor']:g}, weight decay {c['weight_decay']:g}, "
                     + (f"{state['batch_tokens'] * state['update_batches']:,} tokens an update (at most, padding "
                        f"included)" if isinstance(state.get("batch_tokens"), int) and isinstance(
                            state.get("update_batches"), int) else f"{c['update_tokens']:,} tokens an update")
                     + _extras(c))
    lines.append(f"  decoding: length penalty alpha {c['decode_alpha']:g} by default (translate and evaluate)")
    return lines


def _extras(c):
    """The recipe's options beyond the paper's, where the config sets them, as the flags that set them."""
    parts = [f"--{name.replace('_', '-')} {c[name]:g}" for name in (
        "attention_dropout", "relu_dropout", "bpe_dropout_source", "bpe_dropout_target", "bidirectional_epochs",
        "lr_fade") if c.get(name)]
    return f"; beyond the paper's: {', '.join(parts)}" if parts else ""   # after the line ("dropout 0.1 (--lr-fade
    # 1)" had read as a detail of the dropout)


def _how_to_go_on(folder, res, last):
    """For a run that ended at its last checkpoint: what a --resume must give to train on (its end, from config.json's
    record of its flags: a spent --time-budget counts all its starts; --max-steps reached)."""
    if not (isinstance(res, dict) and res.get("steps") == last):
        return ""
    record = read_run_record(folder, strict=False)
    if record is None:
        return ""
    budget, max_steps = record["args"].get("time_budget"), record["args"].get("max_steps")
    if isinstance(budget, (int, float)) and (res.get("train_wall_s") or 0) >= 0.99 * budget:
        return f" (its --time-budget {budget:g} is spent over its starts: give a larger one, or a --max-steps)"
    if isinstance(max_steps, int) and last >= max_steps:
        return f" (it reached its --max-steps {max_steps}: give a larger one)"
    return ""


def _before_a_checkpoint(folder):
    """What a run's folder that holds no checkpoint yet is: a run in progress (its lock held), or one that stopped
    before its first checkpoint, with the last step its log records."""
    from .fileio import lock_holder
    from .trainlog import last_step
    holder, step = lock_holder(folder), last_step(os.path.join(folder, "train_log.jsonl"))
    logged = f"its log's last record is of step {step}" if step is not None else "its log records no step"
    if holder:
        return (f"{folder} is the folder of a training run in progress ({holder}; {logged}) that has not written its "
                f"first checkpoint yet: it does at --save-every (checkpoint_<step>.npz); nothing to describe before that")
    return (f"{folder} is the folder of a training run that stopped before its first checkpoint ({logged}): no model "
            f"to describe; a new run with --out {folder} starts afresh there")


def run_facts(folder):
    """{path, checkpoints, best, results, model, last_checkpoint_error} of a run's --out folder: its training
    checkpoints (oldest first),
    whether it holds checkpoint_best.npz, results ("missing" before the run's end, "unreadable", or results.json's
    dict) and model_facts of the model it reported (model.npz; else its average, best or newest checkpoint), or
    {"path", "error"} when that file cannot be read (the rest is still reported)."""
    checkpoints = [os.path.basename(p) for p in checkpoint_paths(folder)]
    model = checkpoint_in(folder)
    if model is None and any(os.path.isfile(os.path.join(folder, n)) for n in (RECORD, "train_log.jsonl")):
        raise DataError(_before_a_checkpoint(folder))
    if model is None:
        raise DataError(f"{folder} is a folder, but neither a run's --out folder (no model.npz, no "
                        f"checkpoint_<step>.npz) nor a Marian model: name a model file or a run's folder")
    results = "missing"
    if os.path.exists(os.path.join(folder, "results.json")):
        try:
            with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
                results = json.load(f)
        except (OSError, ValueError):
            results = "unreadable"
        if not isinstance(results, dict):
            results = "unreadable"
    try:
        facts = model_facts(model)
    except MinitfError as e:   # a corrupt model file: the run's other facts still say what is there
        facts = {"path": model, "error": str(e)}
    last_error = None
    if checkpoints:   # the one --resume takes (it had been named as such when cut short: --resume refused it)
        last = os.path.join(folder, checkpoints[-1])
        try:
            check_opens(last)
        except MinitfError as e:
            last_error = str(e)
        if last_error is None and "error" in facts and os.path.abspath(model) == os.path.abspath(last):
            last_error = facts["error"]   # read whole as the run's model: damaged inside an intact zip
    return {"path": folder, "checkpoints": checkpoints, "best": os.path.isfile(os.path.join(folder, BEST)),
            "results": results, "model": facts, "last_checkpoint_error": last_error}


def _new_run(r):
    """What a new run in the run's folder r["path"] does, said after "--resume cannot continue this run": refused where
    it holds an earlier run's results (runfolder.check_fresh_out), else started afresh."""
    refused = any(os.path.lexists(os.path.join(r["path"], name)) for name in RESULTS)
    return ", and a new run in this folder is refused" if refused else "; a new run in this folder starts afresh"


def run_lines(r):
    """The facts of run_facts as the lines `python -m minitf info FOLDER` prints: the run, then its model."""
    res, steps = r["results"], [int(name[len("checkpoint_"):-len(".npz")]) for name in r["checkpoints"]]
    if res == "missing":
        head = "a training run without results.json (running, or stopped before its end)"
    elif res == "unreadable":
        head = "a training run whose results.json cannot be read (not the JSON object a run writes)"
    elif isinstance(res.get("steps"), int) and steps and steps[-1] > res["steps"]:   # resumed past its end, not ended
        head = (f"a training run that ended after {plural(res['steps'], 'update')}, then was resumed and stopped at "
                f"step {steps[-1]} before ending again: its results.json and model.npz are of step {res['steps']}")
    elif isinstance(res.get("steps"), int):
        head = f"a training run that ended after {plural(res['steps'], 'update')}"
    else:
        head = "a training run that ended (its results.json gives no count of updates)"
    lines = [f"{r['path']}: {head}"]
    listed = (f"  checkpoints: {plural(len(steps), 'training checkpoint')} "
              f"({'step' if len(steps) == 1 else 'steps'} {', '.join(map(str, steps))}"
              f"{'; checkpoint_best.npz' if r['best'] else ''}): ")
    if steps and r.get("last_checkpoint_error"):
        lines.append(listed + f"the last cannot be read ({r['last_checkpoint_error']}): move it out of {r['path']}, "
                     + (f"and --resume continues from step {steps[-2]}" if len(steps) > 1 else
                        "and --resume cannot continue this run" + _new_run(r)))
    elif steps:
        lines.append(listed + f"--resume continues from step {steps[-1]}" + _how_to_go_on(r["path"], res, steps[-1]))
    else:
        lines.append(f"  checkpoints: no training checkpoint{' (checkpoint_best.npz alone)' if r['best'] else ''}: "
                     f"--resume cannot continue this run" + _new_run(r))
    if isinstance(res, dict) and isinstance(res.get("bleu"), dict):
        scores = ", ".join(f"{name} {value}" for name, value in res["bleu"].items())
        lines.append(f"  scores: sacreBLEU {scores} (beam {res.get('beam')}, alpha {res.get('alpha')}; results.json)")
    if "error" in r["model"]:
        return lines + [f"{r['model']['path']}: cannot be read: {r['model']['error']}"]
    return lines + info_lines(r["model"])
