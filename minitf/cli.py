"""minitf's commands (python -m minitf COMMAND, or minitf COMMAND once installed): train, prepare, average, translate, evaluate, plot.

Every user error (a MinitfError) is printed as one line on stderr with exit status 2.
"""
import argparse
import json
import sys

from .data.pipeline import add_data_args, check_data_args
from .errors import DataError, MinitfError


def _read_input(path):
    from .data.readers import read_lines
    if path in (None, "-"):
        return [line.rstrip("\r\n") for line in sys.stdin]
    return read_lines(path)


def cmd_prepare(args):
    from .data.pipeline import load_data
    data = load_data(args)
    m = data.corpus.manifest
    print(f"{data.corpus.folder}: {m['counts']['kept']:,} pairs, {sum(m['tokens'].values()):,} tokens, "
          f"vocabulary {m['tokenizer']['vocab_size']}, data_id {m['data_id']}; valid {len(data.valid[0]):,} "
          f"pairs, tests: {', '.join(data.tests) or 'none'}")


def cmd_average(args):
    from .checkpoint import average_checkpoints
    average_checkpoints(args.inputs, args.output)
    print(f"averaged {len(args.inputs)} checkpoints -> {args.output}", file=sys.stderr)


def cmd_translate(args):
    from .translate import load_for_inference, translate_lines
    model, tok = load_for_inference(args.checkpoint, args.device)
    args.alpha = model.cfg.decode_alpha if args.alpha is None else args.alpha
    if args.input in (None, "-") and sys.stdin.isatty() and not args.output:
        return _interactive(model, tok, args)
    lines = _read_input(args.input)
    hyps = translate_lines(model, tok, lines, args.beam, args.alpha, args.batch_size, args.max_len_b,
                           progress=not args.quiet)
    text = "".join(h + "\n" for h in hyps)
    if args.output:
        from .fileio import atomic_write
        atomic_write(args.output, lambda f: f.write(text.encode()))
    else:
        sys.stdout.write(text)


def _interactive(model, tok, args):
    """A person typing at a terminal: translate each line as it is entered (as
    fairseq-interactive does) instead of waiting for the end of input; Ctrl-D ends."""
    from .translate import translate_lines
    print("type a sentence and press Enter (Ctrl-D to end)", file=sys.stderr)
    for line in sys.stdin:
        out = translate_lines(model, tok, [line.rstrip("\r\n")], args.beam, args.alpha, 1, args.max_len_b,
                              progress=False)
        print(out[0], flush=True)


def cmd_evaluate(args):
    from .checkpoint import read_train_state
    from .translate import load_for_inference, score, translate_lines
    src, ref = _read_input(args.src), _read_input(args.ref)
    if len(src) != len(ref):
        raise DataError(f"--src {args.src} has {len(src)} lines but --ref {args.ref} has {len(ref)}")
    model, tok = load_for_inference(args.checkpoint, args.device)
    args.alpha = model.cfg.decode_alpha if args.alpha is None else args.alpha
    lang = args.lang or read_train_state(args.checkpoint).get("languages", [None, None])[1]
    hyps = translate_lines(model, tok, src, args.beam, args.alpha, args.batch_size, args.max_len_b,
                           progress=not args.quiet)
    result = score(hyps, ref, lang=lang)
    result.update(checkpoint=args.checkpoint, beam=args.beam, alpha=args.alpha)
    if lang is None:
        result.update(bleu_paper=None, bleu_paper_method="not computed: the checkpoint does not record its target "
                      "language; name it with --lang (e.g. --lang de)")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["bleu_detail"])
        print(f"BLEU {result['bleu']}  ({result['bleu_signature']})")
        print(f"chrF {result['chrf']}  ({result['chrf_signature']})")
        if result["bleu_paper"] is not None:
            print(f"paper BLEU {result['bleu_paper']}  ({result['bleu_paper_method']}; compares with Table 2)")
        else:
            print(f"note: the paper's tokenized BLEU was {result['bleu_paper_method']}")


def _decode_args(p):
    p.add_argument("--checkpoint", required=True, help="a minitf checkpoint (.npz) with its tokenizer")
    p.add_argument("--beam", type=int, default=4, help="beam size (paper: 4; 1 = greedy)")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty alpha (paper: 0.6; default: the checkpoint's preset, small 2.0)")
    p.add_argument("--max-len-b", type=int, default=50, help="max output length = input length + this")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded together")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser(prog="python -m minitf"):
    from . import __version__
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"minitf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", add_help=False, help="train a model and score it: the flags of train_wmt.py "
                                                 f"(`{prog} train --help`; the minitf-train command)")
    p = sub.add_parser("prepare", help="tokenize and clean a training corpus once into its binarized, "
                                       "memory-mapped cache (train_wmt.py does it on its first run)")
    add_data_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prepare, check=check_data_args)
    p = sub.add_parser("average", help="parameter-wise mean of checkpoints (paper 6.1)")
    p.add_argument("--inputs", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.set_defaults(func=cmd_average)
    p = sub.add_parser("translate", help="translate raw sentences (file or stdin), one per line")
    _decode_args(p)
    p.add_argument("--input", help="input file (plain or .gz); default stdin")
    p.add_argument("--output", help="output file; default stdout")
    p.set_defaults(func=cmd_translate)
    p = sub.add_parser("evaluate", help="translate --src and score against --ref with sacreBLEU and chrF, and "
                       "the paper's tokenized BLEU")
    _decode_args(p)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--lang", help="target language of the paper's tokenized BLEU (Moses tokenizer; 'de' also "
                   "splits compounds); default: the one the checkpoint was trained on")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_evaluate)
    try:
        from .viz import add_plot_parser
    except ImportError:
        pass
    else:
        add_plot_parser(sub)
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m minitf" if sys.argv[0].endswith("__main__.py") else "minitf"
    if argv[:1] == ["train"]:
        from .train_cli import main as train
        return train(argv[1:], prog=f"{prog} train")
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "check", None):
        args.check(parser, args)
    try:
        args.func(args)
    except MinitfError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
