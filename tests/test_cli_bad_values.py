"""Every numeric flag of every command line against a table of bad values: exit status 2 and ONE
line on stderr that names the flag (no usage text, no traceback). A new flag is covered by adding
its row; `test_the_table_covers_every_numeric_flag` fails until it has one. The rows run
in-process (the parse functions, `cli.main`); two subprocess runs show the real exit status."""
import importlib.util
import os
import subprocess
import sys

import pytest

from minitf import cli, train_cli
from minitf.flags import numeric_actions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("train_wmt", os.path.join(ROOT, "train_wmt.py"))
train_wmt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_wmt)       # the script: its flags are minitf.train_cli's
train_wmt.build_parser = train_cli.build_parser

# (a value the flag takes, [values it refuses])
POSITIVE_INT = ("1", ["0", "-5", "2.5", "x"])
ZERO_OR_MORE = ("0", ["-5", "2.5", "x"])                  # 0 means off / no limit
POSITIVE_FLOAT = ("0.5", ["0", "-5", "nan", "inf", "x"])
FRACTION = ("1", ["-0.1", "1.5", "nan", "x"])              # [0, 1]
FRACTION_BELOW_1 = ("0", ["-0.1", "1", "nan", "x"])        # [0, 1)
BEAM = ("1", ["0", "-3", "100000", "x"])
ALPHA = ("0", ["-3", "nan", "inf", "x"])
AT_LEAST_2 = ("2", ["1", "0", "-4", "x"])
INDEX = ("0", ["-1", "x"])
DATA = {"--vocab-size": POSITIVE_INT, "--max-len": POSITIVE_INT, "--max-ratio": ("0", ["-1", "0.5", "nan", "x"])}
DECODE = {"--beam": BEAM, "--alpha": ALPHA, "--max-len-b": ("0", ["-100", "x"]), "--batch-size": POSITIVE_INT}

TABLE = {
    ("train_wmt.py",): {
        **DATA, "--d-model": ("64", ["0", "-5", "2.5", "x"]), "--heads": POSITIVE_INT, "--d-ff": POSITIVE_INT,
        "--layers": POSITIVE_INT, "--decoder-layers": POSITIVE_INT, "--max-steps": ZERO_OR_MORE, "--bidirectional-epochs": ZERO_OR_MORE,
        "--time-budget": ("0.5", POSITIVE_FLOAT[1] + ["1e308"]),   # a huge budget had overflowed mid-run
        "--max-tokens": POSITIVE_INT, "--update-freq": POSITIVE_INT, "--warmup": POSITIVE_INT,
        "--lr-factor": POSITIVE_FLOAT, "--lr-fade": FRACTION, "--weight-decay": FRACTION_BELOW_1, "--dropout": FRACTION_BELOW_1,
        "--attention-dropout": FRACTION_BELOW_1, "--relu-dropout": FRACTION_BELOW_1,
        "--bpe-dropout-source": FRACTION_BELOW_1, "--bpe-dropout-target": FRACTION_BELOW_1,
        "--label-smoothing": FRACTION_BELOW_1, "--seed": ("0", ["-1", str(2**32), "x"]),
        "--log-every": POSITIVE_INT, "--valid-every": ZERO_OR_MORE, "--patience": ZERO_OR_MORE, "--save-every": POSITIVE_INT,
        "--save-every-minutes": POSITIVE_FLOAT, "--keep-last": POSITIVE_INT,
        "--average-last": POSITIVE_INT, "--beam": BEAM, "--alpha": ALPHA, "--decode-batch": POSITIVE_INT,
        "--max-nonfinite": POSITIVE_INT, "--valid-every-minutes": POSITIVE_FLOAT,
        "--valid-bleu-sentences": ZERO_OR_MORE},
    ("prepare",): DATA,
    ("average",): {"--last": POSITIVE_INT},
    ("translate",): {**DECODE, "--nbest": POSITIVE_INT},
    ("evaluate",): DECODE,
    ("score",): {"--alpha": ALPHA, "--batch-size": POSITIVE_INT},
    ("plot", "pe"): {"--max-len": AT_LEAST_2, "--d-model": AT_LEAST_2, "--table-n": AT_LEAST_2, "--table-d": AT_LEAST_2},
    ("plot", "lr"): {"--d-model": POSITIVE_INT, "--warmup": POSITIVE_INT, "--factor": POSITIVE_FLOAT,
                     "--steps": AT_LEAST_2, "--fade": FRACTION},
    ("plot", "attention"): {"--layer": INDEX, "--head": INDEX, "--beam": BEAM, "--alpha": ALPHA,
                            "--max-len-b": ("0", ["-100", "x"])},
    ("plot", "masks"): {"--src-lens": POSITIVE_INT, "--tgt-lens": POSITIVE_INT},
    ("plot", "packing"): {"--lens": POSITIVE_INT},
}
# what each command needs besides the flag under test (files need not exist: parsing comes first)
NEEDS = {("average",): ["--inputs", "a.npz", "--output", "b.npz"], ("translate",): ["--checkpoint", "c.npz"],
         ("evaluate",): ["--checkpoint", "c.npz", "--src", "s.txt", "--ref", "r.txt"],
         ("score",): ["--checkpoint", "c.npz", "--src", "s.txt", "--tgt", "t.txt"],
         ("plot", "attention"): ["--checkpoint", "c.npz", "--src", "a b", "--out", "x.png"]}
ROWS = [(cmd, flag, bad) for cmd, flags in TABLE.items() for flag, (_, bads) in flags.items() for bad in bads]
GOOD = [(cmd, flag, good) for cmd, flags in TABLE.items() for flag, (good, _) in flags.items()]


def _argv(cmd, flag, value, tmp_path):
    if cmd == ("train_wmt.py",):
        return ["--out", str(tmp_path / "run"), flag, value]
    return [*cmd, *NEEDS.get(cmd, ["--out", "x.png"] if cmd[0] == "plot" else []), flag, value]


def test_the_table_covers_every_numeric_flag():
    have = {(cmd, flag) for cmd, flags in TABLE.items() for flag in flags}
    declared = {(("train_wmt.py",), flag) for (_, flag) in numeric_actions(train_wmt.build_parser())}
    declared |= set(numeric_actions(cli.build_parser()))
    assert declared - have == set(), "numeric flags without a row in TABLE"
    assert have - declared == set(), "rows for flags that are not numeric options"


@pytest.mark.parametrize("cmd, flag, value", ROWS, ids=[f"{' '.join(c)} {f} {v}" for c, f, v in ROWS])
def test_a_bad_value_is_one_line_and_exit_2(cmd, flag, value, tmp_path, capsys):
    argv = _argv(cmd, flag, value, tmp_path)
    if cmd == ("train_wmt.py",):
        with pytest.raises(SystemExit) as e:
            train_wmt.parse_args(argv)
        code = e.value.code
    else:
        code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert f"argument {flag}" in err and "Traceback" not in err and "usage:" not in err


@pytest.mark.parametrize("cmd, flag, value", GOOD, ids=[f"{' '.join(c)} {f} {v}" for c, f, v in GOOD])
def test_the_edge_of_each_range_is_taken(cmd, flag, value, tmp_path):
    argv = _argv(cmd, flag, value, tmp_path)
    if cmd == ("train_wmt.py",):
        args = train_wmt.parse_args(argv)
    else:
        args = cli.build_parser().parse_args(argv)
    got = getattr(args, flag.lstrip("-").replace("-", "_"))
    assert (got[0] if isinstance(got, list) else got) == float(value)


def test_the_real_exit_status_of_each_entry_point(tmp_path):
    for cmd in ([os.path.join(ROOT, "train_wmt.py"), "--out", str(tmp_path / "run"), "--lr-factor", "0"],
                ["-m", "minitf", "translate", "--checkpoint", "c.npz", "--beam", "0"]):
        r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert cmd[-2] in r.stderr and r.stdout == ""


def test_help_texts_quote_the_presets_defaults():
    """Each model and recipe flag's --help ends with "[presets: ...]", made from config.FLAG_FIELDS and the
    presets: every "name value" in it is what that preset's config holds (after "with --arch rnn:", the
    recurrent preset's), read here independently of how the text was made."""
    import re
    from minitf.config import FLAG_FIELDS, PRESETS, Config
    checked = 0
    for action in train_cli.build_parser()._actions:
        m = re.search(r"\[presets: (.*)\]$", action.help or "")
        if not m:
            continue
        field = FLAG_FIELDS[action.dest]
        transformer, _, rnn = m.group(1).partition("; with --arch rnn: ")
        for text, arch in ((transformer, "transformer"), (rnn, "rnn")):
            for group in filter(None, text.split(", ")):
                names, value = (["base", "big", "small", "tiny"], group[len("every preset "):]) \
                    if group.startswith("every preset ") else (group.rsplit(" ", 1)[0].split(" and "), group.rsplit(" ", 1)[1])
                for name in names:
                    held = getattr(Config.preset(name, arch=arch), field)
                    shown = "unset" if held is None else f"{held:g}" if isinstance(held, float) else str(held)
                    assert shown == value, (action.dest, name, arch, value, held)
                    checked += 1
    assert checked >= 80 and set(PRESETS) == {"base", "big", "small", "tiny"}
    # --alpha is a run flag (the decoding's), its help written by hand: the presets' values it quotes
    from minitf.config import RNN_PRESETS
    alpha = {a.dest: a for a in train_cli.build_parser()._actions}["alpha"]
    assert f"small {PRESETS['small']['decode_alpha']}," in alpha.help
    assert f"small with --arch rnn {RNN_PRESETS['small']['decode_alpha']})" in alpha.help


def test_every_training_flag_has_help_and_a_default_of_its_own_is_said():
    """Each flag of train_wmt.py has a --help text, and one whose default is its own (not a preset's) ends by saying
    that default as the parser holds it (--device and --seed had none; --out, --dtype, --decode-batch ... no default)."""
    for action in train_cli.build_parser()._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, action.dest
        if not (action.default is None or action.default is False or action.default == []):
            assert "default" in action.help, action.dest
    helps = {a.dest: a.help for a in train_cli.build_parser()._actions}
    assert helps["out"].endswith("(default: runs/train)") and helps["seed"].endswith("(default: 1)")
    assert helps["decode_batch"].endswith("(default: 100)") and helps["max_len"].endswith("(default: 250)")
    assert helps["patience"].endswith("(default: 0)")      # 0 is a default to say too


@pytest.mark.parametrize("argv, says", [
    (["--out="], "argument --out: an empty path: name a file or folder, or leave the flag out"),
    (["--tokenizer="], "argument --tokenizer: an empty path"),
    (["--src=", "--dataset", "multi30k"], "argument --src: '' is not a language code"),
    (["--tgt", "d e"], "argument --tgt: 'd e' is not a language code"),
])
def test_an_empty_path_or_language_is_refused_not_taken_for_the_flag_left_out(argv, says, capsys):
    # --tokenizer=$UNSET had trained a new tokenizer, --out= failed after the data was prepared
    with pytest.raises(SystemExit):
        train_cli.parse_args(argv)
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--dataset", "multi30k", "--bpe-dropout-source", "0.1"],
     "BPE-dropout resegments with BPE merges, and this run would train a unigram tokenizer (the multi30k default): "
     "add --subword bpe"),
    (["--dataset", "wmt14", "--subword", "unigram", "--bpe-dropout-target", "0.1", "--output-vocab", "joint"],
     "(--subword unigram): add --subword bpe"),
    (["--subword", "unigram", "--tokenizer", "TOK"], "--subword unigram trains a tokenizer and --tokenizer gives one"),
    (["--vocab-size", "8000", "--tokenizer", "TOK"],
     "--vocab-size 8000 trains a tokenizer of that many pieces and --tokenizer gives one: use one or the other"),
    (["--subword", "wordpiece"], "argument --subword: invalid choice: 'wordpiece'"),
    (["--tokenizer", "DIR"], "--tokenizer DIR: a folder, not a SentencePiece model file"),
    (["--tokenizer", "NOPE"], "--tokenizer NOPE: file not found"),
])
def test_the_subword_flag_against_bpe_dropout_and_a_given_tokenizer(argv, says, tmp_path, capsys):
    (tmp_path / "TOK").write_bytes(b"")
    (tmp_path / "DIR").mkdir()
    says = says.replace("DIR", str(tmp_path / "DIR")).replace("NOPE", str(tmp_path / "NOPE"))
    argv = [str(tmp_path / a) if a in ("TOK", "DIR", "NOPE") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        train_cli.parse_args(["--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, err
    for fine in (["--dataset", "multi30k", "--subword", "bpe", "--bpe-dropout-source", "0.1"],
                 ["--dataset", "wmt14", "--bpe-dropout-source", "0.1"], ["--dataset", "multi30k", "--subword", "unigram"]):
        assert train_cli.parse_args(["--out", str(tmp_path / "run"), *fine]).out == str(tmp_path / "run")


@pytest.mark.parametrize("tests, says", [
    (["a=T", "a=T2"], "--test a=... is given 2 times: give each test set its own NAME"),
    (["valid=T"], "--test valid=...: 'valid' names the validation set's scores; give the test set another NAME"),
    (["../up=T"], "NAME '../up' in '../up=T': letters, digits, '.', '-' and '_' only, not starting with '.' (it "
                  "names the file OUT/NAME.hyp.<tgt>)"),
    (["news/2014=T"], "NAME 'news/2014' in"),
    (["..=T"], "NAME '..' in '..=T'"),                 # had written the hidden file OUT/...hyp.<tgt>
    ([".hidden=T"], "NAME '.hidden' in"),
])
def test_each_own_test_set_needs_a_name_of_its_own(tests, says, tmp_path, capsys):
    """results.json, the log and the summary key each set's scores by its name: a second --test of one NAME, or a
    test set named 'valid', would overwrite a set's scores (the validation set's, for 'valid'), so both are refused;
    and NAME names the file OUT/NAME.hyp.<tgt>, so a path in it (a folder, or one outside OUT) is refused too."""
    argv = ["--out", str(tmp_path / "run"), "--train", str(tmp_path / "tr"), "--valid", str(tmp_path / "va")]
    for t in tests:
        argv += ["--test", t.replace("=T", f"={tmp_path / 'te'}")]
    with pytest.raises(SystemExit) as e:
        train_cli.parse_args(argv)
    err = capsys.readouterr().err.strip().replace(str(tmp_path / "te"), "T")
    assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, err
    fine = argv[:6] + ["--test", f"a={tmp_path / 'te'}", "--test", f"b={tmp_path / 'te'}"]
    assert [name for name, _ in train_cli.parse_args(fine).test] == ["a", "b"]


@pytest.mark.parametrize("extra, says", [
    (["--data-dir", "D"], "--data-dir is for --dataset's files; --train/--valid/--test name your own files as paths"),
    (["--offline"], "--offline is for --dataset's files"),
    (["--data-dir", "D", "--offline"], "--data-dir and --offline are for --dataset's files"),
])
def test_dataset_flags_beside_own_files_are_refused(extra, says, tmp_path, capsys):
    # --data-dir beside --train had been ignored without a word: the prefixes were read from the current folder
    from minitf import cli
    own = ["--train", str(tmp_path / "tr"), "--valid", str(tmp_path / "va")]
    argv = own + [str(tmp_path) if a == "D" else a for a in extra]
    with pytest.raises(SystemExit) as e:
        train_cli.parse_args(["--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, err
    assert cli.main(["prepare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("script, argv, says", [
    ("train_step", ["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
    ("train_step", ["--heads", "0"], "argument --heads: must be an integer >= 1, got 0"),
    ("train_step", ["--json", "NOPE/x.json"], "--json NOPE/x.json: the folder NOPE does not exist"),
    ("decode", ["--vs-uncached", "--src", "x.en"], "--src is read with --checkpoint's tokenizer: give --checkpoint"),
    ("decode", ["--checkpoint", "m.npz"], "one of the arguments --vs-torch --vs-uncached --profile is required"),
    ("table1", ["--k", "0"], "argument --k: must be an integer >= 1, got 0"),
    ("validation", ["--checkpoint", "m", "--src", "a", "--ref", "b", "--bleu-sentences", "-1"],
     "argument --bleu-sentences: must be an integer >= 0, got -1"),
    ("gpu_report", ["--smoke", "--skip", "suit"], "--skip: unknown section 'suit' (suite, launches, step, kernels"),
])
def test_a_benchmarks_bad_value_is_one_line_before_anything_is_measured(script, argv, says, tmp_path, capsys,
                                                                         monkeypatch):
    # they had been tracebacks (a median of no rounds, a division by 0 heads), some after the whole measurement (an
    # output file in a folder that is not there), or ignored (a misspelt --skip ran the section)
    import importlib
    argv = [str(tmp_path / "nope") + a[4:] if a.startswith("NOPE") else a for a in argv]
    says = says.replace("NOPE", str(tmp_path / "nope"))
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"bench.{script}").main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, err


def test_a_benchmark_says_its_defaults_and_stops_on_ctrl_c_or_a_missing_file_in_one_line(capsys):
    import minitf
    from bench import train_step
    from bench.flags import run
    with pytest.raises(SystemExit):
        train_step.main(["--help"])
    help_text = capsys.readouterr().out
    assert "--rounds ROUNDS       (default: 7)" in help_text and "FLOP utilisation" in help_text   # its method too

    def stopped():
        raise KeyboardInterrupt

    def missing():
        minitf.load("/nonexistent/model.npz")
    for main, code, says in ((stopped, 130, "interrupted (Ctrl-C): nothing more is measured"),
                             (missing, 2, "error: checkpoint /nonexistent/model.npz does not exist")):
        with pytest.raises(SystemExit) as e:
            run(main)
        assert e.value.code == code and capsys.readouterr().err.strip() == says


def test_bench_data_removes_only_what_it_made_in_work(tmp_path, capsys, monkeypatch):
    # its clean-up had removed every name of its kind in --work: corpora and caches an earlier --keep run left, a
    # folder of the user's named run-..., also when it stopped at once
    from bench import data
    work = tmp_path / "work"
    for name in ("n4500000", "cache4500000", "run-mine", "base"):
        (work / name).mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["data.py", "--multi30k", str(tmp_path / "none"), "--sizes", "1000", "--work",
                                      str(work)])
    with pytest.raises(SystemExit) as e:
        data.run(data.main)
    assert e.value.code == 2 and "none/train.en.gz" in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["base", "cache4500000", "n4500000", "run-mine"]
    from bench.flags import output_path, parser
    output_path(parser("x"), os.devnull, "--json")        # a file there, written in place: taken


def test_no_command_names_the_commands(capsys):
    # `minitf` alone had said only "the following arguments are required: command"
    from minitf import cli
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: name a command: train, prepare, average, translate, evaluate, score" in err
