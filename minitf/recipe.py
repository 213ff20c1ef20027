"""What a run trains and on what clock: its config (the preset with the flags over it, or a
resumed checkpoint's, which the flags must not contradict), the recipe's settings left unset
(max steps, averaging, checkpoint and validation spacing), how far the run is (the learning-rate
fade's clock), when a step ends a checkpoint interval, and whether the run ends inside (or soon after) its warmup: under twice its length."""
import argparse
import dataclasses

from .config import FLAG_FIELDS, SCHEDULE_FLAGS, Config, id_ranges, parse_id_ranges
from .data.tokenizer import EOS_ID, UNK_ID
from .errors import ConfigError
from .trainlog import log

VALID_EVERY = 200   # updates between validations when checkpoints are spaced in steps (CPU presets)



def build_config(args, vocab_size, target_pieces=None, note=None, arch=None):
    """The preset's config with the flags over it; `target_pieces(both_sides)`: the pieces the training
    data's targets hold (both sides' with bidirectional training, whose targets are both languages),
    called when the run's output layer (--output-vocab, or the preset's) is "target"; `note`
    (rank 0's log) is told when the preset's choice gives way to a flag; `arch` (default: --arch's) chooses the
    preset's recipe for that architecture (Config.preset)."""
    over = {field: getattr(args, flag) for flag, field in FLAG_FIELDS.items()   # config.FLAG_FIELDS: the one table
            if flag not in ("arch", "output_vocab") and getattr(args, flag, None) is not None}
    if args.save_every is not None and args.save_every_minutes is None:
        over["save_every_minutes"] = None   # spacing in steps asked for: a resumed run keeps it
    cfg = Config.preset(args.preset, arch=arch or getattr(args, "arch", None) or "transformer",
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


def resolve_config(args, data, resume, lead=True, imported=None):
    """(config, settings): the resumed checkpoint's config (a flag that would change it is an error),
    or the preset's with the flags over it (and with `imported`, --init-from's model config, that
    model's fields: Config.model_fields); and the run's Settings, the recipe's flags left unset filled
    (resolve_recipe)."""
    vocab_size = data.tokenizer.vocab_size
    if resume is None and imported is not None:   # the model's fields (Config.model_fields) from it, the recipe's not
        _refuse_other_arch_flags(args, imported.arch, f"--init-from {args.init_from}", "")
        cfg = build_config(args, vocab_size, None, arch=imported.arch)   # the recipe of the preset for its architecture
        fields = imported.model_fields()
        if imported.output_layer == "target":
            fields["output_vocab"] = _widened_output_vocab(args, data, cfg, imported)
        cfg = dataclasses.replace(cfg, output_layer=imported.output_layer, **fields)
    elif resume is None:
        cfg = build_config(args, vocab_size, lambda both: target_pieces(data, vocab_size, both),
                           note=log if lead else None)
    else:
        cfg = resume.config
        _refuse_other_arch_flags(args, cfg.arch, f"the checkpoint {resume.path}", " to resume it")
        for flag, name in ((f, field) for f, field in FLAG_FIELDS.items() if f not in SCHEDULE_FLAGS):
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
    settings = resolve_recipe(args, cfg)
    if cfg.vocab_size != vocab_size:
        raise ConfigError(f"the checkpoint's vocabulary ({cfg.vocab_size}) != the tokenizer's ({vocab_size})")
    return cfg, settings


OTHER_ARCH_FLAGS = {"rnn": ("heads", "d_ff", "norm", "decoder_layers", "attention_dropout", "relu_dropout"),
                    "transformer": ("attention",)}   # the flags of the architecture a model is not


def _refuse_other_arch_flags(args, arch, model, why):
    """A ConfigError for a flag of the other architecture than `arch`, the architecture of `model` (the checkpoint a
    run resumes, or --init-from's): the Config would refuse its field, by the field's name."""
    for flag in (f for f in OTHER_ARCH_FLAGS.get(arch, ()) if getattr(args, f, None) is not None):
        raise ConfigError(f"--{flag.replace('_', '-')} sets what --arch {arch} has not ({model} is "
                          f"{'an' if arch == 'rnn' else 'a'} {arch} model); drop the flag{why}")


def _widened_output_vocab(args, data, cfg, imported):
    """--init-from a model whose output layer scores the pieces of its training data's target side (--output-vocab
    target): those and the new corpus's target pieces (its source pieces too with --bidirectional-epochs), so every
    target of the new corpus can be scored and produced. The parameters do not depend on it (the embedding has a row
    for every piece)."""
    if cfg.bpe_dropout_target:
        raise ConfigError(f"--bpe-dropout-target makes pieces the plain segmentation does not, and --init-from "
                          f"{args.init_from} scores only the pieces of its training data's target side "
                          f"(--output-vocab target): use one or the other")
    vocab_size = data.tokenizer.vocab_size
    ids = set(imported.output_ids().tolist())
    ids |= set(parse_id_ranges(target_pieces(data, vocab_size, bool(cfg.bidirectional_epochs)), vocab_size).tolist())
    return id_ranges(sorted(ids))


def target_pieces(data, vocab_size, both_sides=False):
    """The pieces of the training data's target side (and source side, `both_sides`), with EOS (every
    sentence's last target) and the unknown piece (how a reference piece outside them is scored), as
    the config's output_vocab ranges."""
    ids = set(data.train.pieces(vocab_size).tolist()) | {UNK_ID, EOS_ID}
    if both_sides:
        ids |= set(data.train.pieces(vocab_size, side="source").tolist())
    return id_ranges(sorted(ids))


class Settings(argparse.Namespace):
    """A run's flags after the recipe filled the ones left unset (resolve_recipe), read-only: the
    loop, the run folder and the end read one settled value of each."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __setattr__(self, name, value):
        raise AttributeError(f"the run's settings are settled before training (recipe.resolve_recipe); "
                             f"{name} is read-only")


def resolve_recipe(args, cfg):
    """The run's Settings: the flags, with the ones left unset filled from the preset's (or the
    resumed checkpoint's) recipe: max_steps, alpha, average_last, keep_last (average_last + 1: a
    final off-grid checkpoint never pushes an averaged one out), and ONE checkpoint spacing, in
    steps or in minutes of training (validation on the same clock). `args` is not changed."""
    s = dict(vars(args))
    s["max_steps"] = cfg.max_steps if s["max_steps"] is None else s["max_steps"]
    s["alpha"] = cfg.decode_alpha if s["alpha"] is None else s["alpha"]
    s["average_last"] = cfg.average_last if s["average_last"] is None else s["average_last"]
    s["keep_last"] = s["average_last"] + 1 if s["keep_last"] is None else s["keep_last"]
    if s["save_every"] is None and s["save_every_minutes"] is None:
        s["save_every"], s["save_every_minutes"] = cfg.save_every, cfg.save_every_minutes
    if s["save_every_minutes"]:
        s["save_every"] = None
    if s["valid_every"] is None and s["valid_every_minutes"] is None:   # validate with the checkpoints' clock
        if s["save_every_minutes"]:
            s["valid_every_minutes"] = s["save_every_minutes"]
        else:
            s["valid_every"] = VALID_EVERY
    if cfg.lr_fade and not s["max_steps"] and not s["time_budget"]:
        raise ConfigError(f"--lr-fade {cfg.lr_fade} fades the learning rate to 0 at the run's end, but this run has "
                          f"none: give --time-budget or --max-steps, or --lr-fade 0")
    if s["average_last"] > s["keep_last"]:
        raise ConfigError(f"--average-last {s['average_last']} > --keep-last {s['keep_last']}: keep at least as "
                          f"many checkpoints as you average")
    return Settings(**s)


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
