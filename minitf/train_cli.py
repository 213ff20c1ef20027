"""Train the Transformer of "Attention Is All You Need" and report sacreBLEU (the same flags as
`minitf-train` and `python -m minitf train` of an installed package).

The paper's base model on WMT14 English->German (downloads the data, ~4.5M pairs):
    python train_wmt.py --device gpu
The paper's second task, WMT14 English->French (36M pairs, 32000 pieces; the paper's big model used dropout 0.1
there, not the preset's 0.3):
    python train_wmt.py --device gpu --src en --tgt fr --preset big --dropout 0.1
Your own parallel corpus (PREFIX.<src> / PREFIX.<tgt>, plain or .gz), like fairseq's --trainpref:
    python train_wmt.py --train data/train --valid data/dev --test news=data/test --src en --tgt de
The corpus is tokenized and cleaned once into a binarized cache (~/.cache/minitf/bin, or
--cache-dir) that every later start and --resume memory-maps; `python -m minitf prepare`
(same data flags) builds it ahead of time.
Multi30k on a 2-core CPU for 30 minutes (the small preset, chosen for --device cpu; it downloads
Multi30k, or offline reads it from --data-dir FOLDER holding train/val/test_2016_flickr .en/.de);
two ranks, one per core, trained 23% faster than one process (measured with 3+3 layers 256 wide and 4,096-token updates) (drop `mpiexec -n 2` without MPI):
    mpiexec -n 2 python train_wmt.py --dataset multi30k --device cpu --time-budget 1800 --out runs/m30k
On several GPUs or CPU processes, one or several machines (pip install -e ".[dist]"; docs/distributed.md);
the preset's tokens per update (base: 25000, as in the paper) are split over the ranks:
    mpiexec -n 8 python train_wmt.py --device gpu
Continue an interrupted run (Ctrl-C saves a checkpoint) exactly where it stopped, with the run's data, device,
batch and schedule flags (read from OUT/config.json; a flag given again takes their place: --max-steps sets a new end,
--time-budget a time limit beside the run's --max-steps):
    mpiexec -n 2 python train_wmt.py --out runs/m30k --resume    (the run's ranks again: config.json says how many)
Prints a validation line (the label-smoothed loss, the NLL, the perplexity exp(NLL), greedy BLEU) every --valid-every updates (base/big: at every
checkpoint).
Writes OUT/config.json (the config, the flags given and the tokenizer's hash, which --resume checks against),
OUT/train_log.jsonl, OUT/checkpoint_*.npz (the last --keep-last kept), OUT/checkpoint_best.npz (best
validation BLEU; the loss with --valid-bleu-sentences 0), OUT/averaged.npz (the last checkpoints, the final one included), OUT/model.npz
(the average or the last checkpoint, whichever has the lower validation loss: the model scored),
OUT/<set>.hyp.<tgt> (the validation set and each test set) and OUT/results.json.
"""
import argparse
import os

from minitf.config import ARCHS, ATTENTIONS, FLAG_FIELDS, NORM_POSITIONS, PRESETS, preset_defaults
from minitf.data.pipeline import add_data_args, check_data_args, subword_model
from minitf.flags import MAX_ALPHA, MAX_BEAM, Number, Parser, fraction, path_arg, positive

MAX_BUDGET_S = 1e9   # --time-budget's largest, ~32 years (1e308 s had overflowed the projection of the run's end)


def build_parser(prog=None):
    from minitf import __version__
    p = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.ends_mpi_job = True   # every rank parses its own flags: one refusing them ends the job (distributed.end_job)
    p.add_argument("--version", action="version", version=f"minitf {__version__}")
    add_data_args(p)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model size and recipe: base and big are the paper's; small trains on a CPU in minutes "
                        "(default: base with --device gpu, small with --device cpu)")
    p.add_argument("--arch", choices=ARCHS,
                   help="transformer (default), or rnn: the recurrent baseline with attention (docs/rnn_vs_transformer.md)")
    p.add_argument("--attention", choices=ATTENTIONS,
                   help="--arch rnn: Luong's general or dot score, or Bahdanau's additive score (default: additive in the "
                        "small preset, general in the others)")
    p.add_argument("--d-model", type=positive(), help="model width D (--arch rnn: the embeddings' and the output's; its "
                                                       "LSTMs' width is the preset's)")
    p.add_argument("--heads", type=positive(), help="attention heads H")
    p.add_argument("--d-ff", type=positive(), help="feed-forward width F (--arch rnn has none)")
    p.add_argument("--layers", type=positive(), help="layers of the encoder (the paper's N), and of the decoder unless --decoder-layers")
    p.add_argument("--decoder-layers", type=positive(),
                   help="layers of the decoder when it differs from the encoder's --layers (default: the same)")
    p.add_argument("--norm", choices=NORM_POSITIONS,
                   help="where each sublayer's LayerNorm sits: post, LayerNorm(x + Sublayer(x)) (the paper's), or pre, "
                        "x + Sublayer(LayerNorm(x)) with a LayerNorm after each stack (not in the paper; "
                        "docs/deviations.md)")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                   help="where to train: the CPU (NumPy), or a CUDA GPU (CuPy: pip install -e \".[gpu]\"); under "
                        "mpiexec each rank takes its machine's GPU of its local rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                   help="parameters and activations (float64: exact checks, e.g. one process against several ranks)")
    p.add_argument("--fp16", action="store_true",
                   help="mixed precision: float16 activations/matmuls, float32 master weights, dynamic loss scaling (for GPUs)")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision in bfloat16: bfloat16 activations/matmuls, float32 master weights, no loss "
                        "scaling (bfloat16 has float32's range); --device gpu only (Ampere or newer), needs ml_dtypes")
    p.add_argument("--no-tf32", action="store_true",
                   help="on a GPU in float32, run the matrix products in full float32 (default: TF32 tensor cores, "
                        "float32 storage with products of 10-bit-mantissa inputs, on Ampere and newer; without this "
                        "flag a CUPY_TF32 already set in the environment decides)")
    p.add_argument("--out", type=path_arg, default="runs/train", help="output folder: a new one, a folder of other files, or a run's "
                   "to --resume (a new run in a folder holding an earlier run's model.npz, averaged.npz or "
                   "results.json without its checkpoints, or a config.json no minitf run wrote, is refused)")
    p.add_argument("--max-steps", type=Number(int, 0, meaning=" (0 = no limit)"),
                   help="updates (the paper: base 100k, big 300k); 0 = no limit")
    p.add_argument("--time-budget", type=positive(float, high=MAX_BUDGET_S), help="stop training after this many seconds of it (at most 1e9), over all "
                                                              "the run's starts (a --resume counts the earlier ones; "
                                                              "the validations and checkpoints, the last ones included, "
                                                              "count; the end's average and test scores do not)")
    p.add_argument("--max-tokens", type=positive(),
                   help="tokens per batch and side on each rank, padding included (fairseq's meaning); default: the "
                        "preset's tokens per update (base/big 25000 as in the paper, small 3072 (4096 with --arch rnn), tiny 512) split over the "
                        "ranks x --update-freq batches of an update, so any number of ranks makes the same update")
    p.add_argument("--update-freq", type=positive(), default=1, help="batches accumulated per update on each rank")
    p.add_argument("--warmup", type=positive(), help="warmup steps (paper: 4000)")
    p.add_argument("--lr-factor", type=positive(float),
                   help="multiplies the paper's learning rate")
    p.add_argument("--lr-fade", type=fraction(), metavar="FRACTION",
                   help="fade the learning rate linearly to 0 over this last fraction of the run (of --time-budget "
                        "or --max-steps, whichever ends it first); 0 = the paper's schedule")
    p.add_argument("--weight-decay", type=fraction(closed=False), metavar="LAMBDA",
                   help="decoupled weight decay (AdamW, Loshchilov & Hutter 2019): every update also shrinks each "
                        "weight by the fraction learning rate x LAMBDA of itself; 0 = the paper's Adam")
    p.add_argument("--dropout", type=fraction(closed=False), help="dropout on every sublayer output and the embedding sums (paper: 0.1; big: 0.3 for "
                        "en-de, 0.1 for en-fr)")
    p.add_argument("--attention-dropout", type=fraction(closed=False),
                   help="dropout on the attention weights (not in the paper, which has none)")
    p.add_argument("--relu-dropout", type=fraction(closed=False),
                   help="dropout on the feed-forward layer's hidden ReLU output (not in the paper)")
    p.add_argument("--label-smoothing", type=fraction(closed=False),
                   help="label smoothing eps_ls (paper: 0.1)")
    p.add_argument("--bpe-dropout-source", type=fraction(closed=False), metavar="PROB",
                   help="BPE-dropout on the source side: each epoch segments the training sentences anew, each merge "
                        "skipped with probability PROB (not in the paper)")
    p.add_argument("--bpe-dropout-target", type=fraction(closed=False), metavar="PROB",
                   help="the same on the target side")
    p.add_argument("--bidirectional-epochs", type=Number(int, 0, meaning=" (0 = one direction)"), metavar="EPOCHS",
                   help="bidirectional training: the first EPOCHS epochs train on the pairs in both directions, source "
                        "-> target and target -> source (twice the pairs an epoch), the rest on source -> target alone "
                        "(Ding et al. 2021; not in the paper; --output-vocab target then scores both sides' pieces)")
    p.add_argument("--output-vocab", choices=("joint", "target"),
                   help="the pieces the output layer scores: joint, all of the joint vocabulary (the paper's), or "
                        "target, only those on the target side of the training data (a smaller, faster output layer; "
                        "docs/deviations.md)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in --out, with its model and recipe (a model or recipe flag that "
                        "differs from the checkpoint's is an error: model size, --arch, --attention, --norm, dropout, "
                        "label smoothing, BPE-dropout, --bidirectional-epochs, --output-vocab, --warmup, the rate, "
                        "--lr-fade, --weight-decay; so are another direction, --src/--tgt, weights in another --dtype, "
                        "--tokenizer, --vocab-size or --subword naming another tokenizer than the checkpoint's, "
                        "and --max-len or --max-ratio cleaning the corpus otherwise than the run's first start; "
                        "the run's schedule may change: --max-steps, --save-every, "
                        "--save-every-minutes, --average-last, and --max-tokens as long as the batches keep their "
                        "size); the data, device, batch and schedule flags left out are the run's, as --out's "
                        "config.json records them (the first start's, and those a resume gave)")
    p.add_argument("--init-from", type=path_arg, metavar="MODEL",
                   help="fine-tune a trained model, a minitf checkpoint (.npz, e.g. another run's model.npz, or a "
                        ".safetensors export) or a Marian model (an OPUS-MT folder: the .npz, its vocabulary .yml, "
                        "source.spm and target.spm; docs/interop.md): start from its weights and tokenizer. Its "
                        "architecture replaces the preset's; the recipe (dropout, schedule, tokens per update) is the "
                        "preset's and the flags'")
    p.add_argument("--seed", type=Number(int, 0, 2**32 - 1), default=1,
                   help="the initial weights, the batches' order and the dropout masks follow it (a resume keeps it)")
    p.add_argument("--log-every", type=positive(), default=50,
                   help="updates between train_log.jsonl records (and a record of the updates since the last at the "
                        "run's end), and between progress lines when stderr is not a terminal")
    p.add_argument("--valid-every", type=Number(int, 0, meaning=" (0 = never)"),
                   help="updates between validations: loss, perplexity and greedy BLEU on the validation set, on the "
                        "console and in train_log.jsonl, and OUT/checkpoint_best.npz at a new best BLEU (the loss with --valid-bleu-sentences 0) (default: "
                        "200; with checkpoints spaced in minutes, base/big, at every checkpoint); 0 = never")
    p.add_argument("--valid-every-minutes", type=positive(float), help="minutes of training between validations (instead of "
                                                              "--valid-every)")
    p.add_argument("--valid-bleu-sentences", type=Number(int, 0, meaning=" (0 = loss only)"), default=500,
                   help="validation BLEU on this many sentences spread evenly over the validation set, always the "
                        "same ones (all when it has fewer); 0 = loss only")
    p.add_argument("--patience", type=Number(int, 0, meaning=" (0 = off)"), default=0,
                   help="stop early when validation BLEU (the loss with --valid-bleu-sentences 0) has not improved for "
                        "this many validations in a row, as fairseq's --patience; the run then averages, chooses and "
                        "scores its model as at the end of its budget (0 = off)")
    p.add_argument("--save-every", type=positive(), help="steps between checkpoints (default from the preset: small 80, tiny 10)")
    p.add_argument("--save-every-minutes", type=positive(float),
                   help="minutes of training between checkpoints (default base/big: 10, the paper's spacing)")
    p.add_argument("--keep-last", type=positive(), help="checkpoints kept, the newest among them (one saved off the "
                   "--save-every spacing, at a stop, gives way before one on it; default: --average-last + 1)")
    p.add_argument("--average-last", type=positive(),
                   help="checkpoints averaged at the end: the final one and the evenly spaced ones before it from "
                        "the run's second half (default from the preset: base 5, big 20, as in the paper)")
    p.add_argument("--beam", type=Number(int, 1, MAX_BEAM), default=4,
                   help="beam size for the final evaluation (paper: 4; 1 = greedy)")
    p.add_argument("--alpha", type=Number(float, 0, MAX_ALPHA), default=None,
                   help="length penalty alpha of beam search (paper: 0.6; default: the preset's, small 2.0, "
                        "small with --arch rnn 1.5)")
    p.add_argument("--decode-batch", type=positive(), default=100, help="sentences decoded together")
    p.add_argument("--max-nonfinite", type=positive(), default=5, help="stop after this many non-finite updates in a row (a non-finite "
                        "loss, or non-finite gradients without --fp16, whose overflows only lower the loss scale)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (on a terminal) or progress lines (elsewhere); validation results and "
                        "messages are still printed")
    add_preset_defaults(p)
    add_plain_defaults(p)
    return p


def add_plain_defaults(p):
    """A flag with a default of its own (not a preset's) says it at the end of its --help, read from the parser, so the
    text cannot drift from the value (--out, --dtype, --seed, --decode-batch ... had not said theirs)."""
    for action in p._actions:
        unset = action.default is None or action.default is False or action.default == [] \
            or action.default == argparse.SUPPRESS   # (0 is a default to say: --patience 0)
        if action.help and not unset and "default" not in action.help and "[presets:" not in action.help:
            action.help = f"{action.help} (default: {action.default})"


# the table's flags whose default is not one number a preset sets (their help says how it is chosen)
_RULED = ("max_tokens", "save_every", "save_every_minutes", "decoder_layers", "arch", "attention")


def add_preset_defaults(p):
    """Each model and recipe flag's --help ends with what every preset sets its field to, read from
    the one table (config.FLAG_FIELDS) and the presets, so the numbers cannot drift from them."""
    for action in p._actions:
        field = FLAG_FIELDS.get(action.dest)
        if field is not None and action.dest not in _RULED:
            action.help = f"{action.help or ''} [presets: {preset_defaults(field)}]".lstrip()


def check_precision_args(p, args):
    """--fp16 / --bf16 against --dtype, --device and --arch."""
    half = [flag for flag in ("fp16", "bf16") if getattr(args, flag)]
    if len(half) == 2:
        p.error("--fp16 and --bf16 each choose the 16-bit dtype of mixed precision: give one")
    if half and args.dtype == "float64":
        p.error(f"--{half[0]} computes in 16 bits beside float32 master weights: drop --dtype float64")
    if half and args.arch == "rnn":
        p.error(f"mixed precision (--{half[0]}) is for the Transformer; train --arch rnn in float32")
    if getattr(args, "no_tf32", False) and (args.device != "gpu" or half or args.dtype != "float32"):
        p.error("--no-tf32 concerns the float32 products of --device gpu (without --fp16, --bf16 or --dtype float64)")
    if args.bf16 and args.device != "gpu":
        p.error("--bf16 is for --device gpu: NumPy has no bfloat16 arithmetic of its own (ml_dtypes' loops widen "
                "products to float32); on the CPU train in float32 (or --fp16)")


def _given(p, argv):
    """The dests the command line gives (argparse fills a dest with its default only where the namespace lacks it)."""
    unset = object()
    ns = argparse.Namespace(**{a.dest: unset for a in p._actions
                               if a.dest != argparse.SUPPRESS and not isinstance(a, argparse._AppendAction)})
    ns = p.parse_args(argv, namespace=ns)
    return {dest for dest, value in vars(ns).items() if value is not unset and value != []}


def _same_path(a, b):
    """Whether two paths name one file or folder (as typed, or from this folder)."""
    return a == b or (a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b))


def _same_data(args, given, before):
    """Whether the data flags given again (--dataset, --train, --valid) name the first start's data (config.json records
    the paths absolute): then its --test sets stay the run's (a repeated --train had dropped them)."""
    from minitf.runfolder import RUN_PATHS
    for dest in given.intersection(("dataset", "train", "valid")):
        value = getattr(args, dest)
        if dest in RUN_PATHS and isinstance(value, str):
            value = os.path.abspath(value)
        if value != before.get(dest):
            return False
    return True


def _same_cleaning(p, args, given, before, restart):
    """--max-len or --max-ratio given to a resume with another rule than the run's first start (the rules its corpus
    was cleaned with): refused naming the flag (the cache had refused it as data changed, "cleaning rule max_ratio")."""
    from minitf.data.pipeline import ratio_rule
    if restart or not given.intersection(("max_len", "max_ratio")):
        return

    def rule(dest, value):   # the rule a value sets: --max-ratio's default depends on the run's data
        if dest == "max_len":
            return value
        return ratio_rule(value, before.get("train"), before.get("dataset"), before.get("src"), before.get("tgt"))
    compared = [dest for dest in ("max_len", "max_ratio") if dest in given and dest in before]
    try:
        rules = [(f"--{dest.replace('_', '-')}", getattr(args, dest), before[dest], rule(dest, getattr(args, dest)),
                  rule(dest, before[dest])) for dest in compared]
    except KeyError:   # a record of another dataset than minitf knows: the cache's own check stays
        return
    for flag, now, then, rule_now, rule_then in rules:
        if rule_now != rule_then:
            rule = f"{flag} {then}" if then is not None else f"{flag} {rule_then or 0}, the default"
            p.error(f"{flag} {now}: the run in --out {args.out} cleans its corpus with {rule} (its config.json "
                    f"says), which made the batches it trains on; drop {flag} to resume it, or start a new --out")


def restore_first_start(p, args):
    """--resume: the flags of runfolder.RESUMED_GROUPS the command line does not give, from OUT/config.json (a run's
    first start records them, its paths made absolute: runfolder.RUN_PATHS); returns the flags taken, as they would be
    typed. A later error about a flag (p.error) says the flags came from there."""
    from minitf.runfolder import RECORD, RESUMED_GROUPS, UnreadableRecord, checkpoint_paths, read_run_record
    path = os.path.join(args.out, RECORD)
    given = set(args.given)
    try:
        record = read_run_record(args.out)
    except UnreadableRecord as e:
        if given.intersection(RESUMED_GROUPS[0]):   # the data named again: the run can go on without the record
            return []
        p.error(f"--resume: {path} is unreadable ({e.reason}), so the run's recorded flags cannot be read from it: give "
                f"the run's data flags again (--dataset or --train/--valid, --src, --tgt, ...), or put back the file")
    if record is None:   # the command line alone: unless it names no data, where the default (WMT14) would be taken
        if checkpoint_paths(args.out) and not given.intersection(RESUMED_GROUPS[0]):
            p.error(f"--resume: {path} is missing, so the run's recorded flags cannot be read from it: give the run's "
                    f"data flags again (--dataset or --train/--valid, --src, --tgt, ...), or put back the file")
        return []
    before = record["args"]
    restart = not checkpoint_paths(args.out)   # stopped before its first checkpoint: flags given take their place
    if "preset" in given and before.get("preset") not in (None, args.preset) and not restart:   # the checkpoint's
        p.error(f"--preset {args.preset}: the run in --out {args.out} was started with --preset {before['preset']}, "
                f"whose model and recipe its checkpoint carries; drop --preset to resume it, or start a new --out")
    if "init_from" in given and not _same_path(args.init_from, before.get("init_from")) and not restart:
        started = f"from {before['init_from']}" if before.get("init_from") else "from no model (--init-from)"
        p.error(f"--init-from {args.init_from}: the run in --out {args.out} was started {started}, and --resume "
                f"continues it from its last checkpoint; drop --init-from to resume it, or start a new --out")
    if "seed" in given and before.get("seed") not in (None, args.seed) and not restart:
        p.error(f"--seed {args.seed}: the run in --out {args.out} was started with --seed {before['seed']}, which its "
                f"batches and dropout follow; drop --seed to resume it, or start a new --out")
    _same_cleaning(p, args, given, before, restart)
    defaults = {a.dest: a.default for a in p._actions}
    taken = []
    for group in RESUMED_GROUPS:
        if given.intersection(group) or not all(dest in before for dest in group):
            continue
        if group == ("test",) and not _same_data(args, given, before):   # other data named: not its test sets
            continue
        if group[0] == "tokenizer" and before.get("tokenizer") and not os.path.exists(before["tokenizer"]) \
                and not restart:   # the checkpoint carries the tokenizer: a --tokenizer file moved away is not needed
            continue
        if group in (("data_dir",), ("offline",)) and (given.intersection({"train", "valid"}) or before.get("train")
                                                         or "dataset" in given and args.dataset != before.get("dataset")):
            continue   # --dataset's flags, where own files (or another --dataset) are in play: not taken
        for dest in group:
            value = before[dest]
            if dest == "test":
                value = [tuple(pair) for pair in value or ()]
            setattr(args, dest, value)
            if value != defaults.get(dest) and value is not False and value is not None and value != []:
                flag = "--" + dest.replace("_", "-")
                taken.extend([f"{flag} {name}={prefix}" for name, prefix in value] if dest == "test"
                             else [flag if value is True else f"{flag} {value}"])
    if restart:   # stopped before its first checkpoint: no checkpoint brings the model's and
        # the recipe's flags (nor --init-from), so every recorded flag is taken, and the run starts afresh (the model
        # of the defaults had been trained instead, config.json then written over with them)
        grouped = {dest for group in RESUMED_GROUPS for dest in group}
        for dest, value in before.items():
            if dest in grouped or dest in given or dest in ("out", "resume") or dest not in defaults:
                continue
            setattr(args, dest, value)
            if value != defaults[dest] and value is not False and value is not None and value != []:
                taken.append(f"--{dest.replace('_', '-')}" + ("" if value is True else f" {value}"))
        args.resume, args.restarted = False, True
    if taken:
        error = p.error
        p.error = lambda message: error(f"{message} (with the run's recorded flags from {path}: {' '.join(taken)})")
    return taken


def parse_args(argv=None, prog=None):
    """The flags, checked: a bad value or combination is one line on stderr and exit status 2."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    args.given = sorted(_given(p, argv)) if args.resume else []   # what a resume compares with its checkpoint
    args.restored = restore_first_start(p, args) if args.resume else []
    args.preset_chosen = args.preset is None   # chosen for the device (the run says so in one line)
    if args.preset is None:
        args.preset = "small" if args.device == "cpu" else "base"
    check_data_args(p, args)
    check_precision_args(p, args)
    if args.decoder_layers is not None and args.arch == "rnn":
        p.error("--decoder-layers is the Transformer's; --arch rnn's --layers sizes its encoder and decoder alike")
    for flag in ("d_ff", "heads"):
        if getattr(args, flag) is not None and args.arch == "rnn":
            p.error(f"--{flag.replace('_', '-')} sizes the Transformer's layers; --arch rnn has none "
                    f"(its sizes: --d-model and --layers)")
    if args.norm is not None and args.arch == "rnn":
        p.error("--norm places the LayerNorms of the Transformer's residual blocks; --arch rnn has none")
    for flag in ("attention_dropout", "relu_dropout"):
        if getattr(args, flag) and args.arch == "rnn":
            p.error(f"--{flag.replace('_', '-')} is the Transformer's; --arch rnn has only --dropout")
    if args.output_vocab == "target" and args.bpe_dropout_target:
        p.error("--output-vocab target scores the pieces of the target side's plain segmentation; "
                "--bpe-dropout-target makes smaller ones: use one or the other")
    if args.bidirectional_epochs and (args.bpe_dropout_source or args.bpe_dropout_target):
        p.error("--bidirectional-epochs and BPE-dropout each choose an epoch's training pairs: use one or the other")
    if (args.bpe_dropout_source or args.bpe_dropout_target) and not (args.tokenizer or args.resume or args.init_from):
        subword = subword_model(args)
        if subword != "bpe":
            p.error(f"BPE-dropout resegments with BPE merges, and this run would train a {subword} tokenizer ("
                    f"{'--subword ' + subword if args.subword else 'the ' + args.dataset + ' default'}): add --subword bpe")
    if args.attention is not None and (args.arch == "transformer" or args.arch is None and not (args.resume
                                                                                                  or args.init_from)):
        p.error("--attention chooses the attention of --arch rnn; the Transformer's is multi-head scaled dot-product")
    if (args.d_model or args.heads) and args.arch != "rnn" and not (args.resume or args.init_from):   # (else the
        # model's sizes are the checkpoint's: recipe.resolve_config compares the flags with them)
        d, h = args.d_model or PRESETS[args.preset]["d_model"], args.heads or PRESETS[args.preset]["n_heads"]
        if d % h:
            p.error(f"--d-model {d} is not divisible by --heads {h} (each head gets d_model / heads); "
                    f"change one of them")
    if args.init_from is not None:
        check_init_from(p, args)
    if args.valid_every is not None and args.valid_every_minutes is not None:
        p.error("--valid-every (updates) and --valid-every-minutes: give one spacing")
    if args.patience and args.valid_every == 0:
        p.error(f"--patience {args.patience} counts validations, and --valid-every 0 makes none: give a spacing")
    if args.save_every and args.save_every_minutes:
        p.error("--save-every (steps) and --save-every-minutes: give one spacing")
    if args.average_last and args.keep_last and args.average_last > args.keep_last:
        p.error(f"--average-last {args.average_last} > --keep-last {args.keep_last}: keep at least as many as you average")
    _check_out(p, args)
    return args


def check_init_from(p, args):
    """--init-from names a minitf checkpoint or a Marian model, and no flag asks for another model or tokenizer."""
    from .marian import is_marian
    if not os.path.exists(args.init_from):
        p.error(f"--init-from {args.init_from}: no such file or folder")
    if not is_marian(args.init_from) and not os.path.isfile(args.init_from):
        p.error(f"--init-from {args.init_from}: a folder, but not a Marian model (one with decoder.yml, or with one "
                f".npz holding special:model.yml, beside its vocabulary .yml, source.spm and target.spm); a minitf "
                f"model is a file: name its .npz (e.g. a run's model.npz) or .safetensors")
    taken = [f"--{flag.replace('_', '-')}" for flag in ("tokenizer", "subword", "vocab_size", "d_model", "heads", "d_ff",
                                                       "layers", "decoder_layers", "norm", "output_vocab", "attention")
             if getattr(args, flag, None) is not None]
    if getattr(args, "arch", None) is not None:
        taken.append(f"--arch {args.arch}")
    if taken:
        p.error(f"--init-from {args.init_from} brings its own model and tokenizer: drop {', '.join(taken)}")


def _check_out(p, args):
    """--out must be (or become) a folder; --resume needs a checkpoint in it."""
    if os.path.islink(args.out) and not os.path.exists(args.out):
        p.error(f"--out {args.out} is a link to {os.readlink(args.out)}, which does not exist: create that folder, or "
                f"name another --out")
    above = os.path.abspath(args.out)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        p.error(f"--out {args.out}: {above} is a file, not a folder; choose another --out")
    from minitf.runfolder import checkpoint_paths
    # a typo in --out would otherwise start from scratch (a run stopped before its first checkpoint, its config.json
    # there, starts again from the beginning with every recorded flag: restore_first_start)
    if args.resume and not checkpoint_paths(args.out):
        p.error(f"--resume: --out {args.out} holds no checkpoint_*.npz to continue from; "
                f"drop --resume to start a new run there, or name the run's folder")


def main(argv=None, prog=None):
    """train_wmt.py, `minitf-train` and `python -m minitf train`: parse the flags, train, score;
    returns the exit status (2: a user error, in one line; 130/143: stopped by Ctrl-C / SIGTERM, saved
    unless a second Ctrl-C came first or training had not begun)."""
    from minitf.errors import SIGNAL_EXIT, Interrupted, MinitfError, nothing_half_written, one_line_warnings, \
        out_of_memory, report, sigterm_raises
    from minitf.runfolder import checkpoint_paths
    from minitf.train import MEMORY_KNOBS, train
    args = parse_args(argv, prog)
    try:
        with sigterm_raises(), one_line_warnings():   # SIGTERM before training (the data being prepared) as Ctrl-C
            train(args)
    except MinitfError as e:
        report(f"error: {e}")
        return 2
    except Interrupted as e:   # saved; 143 after SIGTERM, 130 after Ctrl-C, as a scheduler expects
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM before training began (reading data, preparing the cache)
        signame = getattr(e, "signame", "SIGINT")   # errors.Terminated's
        report(f"interrupted{' (SIGTERM)' if signame == 'SIGTERM' else ''} before training began: "
               f"{nothing_half_written(e)} (the cache and checkpoints are written whole or not at all); "
               + ("continue with --resume" if checkpoint_paths(args.out) else "run the command again"))
        return SIGNAL_EXIT[signame]
    except MemoryError as e:
        report(f"error: {out_of_memory(e, MEMORY_KNOBS)}")
        return 2
    return 0
