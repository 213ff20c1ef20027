"""From command-line flags to training data: the flags `train_wmt.py` and `python -m minitf prepare`
share, the data settings they give (`DataSettings`), and `load_data`, which finds (or downloads)
the corpus, prepares or reuses its binarized cache (`prepare.prepare_cache`) and reads the small
valid/test sets.
"""
import contextlib
import dataclasses
import hashlib
import os
import re
from dataclasses import dataclass

from minitf.errors import DataError
from minitf.flags import Number, language_arg, path_arg, positive
from minitf.data.binarized import BinarizedCorpus
from minitf.data.prepare import cache_folder, no_pairs_left, prepare_cache
from minitf.data.datasets import DATASETS, DOWNLOADED, dataset_default, default_data_dir, prepare_dataset, user_dataset
from minitf.data.readers import notes_off
from minitf.data.tokenizer import MODEL_TYPES


def _test_arg(text):
    import argparse
    name, sep, prefix = text.partition("=")
    if not sep or not name or not prefix:
        raise argparse.ArgumentTypeError(f"expected NAME=PREFIX (e.g. newstest2014=data/test), got {text!r}")
    if not re.fullmatch(r"[\w-][\w.-]*", name):   # it names OUT/NAME.hyp.<tgt>: no folders, no hidden file
        raise argparse.ArgumentTypeError(f"NAME {name!r} in {text!r}: letters, digits, '.', '-' and '_' only, not "
                                         f"starting with '.' (it names the file OUT/NAME.hyp.<tgt>)")
    return name, path_arg(prefix)


def add_data_args(p):
    """The data flags, on an argparse parser."""
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="wmt14", choices=sorted(DATASETS),
                   help="a known dataset, downloaded when missing (default wmt14; ignored with --train)")
    g.add_argument("--data-dir", type=path_arg, help="folder with the corpus files (plain or .gz), which are downloaded into it where "
                        "missing (not with --offline); default $MINITF_CACHE/<dataset> or ~/.cache/minitf/<dataset>")
    g.add_argument("--offline", action="store_true", help="never download: fail if files are missing")
    g.add_argument("--src", type=language_arg, help="source language (default en); with --train and files of other languages, give it")
    g.add_argument("--tgt", type=language_arg, help="target language (default de); with --train and files of other languages, give it")
    g.add_argument("--train", type=path_arg, metavar="PREFIX", help="your own training corpus: PREFIX.<src> and PREFIX.<tgt> (plain or .gz)")
    g.add_argument("--valid", type=path_arg, metavar="PREFIX", help="your own validation set (with --train)")
    g.add_argument("--test", metavar="NAME=PREFIX", action="append", type=_test_arg, default=[],
                   help="your own test set, scored at the end (repeatable; with --train)")
    g.add_argument("--vocab-size", type=positive(),
                   help="joint subword pieces of the tokenizer trained (default: wmt14 en-de 37000, en-fr 32000; "
                        "multi30k and own data 8000; not with --tokenizer, whose model has its own)")
    g.add_argument("--subword", choices=MODEL_TYPES,
                   help="the joint SentencePiece model to train: bpe (byte-pair encoding, the paper's for en-de) or unigram "
                        "(a unigram language model); default: multi30k unigram, wmt14 and own data bpe; not with "
                        "--tokenizer")
    g.add_argument("--tokenizer", type=path_arg, metavar="MODEL", help="encode with this SentencePiece model (ids pad,unk,bos,eos = 0,1,2,3) "
                                                        "instead of training one")
    g.add_argument("--max-len", type=positive(), default=250, help="drop training pairs with a side longer than this many pieces")
    g.add_argument("--max-ratio", type=Number(float, 1, allowed=(0,), meaning=" (0 = no ratio rule)"),
                   help="drop training pairs whose sides' lengths differ by more than this factor "
                        "(default: wmt14 and own data 1.5, multi30k none; 0 = none)")
    g.add_argument("--cache-dir", type=path_arg, help="where binarized corpora are kept (default: $MINITF_CACHE/bin or ~/.cache/minitf/bin)")
    return g


def check_data_args(p, args):
    """parser.error for inconsistent data flags (before any data work)."""
    if args.train and not args.valid:
        p.error("--train needs --valid PREFIX (a held-out set for validation loss and BLEU)")
    if (args.valid or args.test) and not args.train:
        p.error("--valid/--test name your own files: give --train PREFIX too (or use --dataset)")
    own = [flag for flag, given in (("--data-dir", getattr(args, "data_dir", None)),
                                    ("--offline", getattr(args, "offline", False))) if given]
    if args.train and own:   # they had been ignored: --train's prefixes are read as given, from the current folder
        p.error(f"{' and '.join(own)} {'are' if len(own) > 1 else 'is'} for --dataset's files; --train/--valid/--test "
                f"name your own files as paths (PREFIX.<lang>, from the current folder): drop "
                f"{'them' if len(own) > 1 else 'it'}, or put the folder into the prefixes")
    names = [name for name, _ in args.test or ()]
    for name in names:
        if name == "valid":   # results.json, the log and the summary name the validation set's scores so
            p.error("--test valid=...: 'valid' names the validation set's scores; give the test set another NAME")
        if names.count(name) > 1:
            p.error(f"--test {name}=... is given {names.count(name)} times: give each test set its own NAME")
    if args.train and args.src is None and args.tgt is None:   # the direction is not guessed from other files
        langs = own_languages(args.train)
        if len(langs) > 2 or (len(langs) == 2 and set(langs) != {"en", "de"}):
            p.error(f"--train {args.train} has files for {', '.join(langs)}: name the pair with --src and --tgt "
                    f"(without them a run trains en -> de)")
    args.src, args.tgt = args.src or "en", args.tgt or "de"
    if args.src == args.tgt:
        p.error(f"--src and --tgt are both {args.src!r}")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        p.error(f"--tokenizer {args.tokenizer}: " + ("a folder, not a SentencePiece model file"
                                                     if os.path.isdir(args.tokenizer) else "file not found"))
    if args.tokenizer and getattr(args, "subword", None):
        p.error(f"--subword {args.subword} trains a tokenizer and --tokenizer gives one: use one or the other")
    if args.tokenizer and getattr(args, "vocab_size", None):   # it had been ignored: the given model's size decides
        p.error(f"--vocab-size {args.vocab_size} trains a tokenizer of that many pieces and --tokenizer gives one: "
                f"use one or the other")


def own_languages(prefix):
    """The language codes PREFIX.<code> (or PREFIX.<code>.gz) files exist for, sorted."""
    import glob
    import re
    found = set()
    for path in glob.glob(glob.escape(prefix) + ".*"):
        m = re.fullmatch(r"([A-Za-z]{2,3}(?:[-_][A-Za-z]{2,4})?)(?:\.gz)?", path[len(prefix) + 1:])
        if m and os.path.isfile(path):
            found.add(m.group(1))
    return sorted(found)


def subword_model(args):
    """The SentencePiece model a run trains: --subword, else the dataset's default (own data: BPE)."""
    if getattr(args, "subword", None):
        return args.subword
    return "bpe" if args.train else dataset_default(args.dataset, "subword", args.src, args.tgt)


@dataclass(frozen=True)
class DataSettings:
    """What the data pipeline reads of a run's flags (add_data_args), and nothing else: the corpus (a
    dataset and its folder, or own --train/--valid/--test files), the direction, the tokenizer and
    cleaning choices, where the cache goes, and whether to print progress."""
    src: str = "en"
    tgt: str = "de"
    dataset: str = None
    data_dir: str = None
    train: str = None
    valid: str = None
    test: object = None
    offline: bool = False
    vocab_size: int = None
    subword: str = None
    tokenizer: str = None
    max_len: int = 250
    max_ratio: float = None
    cache_dir: str = None
    quiet: bool = False

    @classmethod
    def of(cls, args):
        """The data settings of parsed flags (a field the parser has not: its default)."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)})


@dataclass
class Data:
    """What training needs: the tokenizer, the memory-mapped training pairs, the valid/test text."""
    tokenizer: object
    corpus: BinarizedCorpus
    train: object          # TokenPairs src -> tgt
    valid: tuple           # (src_lines, tgt_lines)
    tests: dict            # name -> (src_lines, tgt_lines)

    @property
    def data_id(self):
        return self.corpus.data_id


def _refuse_a_file(flag, path, purpose):
    """A DataError where the folder flag `flag` names an existing file: 'name the folder <purpose>'."""
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"{flag} {path} is a file: name the folder {purpose}")


def _dataset_in(args, progress, notes):
    """prepare_dataset in --data-dir (else the default folder). A download that fails into a --data-dir the user
    named says which folder it was and whether it existed (a mistyped path reads as a folder to download into); a
    folder made for it and left empty is removed again."""
    given = args.data_dir
    _refuse_a_file("--data-dir", given, f"that holds (or is to hold) {args.dataset}'s files")
    fresh = bool(given) and not os.path.exists(given)
    try:
        return prepare_dataset(args.dataset, given, args.src, args.tgt,   # None: the default folder (MINITF_CACHE's)
                               download=not args.offline, progress=progress, notes=notes)
    except DataError as e:
        if not given or not hasattr(e, "http_status"):   # not a failed download (download.download's errors)
            raise
        if fresh:
            try:
                if os.listdir(given) == [DOWNLOADED]:   # nothing came down but the mark of minitf's downloads
                    os.unlink(os.path.join(given, DOWNLOADED))
                os.rmdir(given)            # only if empty: a partial download (.part) is kept to be resumed
            except OSError:
                pass
        what = "does not exist" if fresh else "does not hold every file of the train and valid sets"
        raise DataError(f"--data-dir {given} {what}, so minitf tried to download {args.dataset}'s files into it: "
                        f"{e}") from None


def load_data(args, tokenizer=None, log=None, expect_data_id=None, notes=True, verify=False, expect_corpus=None):
    """Locate (or download) the corpus of `args` (DataSettings), then prepare or reuse its binarized
    cache.

    `tokenizer`: encode with this one (a resumed checkpoint's); else `--tokenizer`, else the
    cache's or a newly trained one. `expect_data_id`, `expect_corpus`: see `prepare_cache`. `notes`: print the
    lines about a missing optional test set and a plain file beside its .gz (False on all MPI ranks but one). `verify`: check a reused
    cache's arrays against their checksums (`prepare --verify`). Returns `Data`."""
    if not isinstance(args, DataSettings):
        raise TypeError("load_data takes DataSettings (DataSettings.of(parsed flags))")
    with contextlib.nullcontext() if notes else notes_off():   # ranks other than 0: rank 0 says what it saw
        return _load_data(args, tokenizer, log, expect_data_id, notes, verify, expect_corpus)


def ratio_rule(max_ratio, train, dataset, src, tgt):
    """The length-ratio cleaning rule --max-ratio sets (None: no rule): the flag's (0: none), else 1.5 for own files
    (--train) and the dataset's default for a --dataset."""
    if max_ratio is not None:
        return max_ratio or None
    return 1.5 if train else dataset_default(dataset, "max_ratio", src, tgt)


def _load_data(args, tokenizer, log, expect_data_id, notes, verify, expect_corpus):
    from minitf.data.tokenizer import Tokenizer
    progress = not args.quiet
    _refuse_a_file("--cache-dir", args.cache_dir, "the binarized caches go into")   # before any data work
    if args.train:
        data = user_dataset(args.train, args.valid, args.test, args.src, args.tgt)
        vocab = 8000
    else:
        data = _dataset_in(args, progress, notes)
        vocab = dataset_default(args.dataset, "vocab_size", args.src, args.tgt)
    if args.vocab_size:
        vocab = args.vocab_size
    max_ratio = ratio_rule(args.max_ratio, args.train, args.dataset, args.src, args.tgt)
    if tokenizer is None and args.tokenizer:
        try:
            tokenizer = Tokenizer(args.tokenizer)
        except DataError as e:
            raise DataError(f"--tokenizer {e}") from None
    files = data["paths"]["train"]
    # one cache per corpus location: the same dataset read from two folders gets two caches
    where = hashlib.sha256(os.fsencode("\n".join(os.path.abspath(p) for pair in files for p in sorted(pair)))).hexdigest()[:8]
    root = args.cache_dir or default_data_dir("bin")   # $MINITF_CACHE/bin or ~/.cache/minitf/bin
    folder = cache_folder(root, f"{'own' if args.train else args.dataset}.{where}", (args.src, args.tgt))
    corpus = prepare_cache(folder, files, (args.src, args.tgt), vocab_size=vocab, tokenizer=tokenizer, model_type=subword_model(args),
                           max_len=args.max_len, max_ratio=max_ratio, progress=progress, log=log,
                           expect_data_id=expect_data_id, expect_corpus=expect_corpus, verify=verify)
    if len(corpus) == 0:   # a cache built empty by an earlier minitf (a build now refuses to keep no pair)
        raise no_pairs_left(corpus.manifest["counts"], files)
    return Data(corpus.tokenizer, corpus, corpus.pairs(args.src, args.tgt), data["valid"], data["tests"])
