"""minitf's commands (python -m minitf COMMAND, or minitf COMMAND once installed): train, prepare, average, translate, evaluate, score, info, export, plot.

Every user error (a bad flag, a MinitfError) is printed as one line on stderr with exit status 2.
"""
import argparse
import json
import os
import re
import sys

from .data.pipeline import add_data_args, check_data_args
from .errors import (SIGNAL_EXIT, ConfigError, DataError, MinitfError, nothing_half_written, one_line_warnings,
                     out_of_memory, report, sigterm_raises)
from .ctranslate2_export import QUANTIZATIONS
from .fileio import check_output_file, check_parent_folder, not_a_regular_file
from .flags import MAX_ALPHA, MAX_BEAM, MAX_LEN_B, Number, Parser, path_arg, positive
from .trainlog import plural


def _read_input(path):
    """The lines of a file (plain or .gz, a pipe; an .sgm file's segments), or of standard input for None or "-": UTF-8
    checked as a file's."""
    from .data.readers import read_stream_lines, read_text
    if path in (None, "-"):
        if sys.stdin is None:   # started with standard input closed (`<&-`)
            raise DataError("standard input is closed: name the input file (--input, --src, --tgt or --ref)")
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:   # a text stream put in place of sys.stdin (by a program that calls main())
            return [line.rstrip("\r\n") for line in sys.stdin]
        return read_stream_lines(stream, "standard input")
    return read_text(path)   # an .sgm file's segments (newstest2014's test set comes so), not its markup


def cmd_prepare(args):
    from .data.pipeline import DataSettings, load_data
    from .data.prepare import dropped_note
    tokenizer = None
    if args.init_from:   # the cache a fine-tuning run of that model opens: its tokenizer's ids
        from .train import init_from
        tokenizer = init_from(args).tokenizer
    data = load_data(DataSettings.of(args), tokenizer=tokenizer, verify=args.verify)
    m = data.corpus.manifest
    print(f"{data.corpus.folder}: {m['counts']['kept']:,} pairs{dropped_note(m)}, {sum(m['tokens'].values()):,} tokens, "
          f"vocabulary {m['tokenizer']['vocab_size']} ({data.tokenizer.model_type}), data_id {m['data_id']}; valid {len(data.valid[0]):,} "
          f"pairs, tests: {', '.join(data.tests) or 'none'}")


def _check_not_a_runs_model(output):
    """ConfigError where --output names a training run's own file, wherever a link points: its model.npz (which its
    results.json scores), averaged.npz (whose checkpoints results.json names), checkpoint_best.npz, or a
    checkpoint_<step>.npz, there or not (--resume and info take every such name for the run's own checkpoint). An
    average, like the model it is of, is an .npz."""
    from .runfolder import BEST, STEP_CHECKPOINT, checkpoint_paths, read_run_record
    if not output.endswith(".npz"):   # it had been written as an .npz under any name (x.pt, no extension)
        raise ConfigError(f"--output {output}: an average is a checkpoint, an .npz file: name it *.npz")
    folder, name = os.path.split(os.path.realpath(output))
    ours = name in ("model.npz", "averaged.npz", BEST) or STEP_CHECKPOINT.fullmatch(name)
    # a run's folder: its record (a config.json of something else is not one) or its checkpoints
    if ours and (read_run_record(folder, strict=False) is not None or checkpoint_paths(folder)):
        what = "the" if os.path.exists(output) else "a name of the"
        raise ConfigError(f"--output {output} is {what} {name} of the training run in {folder}: an average written "
                          f"there would be taken for the run's own (its results.json names model.npz and "
                          f"averaged.npz; --resume continues from its checkpoint_<step>.npz); name a file of another "
                          f"name, e.g. {os.path.join(folder, 'average_mine.npz')}")


def cmd_average(args):
    """Average --inputs, or the last --last training checkpoints of --folder; models that are
    not training checkpoints (an average, a run's model.npz, checkpoint_best.npz) are left out
    with a note; the output must not be one of the inputs."""
    from .checkpoint import average_checkpoints, read_train_state, role
    check_output_file(args.output, "--output")
    _check_not_a_runs_model(args.output)
    if args.folder:
        from .runfolder import checkpoint_paths
        if not os.path.isdir(args.folder):
            raise DataError(f"--folder {args.folder} " + ("is a file: name the run's folder" if os.path.exists(args.folder)
                                                          else "does not exist: name a run's --out folder"))
        from .runfolder import averaging_window
        found = checkpoint_paths(args.folder)
        if not found:
            raise DataError(f"--folder {args.folder}: no training checkpoints (checkpoint_<step>.npz) in it")
        if len(found) < args.last:
            print(f"note: --last {args.last}, but {args.folder} holds {plural(len(found), 'training checkpoint')}: "
                  f"averaging those", file=sys.stderr)
        # the run's own rule (paper 6.1: the last few, evenly spaced): the final one and those of the run's second
        # half, not one made in the warmup (a short run's first checkpoints pull an average back) or at an interrupt
        paths = averaging_window(found, args.last)
        left = [os.path.basename(p) for p in found[-args.last:] if p not in paths]
        if left:
            print(f"note: left out {', '.join(left)}: from the run's first half, or saved off its spacing at an "
                  f"interrupt (the run's own average leaves them out too)", file=sys.stderr)
    else:
        from .marian import is_marian
        paths = []
        for path in args.inputs:
            if os.path.exists(path) and is_marian(path):   # read as a minitf .npz, it had "no metadata"
                raise DataError(f"--inputs {path} is a Marian model: average takes a minitf run's checkpoints (fine-tune "
                                f"it with train_wmt.py --init-from, then average that run's)")
            if os.path.abspath(path) == os.path.abspath(args.output):   # average_checkpoints refuses it
                paths.append(path)
                continue
            kind = {"average": "an average", "reported": "a run's chosen model",
                    "best": "the best validation checkpoint"}.get(role(read_train_state(path)))
            if kind:
                print(f"note: left out {path}: {kind}, not a training checkpoint", file=sys.stderr)
            else:
                paths.append(path)
    if args.inputs and not paths:
        raise DataError("--inputs: every checkpoint given was left out (above): nothing to average; name a run's "
                        "checkpoint_<step>.npz files, or its folder with --folder")
    if args.inputs and len(paths) < len(args.inputs):
        print(f"note: averaging {plural(len(paths), 'checkpoint')} of the {len(args.inputs)} given", file=sys.stderr)
    average_checkpoints(paths, args.output)
    names = [os.path.basename(p) for p in paths]
    shown = names if len(set(names)) == len(names) else paths   # two runs' checkpoint_0000020.npz: their paths
    print(f"averaged {plural(len(paths), 'checkpoint')} ({', '.join(shown)}) -> {args.output}", file=sys.stderr)


def cmd_export(args):
    from .marian import is_marian
    if args.format == "safetensors" and is_marian(args.checkpoint):
        raise ConfigError(f"--checkpoint {args.checkpoint} is a Marian model: a .safetensors export holds a minitf "
                          f"checkpoint (one SentencePiece model for both sides); --format ctranslate2 or marian take "
                          f"it, and a model fine-tuned from it (--init-from) exports as any minitf checkpoint")
    if args.format == "safetensors":
        from .checkpoint import export_safetensors
        check_output_file(args.output, "--output")
        special = not_a_regular_file(args.output)
        if special:   # (a .safetensors file is written whole and renamed over the path)
            raise ConfigError(f"--output {args.output} is {special}: an export is a file of its own; name a file")
        from .safetensors import written_by_minitf
        if os.path.isfile(args.output) and not written_by_minitf(args.output):   # an earlier export is replaced
            raise ConfigError(f"--output {args.output} is a file minitf did not export (another model's weights?): "
                              f"an export there would replace it; name another file, or move it away")
        size = export_safetensors(args.checkpoint, args.output)
        print(f"exported {args.checkpoint} ({os.path.getsize(args.checkpoint) / 1e6:,.1f} MB) -> {args.output} "
              f"({size / 1e6:,.1f} MB: parameters, config and tokenizer; no optimizer state)", file=sys.stderr)
        return
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ConfigError(f"--out {args.output} is a file; name the folder to write the {args.format} model into")
    check_parent_folder(args.output, "--out")
    if args.format == "marian":
        from .fileio import export_into
        from .marian import checkpoint_model, starts_from_zeros, write_marian
        cfg, params, tokenizer, languages = checkpoint_model(args.checkpoint)
        with export_into(args.output):
            write_marian(cfg, params, tokenizer, languages, args.output)
        what = "model.npz, vocab.yml, source.spm, target.spm, decoder.yml: Marian's format, OPUS-MT's layout"
        if not starts_from_zeros(params):
            print(f"note: Marian, and CTranslate2's own Marian converters (ct2-opus-mt-converter, ct2-marian-converter), "
                  f"start the decoder from a zero vector, this model from <s>'s embedding: they would translate it "
                  f"otherwise. minitf reads the folder as the model it is; for CTranslate2, export --format "
                  f"ctranslate2 (from {args.checkpoint} or from {args.output}) tells it the start", file=sys.stderr)
    else:
        from .ctranslate2_export import export_ctranslate2
        export_ctranslate2(args.checkpoint, args.output, args.quantization)
        what = f"a CTranslate2 model ({args.quantization or 'float32'} weights) with source.spm and target.spm"
    print(f"exported {args.checkpoint} -> {args.output}/ ({what})", file=sys.stderr)


OUTPUT_HELP = ("output file (a .gz name is gzip-compressed; a link, a pipe or /dev/stdout is written through; an "
               "existing file keeps its permissions, and in a folder that takes no new file is written in place; never "
               "the checkpoint, an input, a file of the model (a Marian folder's too) or a model file's name, *.npz or "
               "*.safetensors); - or default: stdout")
MODEL_NAMES = (".npz", ".safetensors")   # a model file's: text written there would take a model's place


def _check_output(args, *inputs):
    """--output (when given) can be written, and is none of the files the command reads (it would be replaced by the
    text written: the checkpoint, the input) nor named as a model file: (flag, path) pairs. `-` is stdout."""
    if args.output == "-":   # stdout, as - is stdin for the inputs (it had written a file named -)
        args.output = None
    if not args.output:
        if sys.stdout is None:   # started with standard output closed (`>&-`)
            raise ConfigError("standard output is closed: name a file with --output")
        return
    check_output_file(args.output, "--output")
    for flag, path in (("--checkpoint", args.checkpoint),) + inputs if os.path.isfile(args.output) else ():
        if path not in (None, "-") and os.path.exists(path) and os.path.samefile(path, args.output):
            raise ConfigError(f"--output {args.output} is {flag} {path}: writing it would replace that file; name "
                              f"another output")
        if path in (None, "-") and flag != "--checkpoint" and _is_stdin(args.output):
            raise ConfigError(f"--output {args.output} is the file on standard input ({flag} "
                              f"{path or '-'}): writing it would replace that file; name another output")
    for model_file in _model_files(args.checkpoint) if os.path.isfile(args.output) else ():
        if os.path.samefile(model_file, args.output):   # a Marian folder's vocabulary or SentencePiece model
            raise ConfigError(f"--output {args.output} is {model_file}, a file of the model --checkpoint "
                              f"{args.checkpoint}: writing it would replace that file; name another output")
    if args.output.lower().endswith(MODEL_NAMES):   # (a run's checkpoint_best.npz had been replaced by translations)
        raise ConfigError(f"--output {args.output}: a model file's name, and what is written is text: name the output "
                          f"file otherwise (e.g. out.txt)")
    if not os.path.islink(args.output) and (os.path.isfile(args.output) or not os.path.exists(args.output)):
        from .fileio import written_in_place
        try:
            written_in_place(args.output)   # a folder that cannot be written: said now, not after translating
        except OSError as e:
            raise ConfigError(f"--output {args.output}: cannot write into {os.path.dirname(os.path.abspath(args.output))}"
                              f" ({e.strerror or e}): name another output") from None


def _model_files(checkpoint):
    """The files the model `checkpoint` is read from that exist (partial_output.model_files: a Marian folder's
    several), or none where it is no model."""
    from .partial_output import model_files
    try:
        return [p for p in model_files(checkpoint) if os.path.isfile(p)]
    except (MinitfError, OSError):   # not a model: loading it says so
        return []


def _is_stdin(path):
    """Whether standard input reads the file at path (`< FILE`)."""
    try:
        return os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):   # no standard input (closed, or replaced by one without a file)
        return False


def cmd_translate(args):
    from .translate import load
    _check_output(args, ("--input", args.input))
    translator = load(args.checkpoint, args.device)
    if args.input in (None, "-") and sys.stdin is not None and sys.stdin.isatty() and not args.output:
        return _interactive(translator, args)
    lines = _read_input(args.input)
    _translate_keeping(translator, lines, args)


def _translate_keeping(translator, lines, args):
    """translate into --output FILE, each line kept in FILE.partial as it is done (partial_output): stopped, the same
    command goes on from them; FILE written whole at the end. To standard output, a pipe or a device, or where
    FILE.partial cannot be made (said), the lines are translated without keeping."""
    from .partial_output import DECODING_FLAGS, PartialOutput, partial_path, run_key
    part = None
    if partial_path(args.output):
        options = {k: getattr(args, k) for k in DECODING_FLAGS}
        options["alpha"] = translator.alpha if args.alpha is None else args.alpha
        try:
            part = PartialOutput(args.output, run_key(args.checkpoint, lines, options))
        except OSError as e:   # a read-only folder, ...: FILE may still be written (through a link, say)
            report(f"note: {partial_path(args.output)}: cannot keep the lines there as they are done "
                   f"({e.strerror or e}): translating without")
    if part is None:
        _write_text(args.output, "".join(_translations(translator, lines, args, progress=not args.quiet)))
        return
    if part.dropped:
        report(f"note: {part.path} was not taken ({part.dropped}): translating every line afresh")
    elif part.done:
        report(f"note: going on from {part.path}: {len(part.done):,} of {plural(len(lines), 'line')} were translated "
               f"before")
    todo = [i for i in range(len(lines)) if i not in part.done]

    def keep(j, result):
        i = todo[j]
        part.add(i, _output_of(i, lines[i], result, args))

    try:
        if todo:
            _search(translator, [lines[i] for i in todo], args, progress=not args.quiet, done=keep)
        _write_text(args.output, "".join(part.done[i] for i in range(len(lines))))
    except KeyboardInterrupt as e:
        part.stop()   # the search threads still running add nothing more
        kept = part.kept()
        if kept:
            e.kept, e.kept_what = part.path, f"the {kept:,} of {plural(len(lines), 'line')} translated so far are"
            part.close()
        else:   # stopped before any line was done: nothing to keep
            part.remove()
        raise
    except BaseException:
        part.close()
        raise
    part.remove()


def _write_text(output, text):
    """text into the file --output names, or to stdout without one, gzip-compressed where the name ends in .gz (as the
    readers take it back): a regular file atomically; through a link, a pipe or a device (/dev/stdout, a shell's
    >(gzip > f.gz)), the link kept."""
    if not output:
        sys.stdout.write(text)
        return
    from .fileio import WriteFailed, atomic_write, written_in_place
    data = text.encode()
    try:
        if output.endswith(".gz"):
            import gzip
            data = gzip.compress(data, mtime=0)
        if os.path.islink(output) or (os.path.exists(output) and not os.path.isfile(output)) or \
                written_in_place(output):   # (the last: a writable file in a folder that takes no new file)
            with open(output, "wb") as f:
                f.write(data)
            return
        atomic_write(output, lambda f: f.write(data))
    except OSError as e:
        raise DataError(f"--output {output}: cannot write it ({e.strerror or e})") from None
    except WriteFailed as e:
        raise DataError(f"--output {output}: cannot write it ({e.reason})") from None


def _scored_lines(i, line, hyps, per_piece):
    """translate --scores' lines of input line i: S-i<TAB>line, then for each hypothesis H-i<TAB>score<TAB>text and,
    with per_piece, P-i<TAB>each piece's log-probability."""
    out = [f"S-{i}\t{line}\n"]
    for h in hyps:
        out.append(f"H-{i}\t{h.score:.4f}\t{h.text}\n")
        if per_piece:
            out.append(f"P-{i}\t{' '.join(f'{p:.4f}' for p in h.token_logprobs)}\n")
    return out


def _search(translator, lines, args, progress=False, done=None):
    """The lines' translations under the decoding flags, or with --nbest or --scores their hypotheses (nbest's)."""
    opts = dict(beam=args.beam, alpha=args.alpha, max_len_b=args.max_len_b, batch_size=args.batch_size,
                progress=progress, stop=args.stop, done=done)
    if not (args.nbest or args.scores):
        return translator.translate(lines, **opts)
    return translator.nbest(lines, n=args.nbest or 1, **opts)


def _output_of(i, line, result, args):
    """The output of input line i (`result`: _search's for it): its translation and a newline, or with --nbest or
    --scores its S-/H-/P- lines."""
    if not (args.nbest or args.scores):
        return result + "\n"
    return "".join(_scored_lines(i, line, result, args.scores))


def _translations(translator, lines, args, progress=False, first=0):
    """The outputs of `lines` (numbered from `first`), one a line (_output_of)."""
    return [_output_of(i, line, result, args)
            for i, (line, result) in enumerate(zip(lines, _search(translator, lines, args, progress)), first)]


def _interactive(translator, args):
    """A person typing at a terminal: translate each line as it is entered (as
    fairseq-interactive does) instead of waiting for the end of input; Ctrl-D ends."""
    print("type a sentence and press Enter (Ctrl-D to end)", file=sys.stderr)
    args.batch_size = 1
    for n, raw in enumerate(sys.stdin.buffer):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:   # a terminal in another encoding: say so, and go on with the next line
            print(f"error: that line is not UTF-8 (bytes 0x{raw[e.start:e.end].hex()}); set the terminal to UTF-8",
                  file=sys.stderr)
            continue
        print("".join(_translations(translator, [line], args, first=n)), end="", flush=True)


def _read_pair(flag_a, path_a, flag_b, path_b):
    """The lines of two line-aligned inputs (a file, or one of them standard input): refused when both are standard
    input or their line counts differ."""
    if path_a == path_b == "-":
        raise ConfigError(f"{flag_a} - and {flag_b} -: standard input can be only one of them; name a file for the "
                          f"other")
    a, b = _read_input(path_a), _read_input(path_b)
    if len(a) != len(b):
        raise DataError(f"{flag_a} {path_a} has {plural(len(a), 'line')} but {flag_b} {path_b} has {len(b)}")
    return a, b


def cmd_evaluate(args):
    from .translate import base_language, load, metrics
    src, ref = _read_pair("--src", args.src, "--ref", args.ref)
    if not src:
        raise DataError(f"--src {args.src} and --ref {args.ref} are empty: there is nothing to translate and score")
    translator = load(args.checkpoint, args.device)
    alpha = translator.alpha if args.alpha is None else args.alpha
    _check_lang(args.lang, translator.languages)
    lang = (args.lang or (translator.languages or [None, None])[1] or "").lower() or None   # "DE": German too
    hyps = translator.translate(src, beam=args.beam, alpha=alpha, max_len_b=args.max_len_b, batch_size=args.batch_size,
                                progress=not args.quiet, stop=args.stop)
    result = metrics(hyps, ref, lang=lang)
    result.update(checkpoint=args.checkpoint, beam=args.beam, alpha=alpha)
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
            table = base_language(lang) in ("de", "fr")   # Table 2's two tasks: English to German and to French
            print(f"paper BLEU {result['bleu_paper']}  ({result['bleu_paper_method']}"
                  f"{'; on newstest2014 from English, the number Table 2 reports' if table else ''})")
        else:
            print(f"note: the paper's tokenized BLEU was {result['bleu_paper_method']}")


def _check_lang(lang, languages):
    """ConfigError for a --lang that is a language pair as sacreBLEU's -l takes it ("en-zh": its first half, the
    source, had been taken for the target). With the model's languages (`languages`: [src, tgt] the checkpoint
    records), a pair is one whose first half is its source or whose second half is its target, in any case, and any
    other "xx-yy" a language with its region or script ("de-AT", "pt-br", "zh_Hans"). Without them (an OPUS-MT
    folder), "xx-yy" with two different lowercase halves is refused as ambiguous, and a region in capitals taken."""
    m = re.fullmatch(r"([a-zA-Z]{2,3})[-_]([a-zA-Z]{2,3})", lang or "")
    if not m:
        return
    first, second = m.group(1).lower(), m.group(2).lower()
    src, tgt = [x.lower() if x else None for x in ((languages or [None, None]) + [None, None])[:2]]
    if src and tgt:
        if first != tgt and (first == src or second == tgt):
            raise ConfigError(f"--lang {lang}: give the target language alone (--lang {tgt}), not a pair as "
                              f"sacrebleu -l takes it (this model translates {src} -> {tgt})")
    elif first != second and m.group(2).islower():
        raise ConfigError(f"--lang {lang}: a language pair as sacrebleu -l takes it, or a language and its region? "
                          f"Give the target language alone (--lang {second}), or the region in capitals "
                          f"(--lang {first}-{second.upper()}); the model records no languages to tell")


def cmd_score(args):
    """Score given translations: each (--src, --tgt) pair's log-probability under the model."""
    from .translate import load
    src, tgt = _read_pair("--src", args.src, "--tgt", args.tgt)
    _check_output(args, ("--src", args.src), ("--tgt", args.tgt))
    translator = load(args.checkpoint, args.device)
    # empty: no piece, blank or not (a line of "▁" or of characters the tokenizer drops had been passed over here, and
    # the first blank one named as the first)
    empty = [i + 1 for i, ids in enumerate(translator.tokenizer.encode(src)) if not ids]
    if empty:
        which = f"line {empty[0]} is" if len(empty) == 1 else f"{len(empty):,} lines are (the first: line {empty[0]})"
        raise DataError(f"--src {args.src}: {which} empty (no piece): a translation needs a source to be scored "
                        f"against; drop the pairs whose source is empty first (no score is written until every pair "
                        f"has a source)")
    try:
        scored = translator.score(src, tgt, alpha=args.alpha, batch_size=args.batch_size, progress=not args.quiet)
    except ValueError as e:   # a line the model cannot take (longer than learned positions reach): named by its number
        raise DataError(f"--src {args.src}, --tgt {args.tgt}: {e}") from None
    if args.scores:   # the lines translate --scores prints, the given translation as the one hypothesis
        text = "".join(line for i, (s, h) in enumerate(zip(src, scored)) for line in _scored_lines(i, s, [h], True))
    else:
        text = "".join(f"{h.score:.4f}\n" for h in scored)
    _write_text(args.output, text)


def cmd_info(args):
    """What a model file is: its kind, languages, architecture and size, vocabulary, training and recipe; of a run's
    folder, its checkpoints and scores, then its model's."""
    from .marian import is_ctranslate2, is_marian
    from .modelinfo import info_lines, model_facts, run_lines, run_facts
    run = os.path.isdir(args.checkpoint) and not is_marian(args.checkpoint) and not is_ctranslate2(args.checkpoint)
    facts = run_facts(args.checkpoint) if run else model_facts(args.checkpoint)
    unreadable = run and "error" in facts["model"]   # the run's facts, then its model's error (exit 2, as for the file)
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        lines = run_lines(facts) if run else info_lines(facts)
        print("\n".join(lines[:-1] if unreadable else lines))
    if unreadable:
        raise DataError(f"{facts['model']['path']}: cannot be read: {facts['model']['error']}")


def _decode_args(p):
    p.add_argument("--checkpoint", type=path_arg, required=True, help="a minitf checkpoint (.npz, or a .safetensors export) with "
                                                       "its tokenizer, or a Marian model folder (docs/interop.md)")
    p.add_argument("--beam", type=Number(int, 1, MAX_BEAM), default=4, help="beam size (paper: 4; 1 = greedy)")
    p.add_argument("--alpha", type=Number(float, 0, MAX_ALPHA), default=None,
                   help="length penalty alpha (paper: 0.6; default: the checkpoint's preset, small 2.0, "
                        "small with --arch rnn 1.5)")
    p.add_argument("--max-len-b", type=Number(int, 0, MAX_LEN_B), default=50, help="max output length = input length (in pieces, its EOS "
                   "included) + this; with learned positions at most max_len - 1")
    p.add_argument("--stop", choices=["fairseq", "bound", "ctranslate2"], default="fairseq",
                   help="when beam search ends a sentence: fairseq (once --beam hypotheses finished, fairseq's rule) or "
                        "bound (once no live beam can still beat the best finished one: usually later, a score at least as good) or "
                        "ctranslate2 (once a step's best candidate ends: CTranslate2's rule with --alpha 0, for comparing "
                        "with an exported model)")
    p.add_argument("--batch-size", type=positive(), default=64, help="sentences decoded together")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _check_prepare(p, args):
    check_data_args(p, args)
    if args.init_from is not None:
        from .train_cli import check_init_from
        check_init_from(p, args)


def _check_translate(p, args):
    if args.nbest is not None and not 1 <= args.nbest <= args.beam:
        p.error(f"--nbest {args.nbest}: choose 1 to --beam ({args.beam})")


def _check_export(p, args):
    if args.format == "safetensors" and not args.output.endswith(".safetensors"):
        p.error(f"--output {args.output}: name it *.safetensors (or choose --format marian or ctranslate2, which "
                f"write a folder)")
    if args.quantization and args.format != "ctranslate2":
        p.error(f"--quantization {args.quantization}: only --format ctranslate2 quantizes")


def build_parser(prog="python -m minitf"):
    from . import __version__
    parser = Parser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"minitf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", add_help=False, help="train a model and score it: the flags of train_wmt.py "
                                                 f"(`{prog} train --help`; the minitf-train command)")
    p = sub.add_parser("prepare", help="tokenize and clean a training corpus once into its binarized, "
                                       "memory-mapped cache (train_wmt.py does it on its first run)")
    add_data_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--verify", action="store_true",
                   help="also read the whole cache back and check every array against the SHA-256 recorded when "
                        "it was built (a start checks only cheap invariants); a cache that fails is rebuilt")
    p.add_argument("--init-from", type=path_arg, metavar="MODEL",
                   help="prepare the corpus for train_wmt.py --init-from MODEL (a minitf checkpoint or a Marian model "
                        "folder): encoded with that model's tokenizer, as the fine-tuning run will open it")
    p.set_defaults(func=cmd_prepare, check=lambda args, p=p: _check_prepare(p, args))
    p = sub.add_parser("average", help="parameter-wise mean of checkpoints (paper 6.1)",
                       description="The parameter-wise mean of training checkpoints (paper 6.1), written without "
                                   "optimizer state.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--inputs", type=path_arg, nargs="+", metavar="CHECKPOINT",
                       help="the checkpoints to average (e.g. runs/x/checkpoint_*.npz), each once; an average, a run's "
                            "model.npz or checkpoint_best.npz among them is left out, with a note")
    which.add_argument("--folder", type=path_arg, metavar="DIR", help="a run's --out folder: average its last --last training "
                                                       "checkpoints (checkpoint_<step>.npz) as the run does: the final "
                                                       "one and the evenly spaced ones of the run's second half (those "
                                                       "left out are named)")
    p.add_argument("--last", type=positive(), default=5, metavar="COUNT", help="with --folder: how many (default 5, the paper's)")
    p.add_argument("--output", type=path_arg, required=True, help="the averaged checkpoint (*.npz; `export` makes a .safetensors "
                                                   "of it); not one of a run's own names (model.npz, averaged.npz, "
                                                   "checkpoint_best.npz, checkpoint_<step>.npz) in its folder")
    p.set_defaults(func=cmd_average)
    p = sub.add_parser("translate", help="translate raw sentences (file or stdin), one per line",
                       description="Translate raw sentences, one per line (an empty line gives an empty one). With "
                                   "--nbest or --scores the output is, per input line i (from 0): S-i<TAB>source, "
                                   "then for each hypothesis, best first (with --stop bound or ctranslate2, those found "
                                   "after the rule would have ended the sentence follow those found before it, so the "
                                   "first is the translation), H-i<TAB>score<TAB>translation (score: the "
                                   "natural log-probability of its pieces and end of sentence over the length "
                                   "penalty ((5 + length) / 6) ** alpha, as beam search ranks them) and, with "
                                   "--scores, P-i<TAB>the log-probability of each piece and of the end of sentence. "
                                   "On a terminal, with no --input and no --output, each line is translated as you "
                                   "type it (Ctrl-D ends). With --output FILE each line is kept in FILE.partial as it "
                                   "is done: stopped part-way (Ctrl-C, a kill), the same command goes on from them.")
    _decode_args(p)
    p.add_argument("--input", type=path_arg, help="input file (plain or .gz, or a pipe; an .sgm file: its <seg> "
                   "segments, as newstest sets come); - or default: stdin (on a terminal: each line translated as you "
                   "type it)")
    p.add_argument("--output", type=path_arg, help=OUTPUT_HELP)
    p.add_argument("--nbest", type=positive(), metavar="COUNT", help="the COUNT best translations of each line (COUNT <= --beam), as "
                                                          "H- lines with their scores (an empty line, or one of no "
                                                          "piece: one empty H- line, score 0)")
    p.add_argument("--scores", action="store_true", help="print S-, H- and P- lines (scores per hypothesis and per "
                                                         "piece)")
    p.set_defaults(func=cmd_translate, check=lambda args, p=p: _check_translate(p, args), memory=DECODE_MEMORY)
    p = sub.add_parser("evaluate", help="translate --src and score against --ref with sacreBLEU and chrF, and "
                       "the paper's tokenized BLEU",
                       description="Translate --src with beam search (as translate does) and score the translations "
                                   "against --ref, line by line the same sentences: sacreBLEU's BLEU (the target "
                                   "language's tokenizer: 13a, zh's, or MeCab's for ja and ko, characters without "
                                   "it; the signature says which) and chrF, and the paper's tokenized BLEU (Moses "
                                   "tokens, German compounds split: needs sacremoses) where the language has spaces. "
                                   "Files are read as minitf reads text (a leading UTF-8 byte-order mark dropped, "
                                   "CRLF endings taken as LF), so a --ref with a BOM can score a little above the "
                                   "sacrebleu command's, which keeps it in the first word.")
    _decode_args(p)
    p.add_argument("--src", type=path_arg, required=True, help="source sentences (a file, plain or .gz, a pipe such as "
                                                "<(zcat f.gz), or - for stdin)")
    p.add_argument("--ref", type=path_arg, required=True, help="reference translations, the same way")
    p.add_argument("--lang", help="target language (de, zh, pt-BR: not a pair such as en-de): it picks sacreBLEU's "
                   "tokenizer (zh, ja, ko their own, "
                   "characters for ja and ko where MeCab is not installed; 13a for the others) and the paper's tokenized BLEU's (Moses tokenizer; 'de' also splits compounds); "
                   "default: the one the checkpoint was trained on")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_evaluate, memory=DECODE_MEMORY)
    p = sub.add_parser("score", help="how likely the model finds given translations: --src and --tgt, line by line",
                       description="Score given translations (forced decoding): for each line of --src and the same "
                                   "line of --tgt, the natural log-probability of the translation's pieces and end of "
                                   "sentence under the model, over the length penalty ((5 + length) / 6) ** alpha, as "
                                   "beam search scores a hypothesis (translate --scores prints the same scale): one "
                                   "score a line, or with --scores the S-, H- and P- lines of translate --scores. The "
                                   "translation is split into pieces as the tokenizer splits text, so a translation "
                                   "whose search put it together from other pieces (pieces of bare spaces, or a word "
                                   "built from smaller pieces than the tokenizer's) scores differently here, the same "
                                   "text in other pieces; a piece outside an output vocabulary is scored as the "
                                   "unknown piece, as training scores it. Every source line must hold a sentence "
                                   "(one that is empty is an error, before anything is scored).")
    p.add_argument("--checkpoint", type=path_arg, required=True, help="a minitf checkpoint (.npz, or a .safetensors export) with "
                                                       "its tokenizer, or a Marian model folder (docs/interop.md)")
    p.add_argument("--src", type=path_arg, required=True, help="source sentences (a file, plain or .gz, a pipe, or - for stdin)")
    p.add_argument("--tgt", type=path_arg, required=True, help="their translations, one a line, the same way")
    p.add_argument("--alpha", type=Number(float, 0, MAX_ALPHA), default=None,
                   help="length penalty alpha (0: the plain sum of log-probabilities; default: the checkpoint's preset, "
                        "as translate)")
    p.add_argument("--scores", action="store_true", help="print S-, H- and P- lines (the score and each piece's "
                                                         "log-probability) instead of one score a line")
    p.add_argument("--output", type=path_arg, help=OUTPUT_HELP)
    p.add_argument("--batch-size", type=positive(), default=64, help="pairs scored together")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_score, memory="--batch-size (the logits of a batch are pairs x length x vocabulary)")
    p = sub.add_parser("info", help="what a model file is: kind, languages, architecture, size, vocabulary, training",
                       description="What a model file is, without building the model: which kind (a run's reported "
                                   "model, an average, a training checkpoint that --resume continues, an export, a "
                                   "Marian model), its languages, architecture and parameters, its vocabulary, how "
                                   "long it trained, and its recipe.")
    p.add_argument("checkpoint", metavar="MODEL", help="a minitf checkpoint (.npz, or a .safetensors export), a Marian "
                                                       "model folder, or a run's --out folder (its checkpoints and "
                                                       "scores, then the model it reported)")
    p.add_argument("--json", action="store_true", help="print every fact as JSON (the whole config and training state)")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("export", help="a checkpoint as a .safetensors file (translate/evaluate read it), a Marian model "
                                      "or a CTranslate2 model (docs/interop.md)",
                       description="A checkpoint without optimizer state: --format safetensors (default) writes "
                                   "its parameters, config and tokenizer as one .safetensors file (translate and "
                                   "evaluate read it); --format marian a Marian model folder in OPUS-MT's layout "
                                   "(model.npz with special:model.yml, vocab.yml, source.spm, target.spm, "
                                   "decoder.yml), which minitf reads back as the same model (Marian and CTranslate2's "
                                   "Marian converters start the decoder from zeros, a minitf model from <s>: they "
                                   "translate it otherwise); --format ctranslate2 a CTranslate2 model folder, exact "
                                   "(needs pip install 'minitf[serve]'). --checkpoint may also be a Marian model (an "
                                   "OPUS-MT folder) for marian and ctranslate2.")
    p.add_argument("--checkpoint", type=path_arg, required=True, help="a minitf checkpoint (.npz, or a .safetensors export), or for --format marian or ctranslate2 a "
                        "Marian model (an OPUS-MT folder, or minitf's Marian export)")
    p.add_argument("--format", choices=["safetensors", "marian", "ctranslate2"], default="safetensors")
    p.add_argument("--output", "--out", type=path_arg, dest="output", required=True,
                   help="the .safetensors file, or the folder of a marian or ctranslate2 model")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="--format ctranslate2: the weights' type (one of CTranslate2's --quantization types; default float32)")
    p.set_defaults(func=cmd_export, check=lambda args, p=p: _check_export(p, args))
    try:
        from .viz import add_plot_parser
    except ImportError:
        pass
    else:
        add_plot_parser(sub)
    return parser


# what sizes decoding's memory: the batch, the beam and the output length cap; one very long input
# sentence needs its memory whatever they are
DECODE_MEMORY = ("--batch-size, --beam or --max-len-b (the output length cap); a very long input sentence needs "
                 "memory whatever they are: split or shorten it")


def _is_stdout_error(e):
    """Whether an OSError is one a failed stdout write raises (EPIPE, ENOSPC, EIO, EFBIG, EDQUOT); which
    file failed is not checked (--output's own writes report a full disk themselves: fileio.DiskFull)."""
    import errno
    return isinstance(e, BrokenPipeError) or getattr(e, "errno", None) in (errno.ENOSPC, errno.EIO, errno.EFBIG,
                                                                          errno.EDQUOT)


def _drop_stdout():
    """Point fd 1 at /dev/null, so the interpreter's flush at exit does not fail a second time
    (and print a traceback) on what is left in the buffer."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "python -m minitf" if sys.argv[0].endswith("__main__.py") else "minitf"
    if argv[:1] == ["train"]:
        from .train_cli import main as train
        return train(argv[1:], prog=f"{prog} train")
    parser = build_parser(prog)
    if not argv:   # argparse's "the following arguments are required: command" named none of them
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        report(f"{prog}: error: name a command: {', '.join(commands)} (`{prog} COMMAND --help` says more)")
        return 2
    try:
        args = parser.parse_args(argv)
        if getattr(args, "check", None):
            args.check(args)
    except SystemExit as e:   # a bad flag (one line printed, status 2), or --help / --version (0)
        return e.code
    try:
        with sigterm_raises(), one_line_warnings():   # SIGTERM as Ctrl-C: what was being written is removed
            args.func(args)
            sys.stdout.flush()   # inside the handling: a full disk or a closed pipe is reported, not lost at exit
    except OSError as e:
        if not _is_stdout_error(e):
            if e.filename is None:
                raise
            report(f"error: {e.filename}: {e.strerror or e}")   # a read-only folder, a link to nowhere, ...
            return 2
        _drop_stdout()
        if isinstance(e, BrokenPipeError):    # the reader stopped reading (`| head`): nothing to report
            return 141
        report(f"error: writing the output to stdout failed ({e.strerror or e}): it is incomplete")
        return 2
    except MinitfError as e:
        report(f"error: {e}")
        return 2
    except MemoryError as e:
        report(f"error: {out_of_memory(e, getattr(args, 'memory', None))}")
        return 2
    except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM (errors.Terminated)
        report(f"interrupted: {nothing_half_written(e)}")
        return SIGNAL_EXIT[getattr(e, "signame", "SIGINT")]
    return 0
