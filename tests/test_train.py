"""train_wmt.py end to end on a tiny corpus made here: results.json, exact resume, errors."""
import gzip
import dataclasses
import json
import os
import re
import subprocess
import types
import sys

import numpy as np
import pytest

import minitf
from minitf import distributed
from minitf.checkpoint import load_checkpoint
from conftest import write_multi30k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Multi30k-shaped folder: word-by-word 'translations' so there is something to learn."""
    return write_multi30k(tmp_path_factory.mktemp("m30k"))


def run_train(corpus, out, *extra, cache=None):
    env = dict(os.environ, MINITF_CACHE=str(cache or out.parent / "cache"), PYTHONHASHSEED="0")
    vocab = [] if "--tokenizer" in map(str, extra) else ["--vocab-size", "60"]   # a given tokenizer has its own
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
           "--preset", "tiny", *vocab, "--device", "cpu", "--out", str(out), "--quiet",
           "--log-every", "1", "--beam", "2", "--decode-batch", "50", *map(str, extra)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def train_wmt_module():
    """train_wmt.py loaded as a module, to call its main() in this process (monkeypatches reach it)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_wmt", os.path.join(ROOT, "train_wmt.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def records(out):
    with open(out / "train_log.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def losses(out):
    with open(out / "train_log.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_end_to_end_writes_results(corpus, tmp_path):
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 30, "--save-every", 10, "--valid-every", 10)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["steps"] == 30 and res["epochs"] > 0 and res["train_wall_s"] > 0 and res["train_tokens_per_s"] > 0
    assert res["stopped"] == "max_steps"   # why training ended (a patience stop had read as a finished run)
    assert set(res["bleu"]) == {"valid", "test_2016_flickr"} and set(res["chrf"]) == set(res["bleu"])
    assert all(0 <= b <= 100 for b in res["bleu"].values())
    assert res["sacrebleu_signature"].startswith("nrefs:1|")
    assert set(res["bleu_paper"]) == set(res["bleu"]) and "compound splitting" in res["bleu_paper_method"]
    assert res["averaged_checkpoints"] == ["checkpoint_0000020.npz", "checkpoint_0000030.npz"]   # the run's 2nd half
    assert res["model"] in ("averaged", "last") and res["valid_loss"] == min(res["valid_loss_averaged"],
                                                                             res["valid_loss_last"])
    assert res["alpha"] == minitf.Config.preset("tiny").decode_alpha == 0.6   # --alpha from the preset
    assert minitf.Config.preset("small").decode_alpha == 2.0                  # tuned on Multi30k val
    from minitf.checkpoint import read_train_state
    assert read_train_state(out / "averaged.npz")["languages"] == ["en", "de"]   # evaluate's default --lang
    assert read_train_state(out / "model.npz")["languages"] == ["en", "de"]
    assert read_train_state(out / "model.npz")["model"] == res["model"]
    last = read_train_state(out / "checkpoint_0000030.npz")   # the update's size, which info reports, as the run's
    for name in ("model.npz", "averaged.npz"):
        assert {k: read_train_state(out / name)[k] for k in ("batch_tokens", "update_batches")} == \
            {k: last[k] for k in ("batch_tokens", "update_batches")}
    assert len((out / "test_2016_flickr.hyp.de").read_text().splitlines()) == 20
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train_lines = [r for r in log if "loss" in r]
    assert {"step", "epoch", "loss", "nll", "lr", "tokens_per_s", "wall_s"} <= set(train_lines[0])
    assert any("valid_loss" in r for r in log) and any(r.get("eval") == "valid" for r in log)
    assert train_lines[-1]["loss"] < train_lines[0]["loss"]
    # stdout holds the summary alone (progress and notes go to stderr): updates, the model, each set's scores, the files
    summary = r.stdout.splitlines()
    model = "the average of 2 checkpoints" if res["model"] == "averaged" else "the last checkpoint (checkpoint_0000030.npz)"
    assert summary[0].startswith(f"summary: 30 updates, {res['epochs']:.1f} epochs, ") and f"reported: {model}" in summary[0]
    assert "sacreBLEU and chrF, beam 2, whole sets" in summary[0]
    assert summary[1].split()[:3] == ["valid", "BLEU", f"{res['bleu']['valid']:.2f}"]
    assert summary[2].split()[:3] == ["test_2016_flickr", "BLEU", f"{res['bleu']['test_2016_flickr']:.2f}"]
    assert summary[3] == (f"files: {out / 'results.json'} (the scores), {out / 'model.npz'} (the model), "
                          f"{out / '<set>.hyp.de'} (the translations), {out / 'train_log.jsonl'} (the log)")
    assert len(summary) == 4
    assert "valid: BLEU" in r.stderr and "(sacreBLEU, beam 2, all 30 sentences" in r.stderr


def test_info_calls_a_reported_average_of_the_final_checkpoint_alone_the_last_checkpoint():
    """info's words for a run's model.npz follow the summary's: an 'average' of one checkpoint is that checkpoint."""
    from minitf.modelinfo import _kind
    assert _kind({"model": "averaged", "from": ["c20.npz", "c30.npz"]}, False, False) == (
        "a run's reported model: the average of 2 checkpoints")
    for model in ("averaged", "last"):
        assert _kind({"model": model, "from": ["c30.npz"]}, False, False) == (
            "a run's reported model: its last checkpoint (c30.npz)")


def test_the_summary_says_one_checkpoint_and_one_update_in_the_singular():
    """A run's summary line names the model it reports: the average of 2 checkpoints, or the last checkpoint, also where
    the 'average' was of the final checkpoint alone (the only one of a short run's second half: 'the average of 1
    checkpoint' had been said); and its updates: '1 update', '30 updates'."""
    from minitf.trainlog import summary_lines
    base = {"train_wall_s": 13.4, "steps": 30, "epochs": 0.2, "beam": 4, "bleu": {"valid": 0.0}, "chrf": {"valid": 0.5},
            "bleu_paper": {}}
    first = {n: summary_lines({**base, "model": model, "model_checkpoints": cps}, "out", "de")[0]
             for n, model, cps in ((1, "averaged", ["c30.npz"]), (2, "averaged", ["c20.npz", "c30.npz"]),
                                   (0, "last", ["c30.npz"]))}
    assert "reported: the last checkpoint (c30.npz); scores" in first[1]
    assert "reported: the average of 2 checkpoints; scores" in first[2]
    assert "reported: the last checkpoint (c30.npz); scores" in first[0]
    assert first[1].startswith("summary: 30 updates, 0.2 epochs, 0m 13s of training;")
    assert summary_lines({**base, "steps": 1, "model": "last", "model_checkpoints": ["c1.npz"]}, "out", "de")[0].startswith(
        "summary: 1 update, 0.2 epochs,")


def test_resume_is_exact(corpus, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    cache = tmp_path / "cache"
    args = ("--save-every", 4, "--valid-every", 0, "--keep-last", 5, "--average-last", 1, "--log-every", 3)
    r = run_train(corpus, straight, "--max-steps", 12, *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(corpus, split, "--max-steps", 8, *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    # `--out OUT --resume` alone: the data, the device, the batches and the schedule are the first start's
    # (OUT/config.json); --max-steps given now sets a new end
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--out", str(split), "--resume",
                        "--max-steps", "12"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, MINITF_CACHE=str(cache), PYTHONHASHSEED="0"))
    assert r.returncode == 0, r.stderr[-3000:]
    restored = next(line for line in r.stderr.splitlines() if line.startswith("the run's recorded flags"))
    assert f"--dataset multi30k --data-dir {corpus} " in restored and "--vocab-size 60 " in restored
    assert "--max-steps" not in restored and "--preset tiny" in restored and "--log-every 3" in restored
    a, b = losses(straight), losses(split)
    assert sorted(a) == [3, 6, 9, 12]
    # the record of step 9 averages updates 7-9 after the resume at 8 too (it had averaged update 9 alone), and
    # counts epochs as the uninterrupted run does
    assert [a[s] for s in (9, 12)] == [b[s] for s in (9, 12)]
    assert [records(straight)[s]["epoch"] for s in (9, 12)] == [records(split)[s]["epoch"] for s in (9, 12)]
    pa = load_checkpoint(straight / "checkpoint_0000012.npz")
    pb = load_checkpoint(split / "checkpoint_0000012.npz")
    for name in pa.params:
        np.testing.assert_array_equal(pa.params[name], pb.params[name])
    assert pa.train_state["forward_count"] == pb.train_state["forward_count"] == 12


def test_resume_takes_the_first_starts_flags_a_group_at_a_time(tmp_path, capsys, monkeypatch):
    """--resume fills the flags the command line leaves out from OUT/config.json's record, a group at a time: a flag
    given now takes its group's place (--valid-every-minutes given: no --valid-every restored beside it)."""
    from minitf.train_cli import parse_args
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint_0000004.npz").write_bytes(b"")
    first = vars(parse_args(["--train", str(tmp_path / "tr"), "--valid", str(tmp_path / "va"), "--test",
                             f"news={tmp_path / 'te'}", "--src", "en", "--tgt", "de", "--out", str(out), "--fp16",
                             "--valid-every", "7", "--time-budget", "60", "--seed", "3", "--max-tokens", "900"]))
    (out / "config.json").write_text(json.dumps({"model": {}, "args": first}))
    args = parse_args(["--out", str(out), "--resume", "--valid-every-minutes", "5", "--max-tokens", "800"])
    assert (args.train, args.valid, args.test) == (first["train"], first["valid"], [("news", str(tmp_path / "te"))])
    assert (args.fp16, args.time_budget, args.max_tokens, args.seed) == (True, 60, 800, 3)
    assert (args.valid_every, args.valid_every_minutes) == (None, 5)
    assert "--fp16" in args.restored and "--seed 3" in args.restored and "--valid-every 7" not in args.restored
    # the model's sizes are the checkpoint's: --heads given again is not checked against the preset's width
    assert parse_args(["--out", str(out), "--resume", "--heads", "5"]).heads == 5
    # another preset: the checkpoint's model and recipe stay (it had been recorded, changing nothing)
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--preset", "base"])
    assert "--preset base: the run in --out" in capsys.readouterr().err
    # another seed would change the batches and dropout mid-run (and had been taken without a word)
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--seed", "4"])
    assert "--seed 4: the run in --out" in capsys.readouterr().err
    assert parse_args(["--out", str(out), "--resume", "--seed", "3"]).seed == 3
    # other cleaning rules: refused naming the flag (the cache had refused them as "other data", "cleaning rule
    # max_ratio 1.5 -> 3.0"); the first start's rule given again, its default (1.5 for own files) included, is taken
    for flags, says in ((["--max-ratio", "3"], "--max-ratio 3.0: the run in --out " + str(out) + " cleans its corpus "
                                               "with --max-ratio 1.5, the default (its config.json says), which made "
                                               "the batches"),
                        (["--max-ratio", "0"], "--max-ratio 0.0: the run"), (["--max-len", "5"], "with --max-len 250 (its config.json says)")):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(out), "--resume", *flags])
        assert says in capsys.readouterr().err
    assert parse_args(["--out", str(out), "--resume", "--max-ratio", "1.5", "--max-len", "250"]).max_ratio == 1.5
    # a --tokenizer file moved away since: the checkpoint carries the tokenizer, so the resume does not ask for it (it
    # had stopped: "--tokenizer PATH: file not found"); a run with no checkpoint yet still needs it
    (out / "config.json").write_text(json.dumps({"model": {}, "args": {**first, "tokenizer": str(tmp_path / "gone")}}))
    assert parse_args(["--out", str(out), "--resume"]).tokenizer is None
    (out / "checkpoint_0000004.npz").unlink()
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume"])
    assert "gone" in capsys.readouterr().err
    (out / "checkpoint_0000004.npz").write_bytes(b"")
    (out / "config.json").write_text(json.dumps({"model": {}, "args": first}))
    # --device given again: the first start's precision is still taken (retyping it had dropped --fp16)
    args = parse_args(["--out", str(out), "--resume", "--device", "cpu"])
    assert (args.device, args.fp16, args.train) == ("cpu", True, first["train"])
    # a test set named now: the first start's training and validation data with it (it had refused: "give --train")
    args = parse_args(["--out", str(out), "--resume", "--test", f"other={tmp_path / 'o'}"])
    assert (args.train, args.valid, args.test) == (first["train"], first["valid"], [("other", str(tmp_path / "o"))])
    # the first start's data named again (relative or absolute): its test sets stay (they had been dropped), and with
    # other data named they go
    os.chdir(tmp_path)
    args = parse_args(["--out", str(out), "--resume", "--train", "tr", "--valid", str(tmp_path / "va")])
    assert args.test == [("news", str(tmp_path / "te"))] and args.train == "tr"
    assert parse_args(["--out", str(out), "--resume", "--train", "other", "--valid", "va"]).test == []
    # --init-from beside --resume: the run's own start (the first command line again) is taken, another model is
    # refused before anything is read (it had been ignored without a word)
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--init-from", str(tmp_path / "model.npz")])
    assert "--init-from " + str(tmp_path / "model.npz") + ": the run in --out " + str(out) + " was started from no " \
        "model (--init-from), and --resume continues it from its last checkpoint; drop --init-from" in \
        capsys.readouterr().err
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.npz").write_bytes(b"")
    (out / "config.json").write_text(json.dumps({"model": {}, "args": dict(first, init_from="base/model.npz")}))
    assert parse_args(["--out", str(out), "--resume", "--init-from", "base/model.npz"]).init_from == "base/model.npz"
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--init-from", "other/model.npz"])
    assert "was started from base/model.npz" in capsys.readouterr().err
    (out / "config.json").write_text(json.dumps({"model": {}, "args": first}))
    # an error after the restore says where the flags came from
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--bf16"])
    assert "--fp16 and --bf16" not in capsys.readouterr().err   # a precision flag given: the group is this start's
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume", "--patience", "2", "--valid-every", "0"])
    assert "(with the run's recorded flags from " in capsys.readouterr().err
    # an unreadable record: the data named again, the command line alone; else one line saying so (it had gone on
    # with the default dataset, downloading WMT14)
    (out / "config.json").write_text("{")
    assert parse_args(["--out", str(out), "--resume", "--dataset", "multi30k"]).restored == []
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume"])
    assert "config.json is unreadable (JSONDecodeError" in capsys.readouterr().err
    (out / "config.json").write_text(json.dumps({"args": first}))   # JSON, but not a run's record: no model
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume"])
    assert "config.json is unreadable (not a run's record" in capsys.readouterr().err
    # none at all: the command line alone (a run of a minitf that wrote none); beside checkpoints, a resume that names
    # no data is refused: it had gone on with the default dataset (WMT14), downloading it before the checkpoint's data
    # was found to differ
    (out / "config.json").unlink()
    assert any(out.glob("checkpoint_*.npz"))
    with pytest.raises(SystemExit):
        parse_args(["--out", str(out), "--resume"])
    assert f"--resume: {out / 'config.json'} is missing, so the run's recorded flags cannot be read from it: give the " \
           f"run's data flags again" in capsys.readouterr().err
    assert parse_args(["--out", str(out), "--resume", "--dataset", "multi30k"]).restored == []
    # --data-dir and --offline are --dataset's: a record of own files that holds them (an earlier minitf took them
    # beside --train) resumes without them; the same --dataset named again takes them, another does not
    (out / "config.json").write_text(json.dumps({"model": {}, "args": {**first, "offline": True,
                                                                        "data_dir": str(tmp_path)}}))
    args = parse_args(["--out", str(out), "--resume"])
    assert args.train == first["train"] and not args.offline and args.data_dir is None
    first_m30k = vars(parse_args(["--dataset", "multi30k", "--data-dir", str(tmp_path / "m"), "--offline", "--out",
                                  str(out)]))
    (out / "config.json").write_text(json.dumps({"model": {}, "args": first_m30k}))
    for again, kept in ((["--dataset", "multi30k"], True), ([], True), (["--dataset", "wmt14"], False)):
        args = parse_args(["--out", str(out), "--resume", *again])
        assert (args.data_dir == str(tmp_path / "m") and args.offline) == kept, again


def test_a_runs_record_is_read_in_one_place(tmp_path):
    """runfolder.read_run_record, which the fresh --out check, the resume's checks and flags, the record's update and
    `info` read OUT/config.json through: None where there is none, the dict where it is a run's record, and
    UnreadableRecord (its reason) for anything else: cut short, not UTF-8, not an object, no model or args, a folder,
    a link to nowhere."""
    from minitf.runfolder import UnreadableRecord, read_run_record
    assert read_run_record(tmp_path) is None
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model": {"d_model": 8}, "args": {"seed": 1}, "ranks": 1}))
    assert read_run_record(tmp_path)["args"] == {"seed": 1}
    bad = {b'{"model": {}, "args"': "JSONDecodeError", b'\xff{}': "UnicodeDecodeError", b"[1, 2]": "not a run's record",
           b'{"model": {}}': "not a run's record", b'{"model": [], "args": {}}': "not a run's record",
           b'{"lr": 3}': "not a run's record"}
    for content, reason in bad.items():
        path.write_bytes(content)
        with pytest.raises(UnreadableRecord) as e:
            read_run_record(tmp_path)
        assert e.value.path == str(path) and reason in e.value.reason, (content, e.value.reason)
    path.unlink()
    path.symlink_to(tmp_path / "gone.json")
    with pytest.raises(UnreadableRecord, match="a link to nowhere"):
        read_run_record(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(UnreadableRecord, match="IsADirectoryError"):
        read_run_record(tmp_path)


def test_each_resume_records_the_groups_it_set_so_the_next_resume_takes_them(corpus, tmp_path):
    """A resume that gives one member of a group (--save-every-minutes where the run had --save-every) records the whole
    group as it set it: the next `--resume` alone had restored both members and refused them ("give one spacing")."""
    out = tmp_path / "run"
    assert run_train(corpus, out, "--max-steps", 2, "--save-every", 2, "--valid-every", 0).returncode == 0
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    again = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--out", str(out), "--resume"]
    for extra in (["--max-steps", "3", "--save-every-minutes", "30"], ["--max-steps", "4"]):
        r = subprocess.run(again + extra, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads((out / "config.json").read_text())["args"]
    assert (record["save_every"], record["save_every_minutes"], record["max_steps"]) == (None, 30, 4)


def test_a_resume_from_another_folder_reads_the_first_starts_files(corpus, tmp_path):
    """config.json records the data's paths absolute: a first start with a relative --data-dir, resumed from another
    folder, reads the same files (it had looked for them under the new folder); a damaged config.json is one line."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    first = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", corpus.name,
             "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--quiet", "--beam", "1",
             "--valid-every", "0", "--average-last", "1", "--out", str(out), "--max-steps", "2"]
    r = subprocess.run(first, capture_output=True, text=True, env=env, timeout=600, cwd=corpus.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["args"]["data_dir"] == str(corpus)
    again = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--out", str(out), "--resume", "--max-steps", "3"]
    r = subprocess.run(again, capture_output=True, text=True, env=env, timeout=600, cwd=elsewhere)
    assert r.returncode == 0 and f"--data-dir {corpus} " in r.stderr, r.stderr[-2000:]
    (out / "config.json").write_text((out / "config.json").read_text()[:100])   # cut short
    r = subprocess.run(again[:-1] + ["4"], capture_output=True, text=True, env=env, timeout=600, cwd=elsewhere)
    assert r.returncode == 2 and "config.json is unreadable" in r.stderr and "give the run's data flags again" \
        in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_batches_too_small_for_a_sentence_name_update_freq_where_it_made_them(corpus, tmp_path):
    # the preset's tokens per update split by --update-freq: the error had named only --max-tokens and --max-len,
    # neither given
    r = run_train(corpus, tmp_path / "run", "--max-steps", 2, "--update-freq", 256)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.splitlines()[-1].startswith("error: example ") and "the preset's 512 tokens per update split over 1 rank(s) x --update-freq 256 = 2 tokens" in r.stderr


def test_existing_out_without_resume_and_bad_data_are_one_line_errors(corpus, tmp_path):
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 2, "--save-every", 1, "--average-last", 1)
    assert r.returncode == 0 and "the final checkpoint alone (checkpoint_0000002.npz; no other one every 1 step" \
        in r.stderr, r.stderr[-2000:]   # it had said "averaged 1 checkpoint (every 1 step and the final one"
    r = run_train(corpus, out, "--max-steps", 2)
    assert r.returncode == 2 and "--resume" in r.stderr and "Traceback" not in r.stderr
    # its checkpoints deleted to save space, the run's results stay: a new run there is refused, not written over them
    for p in out.glob("checkpoint_0*.npz"):
        p.unlink()
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run_train(corpus, out, "--max-steps", 2)
    assert r.returncode == 2 and r.stderr.endswith(f"--out {out} holds model.npz, averaged.npz, results.json of an "
                                                   f"earlier run (its checkpoints gone): a new run there would replace "
                                                   f"them; choose another --out, or move them away\n"), r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    mine = tmp_path / "mine"           # a folder of the user's own, with a config.json of something else
    mine.mkdir()
    (mine / "config.json").write_text('{"lr": 3}')
    r = run_train(corpus, mine, "--max-steps", 2)
    assert r.returncode == 2 and "holds a config.json that no minitf run wrote" in r.stderr, r.stderr
    assert (mine / "config.json").read_text() == '{"lr": 3}'
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(corpus):
        (bad / name).write_bytes((corpus / name).read_bytes())
    with gzip.open(bad / "train.de.gz", "wt") as f:
        f.write("nur eine zeile\n")
    r = run_train(bad, tmp_path / "run2", "--max-steps", 2)
    assert r.returncode == 2 and "train.de" in r.stderr and "Traceback" not in r.stderr
    r = run_train(tmp_path / "nowhere", tmp_path / "run3", "--max-steps", 2, "--offline")
    assert r.returncode == 2 and "nowhere" in r.stderr and "Traceback" not in r.stderr


def test_non_finite_losses_are_skipped_then_stop_the_run(corpus, tmp_path):
    # an absurd learning rate blows the weights up within a few updates: the loss turns
    # inf/NaN, those updates are skipped and logged, and the run stops with a message
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 200, "--lr-factor", 1e12, "--max-nonfinite", 3, "--save-every", 100)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "non-finite" in r.stderr and "--lr-factor" in r.stderr and "Traceback" not in r.stderr
    # the advice is one a run can follow: a new --out for a new schedule (a resume keeps the checkpoint's; "lower
    # --lr-factor ..., then --resume" had been refused), --resume only where a checkpoint is kept
    # (without a checkpoint, the same --out is started afresh: "start a new --out" had been more than needed)
    assert "the run diverged; run the command again with a lower --lr-factor or a longer --warmup" in r.stderr or \
        ("--resume goes on from checkpoint_" in r.stderr and "start a new --out" in r.stderr), r.stderr[-1000:]
    events = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e.get("event") == "nonfinite_loss_skipped"]
    assert [e["count"] for e in skipped] == [1, 2, 3]
    if "run the command again" in r.stderr:   # and it does: a run with a sane rate in the same --out
        again = run_train(corpus, out, "--max-steps", 2, "--save-every", 100)
        assert again.returncode == 0, again.stderr[-2000:]


def test_gpu_without_cupy_fails_fast_with_one_line(corpus, tmp_path):
    from minitf.backend import gpu_available
    if gpu_available()[0]:
        pytest.skip("a GPU is present: the error path cannot be exercised here")
    r = run_train(corpus, tmp_path / "run", "--device", "gpu", "--max-steps", 2)
    assert r.returncode == 2 and "--device gpu" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_sigterm_saves_then_exits_143(corpus, tmp_path):
    import signal
    import time
    out = tmp_path / "run"
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
           "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(out), "--quiet",
           "--log-every", "1", "--max-steps", "0", "--save-every", "100000"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "train_log.jsonl").exists() or not (out / "train_log.jsonl").read_text():
        assert p.poll() is None and time.time() < deadline, p.stderr.read()[-2000:] if p.poll() is not None else "slow"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-2000:]      # a scheduler can tell it from a finished run
    assert "interrupted (SIGTERM)" in err and "--resume" in err
    assert len(list(out.glob("checkpoint_*.npz"))) == 1


def test_ctrl_c_in_the_final_evaluation_exits_130_in_one_line(corpus, tmp_path, monkeypatch, capsys):
    # Ctrl-C after training, while translating the test sets: no traceback, exit 130, and
    # the message says the checkpoints are complete and how to score them
    import minitf.train

    def interrupted_finish(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(minitf.train, "finish", interrupted_finish)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    cli = train_wmt_module()
    out = tmp_path / "run"
    code = cli.main(["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size", "60",
                     "--device", "cpu", "--out", str(out), "--quiet", "--max-steps", "3", "--save-every", "3"])
    err = capsys.readouterr().err
    assert code == 130, err[-2000:]
    assert "interrupted (SIGINT) during the final evaluation" in err and "checkpoint_0000003.npz" in err
    assert "Traceback" not in err


def test_on_a_terminal_the_bar_counts_updates_under_a_time_budget(corpus, tmp_path):
    """stderr a terminal: a progress bar; under --time-budget it fills with the budget's seconds and
    counts the updates beside them (not a rate of seconds per second)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
           "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(tmp_path / "run"),
           "--time-budget", "3", "--beam", "1", "--valid-every", "0", "--average-last", "1"]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))   # a 160-column terminal
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:   # the other end closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
    finally:
        os.close(leader)
        p.wait(timeout=300)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, err[-2000:]
    bars = [s for s in err.replace("\r", "\n").splitlines() if s.startswith("train:") and "%|" in s]
    assert bars and any("step=" in b and "upd_s=" in b for b in bars), err[-2000:]
    assert not any("s/s" in b or "it/s" in b for b in bars)
    assert not any(line.startswith("train: step") for line in err.splitlines())   # no plain lines on a terminal


def test_off_a_terminal_progress_is_plain_lines_and_validation_is_printed(corpus, tmp_path):
    """stderr a file or a pipe: one plain line every --log-every updates (no bar redrawn), and a
    validation line (loss, perplexity, greedy BLEU, its seconds) every --valid-every and at the end;
    the best BLEU's model is checkpoint_best.npz, beside --keep-last numbered checkpoints, never
    averaged."""
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
           "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(out), "--max-steps", "22",
           "--log-every", "5", "--valid-every", "10", "--save-every", "5", "--keep-last", "2", "--average-last", "2",
           "--beam", "1", "--valid-bleu-sentences", "12"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    training = r.stderr[r.stderr.index("\nmodel: "):r.stderr.index("\ntraining stopped")]
    assert "\r" not in training and "%|" not in training
    lines = training.splitlines()
    train = [line for line in lines if line.startswith("train: step")]
    assert [line.split(" | ")[0] for line in train] == [f"train: step {s}/22" for s in (5, 10, 15, 20, 22)]   # (22: the end)
    assert all(re.search(r"\| \d+s, about \d+(\.\d)?(s| min| h) left$", line) for line in train), train   # the bar's
    valid = [line for line in lines if line.startswith("valid: step")]
    assert [v.split(" | ")[0] for v in valid] == ["valid: step 10", "valid: step 20", "valid: step 22"]
    assert all(" | loss " in v and " | ppl " in v and "(greedy, 12 of 30 sentences)" in v for v in valid)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    recs = [rec for rec in log if "valid_bleu" in rec]
    assert [rec["step"] for rec in recs] == [10, 20, 22] and all(rec["valid_s"] > 0 for rec in recs)
    best = max(recs, key=lambda rec: (rec["valid_bleu"], -rec["step"]))
    ckpt = load_checkpoint(out / "checkpoint_best.npz")
    assert ckpt.optimizer is None and ckpt.train_state["step"] == best["step"]
    assert sorted(p.name for p in out.glob("checkpoint_*.npz")) == \
        ["checkpoint_0000020.npz", "checkpoint_0000022.npz", "checkpoint_best.npz"]
    res = json.loads((out / "results.json").read_text())
    assert "checkpoint_best.npz" not in res["averaged_checkpoints"]
    assert res["best_valid"]["step"] == best["step"] and res["validation_s"] > 0
    quiet = subprocess.run(cmd[:cmd.index("--out") + 1] + [str(tmp_path / "quiet")] + cmd[cmd.index("--out") + 2:]
                           + ["--quiet"], capture_output=True, text=True, env=env, timeout=600)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "train: step" not in quiet.stderr and quiet.stderr.count("valid: step") == 3


def test_the_average_ends_at_the_final_checkpoint_and_skips_off_spacing_ones(corpus, tmp_path):
    """Evenly spaced checkpoints and the final one (here off the spacing, as a --time-budget stop
    leaves it), from the run's second half; an earlier stop's checkpoint (step 14, off the spacing)
    in the middle is left out."""
    out = tmp_path / "run"
    args = ("--save-every", 5, "--valid-every", 0, "--average-last", 5, "--keep-last", 10, "--beam", 1)
    assert run_train(corpus, out, "--max-steps", 14, *args).returncode == 0
    r = run_train(corpus, out, "--max-steps", 27, "--resume", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert (out / "checkpoint_0000014.npz").is_file() and (out / "checkpoint_0000027.npz").is_file()
    names = ["checkpoint_0000015.npz", "checkpoint_0000020.npz", "checkpoint_0000025.npz", "checkpoint_0000027.npz"]
    assert res["averaged_checkpoints"] == names
    assert f"averaged 4 checkpoints (every 5 steps and the final one, from the run's second half: {', '.join(names)})" \
        in r.stderr


def test_a_short_run_reports_a_model_no_worse_than_its_last_checkpoint(corpus, tmp_path):
    """40 updates with a checkpoint every 5 (the first ones in the warmup): the average spans the
    run's second half, ends at the final checkpoint, and the run reports whichever of it and the
    last checkpoint has the lower validation loss, says which (log, results.json, model.npz), and
    scores that model. (Whether the former window, 8 evenly spaced from step 5, scores worse on a run of 40 updates
    depends on the BLAS's rounding: it did with two OpenBLAS threads, not with one. docs/benchmarks.md compares the
    two windows on a real run.)"""
    from minitf.checkpoint import average_checkpoints
    from minitf.data.tokenizer import Tokenizer
    from minitf.validation import Validation, evaluate_loss
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 40, "--save-every", 5, "--average-last", 8, "--valid-every", 0,
                  "--beam", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["averaged_checkpoints"] == [f"checkpoint_{s:07d}.npz" for s in (20, 25, 30, 35, 40)]
    assert res["valid_loss"] == min(res["valid_loss_averaged"], res["valid_loss_last"])
    assert res["model_checkpoints"] == (res["averaged_checkpoints"] if res["model"] == "averaged"
                                        else ["checkpoint_0000040.npz"])
    assert f"the run reports {'the average' if res['model'] == 'averaged' else 'the last checkpoint'}" in r.stderr
    # the last checkpoint's loss measured here
    last = load_checkpoint(out / "checkpoint_0000040.npz")
    tok = Tokenizer.from_bytes(last.tokenizer)
    valid = [(corpus / f"val.{lang}.gz") for lang in ("en", "de")]
    lines = [gzip.open(v, "rt").read().splitlines() for v in valid]
    batches = Validation(lines, tok, 512, 0, 50).batches
    model = last.build_model()
    assert round(evaluate_loss(model, batches)[0], 4) == res["valid_loss_last"]
    average_checkpoints([out / f"checkpoint_{s:07d}.npz" for s in range(20, 45, 5)], tmp_path / "avg.npz")
    model.load_state_dict(load_checkpoint(tmp_path / "avg.npz").params)
    assert round(evaluate_loss(model, batches)[0], 4) == res["valid_loss_averaged"]
    assert load_checkpoint(out / "model.npz").optimizer is None


def test_checkpoints_every_few_minutes_and_the_papers_presets():
    from minitf.config import Config
    base, big = Config.preset("base", vocab_size=100), Config.preset("big", vocab_size=100)
    assert (base.save_every_minutes, base.average_last, base.max_steps) == (10.0, 5, 100_000)   # paper 6.1, 5.2
    assert (big.save_every_minutes, big.average_last, big.max_steps) == (10.0, 20, 300_000)


def test_minute_spacing_saves_on_the_clock_and_averages_those(corpus, tmp_path):
    from minitf.checkpoint import read_train_state
    out = tmp_path / "run"
    # intervals of 1.2 s end at 4.8 s and 6.0 s: the 5.4 s budget stops between them, off the grid (halfway, so that
    # only an update of over 0.6 s, on a machine under load, could put the stop on the grid)
    r = run_train(corpus, out, "--max-steps", 0, "--time-budget", 5.4, "--save-every-minutes", 0.02,
                  "--valid-every", 0, "--average-last", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    states = {p.name: read_train_state(p) for p in out.glob("checkpoint_*.npz")}
    assert len(states) == 3                                             # keep_last = average_last + 1
    last = max(states)
    assert not states[last]["on_grid"]                                  # the budget's stop, off the spacing
    spaced, final = res["averaged_checkpoints"]                         # the last on the spacing, and the final one
    assert states[spaced]["on_grid"] and final == last
    on_grid = sorted(name for name in states if states[name]["on_grid"])
    walls = [states[name]["train_wall_s"] for name in on_grid]
    # each the first update after an interval's end: in consecutive intervals (a save comes up to an update late, so
    # two saves are not a whole interval apart: 1.2 s less 0.35 s was seen under load)
    assert [int(w // 1.2) for w in walls] == [int(walls[0] // 1.2), int(walls[0] // 1.2) + 1], walls


def test_arch_rnn_end_to_end_and_exact_resume(corpus, tmp_path):
    """--arch rnn: the same loop, checkpoints, averaging, beam search and scoring; resume is exact
    (dropout masks from (seed, batch index) as for the Transformer); a resumed run keeps its arch."""
    straight, split, cache = tmp_path / "straight", tmp_path / "split", tmp_path / "cache"
    args = ("--arch", "rnn", "--attention", "additive", "--save-every", 3, "--valid-every", 3, "--average-last", 2)
    r = run_train(corpus, straight, "--max-steps", 6, *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model: rnn," in r.stderr
    res = json.loads((straight / "results.json").read_text())
    assert set(res["bleu"]) == {"valid", "test_2016_flickr"} and len(res["averaged_checkpoints"]) == 2
    ckpt = load_checkpoint(straight / "averaged.npz")
    assert ckpt.config.arch == "rnn" and ckpt.config.attention == "additive"
    assert run_train(corpus, split, "--max-steps", 3, *args, cache=cache).returncode == 0
    r = run_train(corpus, split, "--max-steps", 6, "--resume", *args, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(straight), losses(split)
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]
    r = run_train(corpus, split, "--max-steps", 8, "--resume", "--arch", "transformer", cache=cache)
    assert r.returncode != 0 and "--arch transformer" in r.stderr and "Traceback" not in r.stderr
    r = run_train(corpus, tmp_path / "x", "--attention", "dot", "--arch", "transformer", cache=cache)
    assert r.returncode == 2 and "--attention" in r.stderr
    # without --arch a new run is a Transformer: --attention refused too (it had been recorded in its config)
    r = run_train(corpus, tmp_path / "x", "--attention", "dot", cache=cache)
    assert r.returncode == 2 and "--attention chooses the attention of --arch rnn" in r.stderr
    # resumed, the Transformer's flags are refused for what the RNN has not (they had been compared as if it had)
    r = run_train(corpus, split, "--max-steps", 8, "--resume", "--heads", 4, cache=cache)
    assert r.returncode == 2 and "--heads sets what --arch rnn has not" in r.stderr and "Traceback" not in r.stderr
    # and so for a model --init-from brings (its Config had refused the field, by the field's name)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir",
                        str(corpus), "--device", "cpu", "--init-from", str(straight / "model.npz"), "--attention-dropout",
                        "0.1", "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, MINITF_CACHE=str(cache)))
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"error: --attention-dropout sets what --arch rnn has not (--init-from {straight / 'model.npz'} is an rnn "
        f"model); drop the flag"), r.stderr[-2000:]


def test_the_runs_end_is_logged_and_an_extension_logs_as_a_run_that_never_stopped(corpus, tmp_path):
    # --log-every 5 over 7 updates had left the last 2 out of the log (a --time-budget run's last updates never reached
    # it): a record of them closes the run, marked "tail"; a --resume extending the run drops it, as the end's scores,
    # and its records are those of the run made at once (the window of updates 6-7 kept in the checkpoint)
    flags = ("--log-every", 5, "--valid-every", 0, "--save-every", 7, "--average-last", 1)
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run_train(corpus, straight, "--max-steps", 10, *flags).returncode == 0
    r = run_train(corpus, split, "--max-steps", 7, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    first = records(split)
    assert sorted(first) == [5, 7] and first[7]["tail"] is True and "tail" not in first[5]
    assert first[7]["lr"] > first[5]["lr"] and first[7]["tokens_per_s"] > 0 and first[5]["loss"] == records(straight)[5]["loss"]
    r = run_train(corpus, split, "--max-steps", 10, *flags, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped the records of the run's end at step 7 (2 scores and its last training record)" in r.stderr, \
        r.stderr[:3000]
    a, b = records(straight), records(split)
    assert sorted(b) == [5, 10] and [a[s]["loss"] for s in (5, 10)] == [b[s]["loss"] for s in (5, 10)]
    # a resume that only makes the end again (scores it anew) writes the end's record again, from the kept window
    short = tmp_path / "short"
    assert run_train(corpus, short, "--max-steps", 7, *flags).returncode == 0
    r = run_train(corpus, short, "--max-steps", 7, *flags, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    made = records(short)
    assert sorted(made) == [5, 7] and made[7]["loss"] == first[7]["loss"] and made[7]["lr"] == first[7]["lr"]
    assert "tokens_per_s" not in made[7] and made[7]["tail"] is True   # (no update of this process's to time)


def test_lr_fade_brings_the_learning_rate_to_zero_at_the_runs_end(corpus, tmp_path):
    """--lr-fade 0.5 over --max-steps 12: the paper's lr for steps 1-6, then times (1 - p) / 0.5 with
    p = (step - 1) / 12 the progress before the update, down to 1/6 of it at step 12."""
    from minitf.schedule import noam
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 12, "--lr-fade", 0.5, "--valid-every", 0, "--save-every", 4,
                  "--average-last", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "train_log.jsonl") as f:
        lrs = {rec["step"]: rec["lr"] for rec in map(json.loads, f) if "lr" in rec}
    cfg = load_checkpoint(out / "averaged.npz").config
    assert cfg.lr_fade == 0.5
    for step in range(1, 13):
        paper = noam(step, cfg.d_model, cfg.warmup, cfg.lr_factor)
        expect = paper * min(1.0, (1 - (step - 1) / 12) / 0.5)
        assert lrs[step] == pytest.approx(expect, rel=1e-12), step
    assert lrs[6] == pytest.approx(noam(6, cfg.d_model, cfg.warmup, cfg.lr_factor))   # not faded yet
    assert lrs[12] == pytest.approx(noam(12, cfg.d_model, cfg.warmup, cfg.lr_factor) / 6)   # (1 - 11/12) / 0.5
    # extended to a later end, the fade starts again from there: the rate goes up, and the resume says by how much
    # (it had, without a word); its figures are the log's
    r = run_train(corpus, out, "--resume", "--max-steps", 24)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out / "train_log.jsonl") as f:
        lrs = {rec["step"]: rec["lr"] for rec in map(json.loads, f) if "lr" in rec}
    assert lrs[13] > 3 * lrs[12]
    assert (f"note: --lr-fade 0.5 fades the learning rate over the run's new end, --max-steps 24 (before: --max-steps "
            f"12): from step 13 it is {lrs[13]:.3g}, where the earlier end would have made it 0; it fades to 0 again "
            f"from there") in r.stderr
    r = run_train(corpus, out, "--resume", "--max-steps", 24)          # the same end again: nothing to say
    assert r.returncode == 0 and "--lr-fade" not in r.stderr
    # nor where the end did not move and the warmup's rise is all (it had said so at every resume during warmup)
    warm = tmp_path / "warm"
    r = run_train(corpus, warm, "--max-steps", 3, "--lr-fade", 0.5, "--warmup", 4000, "--save-every", 3,
                  "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(corpus, warm, "--resume", "--max-steps", 6, "--warmup", 4000)
    assert r.returncode == 0 and "before: --max-steps 3" in r.stderr     # the end moved: said
    r = run_train(corpus, warm, "--resume", "--max-steps", 6, "--warmup", 4000)
    assert r.returncode == 0 and "--lr-fade" not in r.stderr


def test_weight_decay_shrinks_the_weights_and_a_resume_keeps_it(corpus, tmp_path):
    """--weight-decay reaches Adam: the same seed and data with the decay end with a smaller weight
    norm, the checkpoint records it, and a resume with another value is refused, naming both."""
    norms = {}
    for wd in (0, 0.5):
        out = tmp_path / f"wd{wd}"
        r = run_train(corpus, out, "--max-steps", 4, "--weight-decay", wd, "--valid-every", 0, "--save-every", 4,
                      "--average-last", 1)
        assert r.returncode == 0, r.stderr[-3000:]
        ck = load_checkpoint(out / "averaged.npz")
        assert ck.config.weight_decay == wd
        norms[wd] = sum(float(np.sum(np.square(v))) for v in ck.params.values())
    assert norms[0.5] < 0.99 * norms[0]
    r = run_train(corpus, tmp_path / "wd0.5", "--max-steps", 5, "--resume", "--weight-decay", 0.1, "--valid-every", 0)
    assert r.returncode != 0 and "--weight-decay 0.1: the checkpoint" in r.stderr and "--weight-decay 0.5" in r.stderr
    assert "Traceback" not in r.stderr


def test_lr_fade_needs_an_end_and_a_fraction(corpus, tmp_path):
    r = run_train(corpus, tmp_path / "a", "--max-steps", 0, "--lr-fade", 0.3)
    assert r.returncode != 0 and "--lr-fade 0.3" in r.stderr and "--time-budget or --max-steps" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_train(corpus, tmp_path / "b", "--max-steps", 5, "--lr-fade", 1.5)
    assert r.returncode == 2 and "argument --lr-fade: must be a finite number in [0, 1], got 1.5" in r.stderr


def test_model_size_flags_override_the_preset_and_a_resume_keeps_them(corpus, tmp_path):
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 2, "--d-model", 48, "--heads", 3, "--d-ff", 40, "--layers", 2,
                  "--decoder-layers", 1, "--valid-every", 0, "--save-every", 1, "--average-last", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = load_checkpoint(out / "averaged.npz").config
    assert (cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_ff, cfg.n_layers, cfg.n_decoder_layers) == (48, 3, 16, 40, 2, 1)
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--decoder-layers", 2, "--valid-every", 0,
                  "--save-every", 1, "--average-last", 1)
    assert r.returncode != 0 and "--decoder-layers 2: the checkpoint" in r.stderr and "--decoder-layers 1" in r.stderr
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--d-ff", 64, "--valid-every", 0, "--save-every", 1,
                  "--average-last", 1)
    assert r.returncode != 0 and "--d-ff 64: the checkpoint" in r.stderr and "--d-ff 40" in r.stderr
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--dropout", 0.3, "--valid-every", 0, "--save-every", 1,
                  "--average-last", 1)   # a recipe flag the checkpoint would silently override
    assert r.returncode != 0 and "--dropout 0.3: the checkpoint" in r.stderr and "--dropout 0.1" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--layers", 0)
    assert r.returncode == 2 and "argument --layers: must be an integer >= 1, got 0" in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--d-model", 51)   # tiny has 2 heads
    assert r.returncode == 2 and "--d-model 51 is not divisible by --heads 2" in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--arch", "rnn", "--d-ff", 64)
    assert r.returncode == 2 and "--d-ff sizes the Transformer's layers; --arch rnn has none" in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--arch", "rnn", "--decoder-layers", 2)
    assert r.returncode == 2 and "--decoder-layers is the Transformer's" in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--arch", "rnn", "--attention-dropout", 0.1)
    assert r.returncode == 2 and "--attention-dropout is the Transformer's; --arch rnn has only --dropout" in r.stderr
    r = run_train(corpus, tmp_path / "drops", "--max-steps", 2, "--attention-dropout", 0.15, "--relu-dropout", 0.25,
                  "--valid-every", 0, "--save-every", 1, "--average-last", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = load_checkpoint(tmp_path / "drops" / "averaged.npz").config
    assert (cfg.attention_dropout, cfg.relu_dropout) == (0.15, 0.25)


def test_norm_pre_trains_a_pre_norm_model_that_a_resume_and_the_translation_keep(corpus, tmp_path):
    out = tmp_path / "pre"
    r = run_train(corpus, out, "--max-steps", 2, "--norm", "pre", "--save-every", 1, "--average-last", 1,
                  "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "; pre-norm (--norm pre)" in r.stderr
    ck = load_checkpoint(out / "averaged.npz")
    assert ck.config.norm_position == "pre" and "encoder.norm.weight" in ck.params
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--norm", "post", "--save-every", 1, "--average-last", 1,
                  "--valid-every", 0)
    assert r.returncode != 0 and "--norm post: the checkpoint" in r.stderr and "--norm pre" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--save-every", 1, "--average-last", 1, "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_checkpoint(out / "averaged.npz").config.norm_position == "pre"
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--arch", "rnn", "--norm", "pre")
    assert r.returncode == 2 and "--norm places the LayerNorms of the Transformer's residual blocks" in r.stderr
    r = run_train(corpus, tmp_path / "bad", "--max-steps", 2, "--norm", "middle")
    assert r.returncode == 2 and "argument --norm: invalid choice: 'middle'" in r.stderr


@pytest.mark.parametrize("preset,update", [("base", 25000), ("big", 25000), ("small", 3072), ("tiny", 512)])
def test_a_presets_update_holds_the_same_tokens_on_any_number_of_ranks(preset, update):
    """Paper 5.1: ~25000 source and target tokens per update, on 8 GPUs (5.2). A preset states the
    update; ranks x --update-freq split it, and an explicit --max-tokens stays per batch per rank."""
    cfg = minitf.Config.preset(preset)
    assert cfg.update_tokens == update and cfg.max_tokens is None
    for ranks in (1, 2, 8):
        for freq in (1, 2, 4):
            total = ranks * freq * cfg.batch_tokens(ranks, freq)
            assert update - ranks * freq < total <= update, (ranks, freq, total)
    assert minitf.Config.preset("base").batch_tokens(8, 1) == 3125
    fixed = minitf.Config.preset(preset, max_tokens=1000)
    assert fixed.batch_tokens(1, 1) == fixed.batch_tokens(8, 4) == 1000


def test_resume_with_other_batches_is_one_line(corpus, tmp_path):
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 2, "--save-every", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run_train(corpus, out, "--max-steps", 4, "--save-every", 2, "--update-freq", 2, "--resume")
    assert r.returncode == 2 and "batches of 512 tokens" in r.stderr and "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept     # config.json's record of the run untouched
    r = run_train(corpus, out, "--max-steps", 4, "--save-every", 2, "--max-tokens", 300, "--resume")
    assert r.returncode == 2 and "--max-tokens 300 makes batches of 300" in r.stderr and "Traceback" not in r.stderr
    # an explicit --max-tokens that keeps the batches' size resumes with another --update-freq
    r = run_train(corpus, out, "--max-steps", 4, "--save-every", 2, "--update-freq", 2, "--max-tokens", 512, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "note: an update is now 2 batches of 512 tokens (1 rank(s) x --update-freq 2), 1,024 tokens where the run " \
           "made 512: the same batches, in updates of another size" in r.stderr


def test_a_signal_where_no_checkpoint_can_be_saved_names_the_one_resume_continues_from(tmp_path, monkeypatch, capsys):
    # a signal outside the loop's and the end's held windows (closing the batch feed) had been reported by the entry
    # point as 'interrupted before training began ... run the command again'
    import minitf.train
    from minitf.errors import Interrupted, Terminated
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint_0000010.npz").write_bytes(b"")

    class Run:
        args, lead, world, state = types.SimpleNamespace(out=str(out)), True, distributed.World(), {"step": 12}
        log = feed = console = types.SimpleNamespace(close=lambda: None)
        window = {"n": 0}

    def closing_feed_is_signalled():
        raise Terminated()
    Run.feed = types.SimpleNamespace(close=closing_feed_is_signalled)
    monkeypatch.setattr(minitf.train, "set_up", lambda args, world: Run())
    monkeypatch.setattr(minitf.train, "run_loop", lambda run: "max_steps")
    with pytest.raises(Interrupted) as e:
        minitf.train._locked_train(Run.args, Run.world)
    assert e.value.signame == "SIGTERM" and capsys.readouterr().err == (
        f"interrupted (SIGTERM) at step 12: stopped without saving; --resume continues from "
        f"{out / 'checkpoint_0000010.npz'}\n")


def test_a_resume_to_a_step_it_has_passed_says_it_only_ends_the_run(corpus, tmp_path):
    out = tmp_path / "run"
    assert run_train(corpus, out, "--max-steps", 3, "--save-every", 3, "--valid-every", 0).returncode == 0
    r = run_train(corpus, out, "--max-steps", 2, "--resume", "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: --max-steps 2 is not above the run's step 3: no update is made; the run's end (the average and the " \
           "scores) is made again" in r.stderr and "this run makes about" not in r.stderr


def test_a_resume_refuses_what_its_checkpoints_cannot_take(corpus, tmp_path):
    """Another direction, another precision of the weights, another tokenizer given again: each had been taken (the
    end's average then failed on float64 beside float32 checkpoints; de -> en was trained into an en -> de run; the
    tokenizer flags were ignored) and is now one line naming the flag, before anything in --out is written."""
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 2, "--save-every", 2, "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "other.model").write_bytes(b"another tokenizer")
    for extra, said in ((("--dtype", "float64"), "--dtype float64: the checkpoint"),
                        (("--src", "de", "--tgt", "en"), "translates en -> de; resume it with --src en --tgt de"),
                        (("--vocab-size", "80"), "--vocab-size 80: the checkpoint"),
                        (("--subword", "bpe"), "encodes with its own tokenizer (--subword unigram)"),
                        (("--tokenizer", tmp_path / "other.model"), "is not the tokenizer the checkpoint")):
        r = run_train(corpus, out, "--max-steps", 4, "--resume", *extra)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])
        assert {p.name: p.read_bytes() for p in out.iterdir()} == kept
    # the run's own tokenizer and its own values given again resume it (the first start's --vocab-size 60 among them,
    # though its tokenizer has fewer pieces: this corpus is small)
    own = next((tmp_path / "cache").rglob("tokenizer.model"))
    r = run_train(corpus, out, "--max-steps", 3, "--resume", "--tokenizer", own, "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-3000:]


def test_flags_and_files_that_cannot_work_are_one_line_errors(corpus, tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "garbage.model").write_text("not a model")
    half = tmp_path / "half"
    half.mkdir()
    for name in os.listdir(corpus):
        if not name.startswith("train.de"):
            (half / name).write_bytes((corpus / name).read_bytes())
    cases = [
        ((tmp_path / "empty", "--resume"), "holds no checkpoint_*.npz to continue from"),
        ((tmp_path / "afile",), "is a file, not a folder"),
        ((tmp_path / "afile" / "run",), "is a file, not a folder"),
        ((tmp_path / "r", "--tokenizer", tmp_path / "garbage.model"), "garbage.model is not a SentencePiece model"),
        ((tmp_path / "r", "--data-dir", half, "--offline"), f"{half / 'train.de'}[.gz] is missing"),
    ]
    for (out, *extra), what in cases:
        r = run_train(corpus, out, "--max-steps", 2, *extra)
        assert r.returncode == 2 and what in r.stderr, (extra, r.stderr[-2000:])
        lines = [x for x in r.stderr.splitlines() if "error" in x]
        assert len(lines) == 1 and "Traceback" not in r.stderr and "delete it" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "empty").exists()                    # refused before anything was made


def test_ctrl_c_while_the_cache_is_built_is_one_line_and_keeps_nothing(corpus, tmp_path, monkeypatch, capsys):
    from minitf.data import prepare

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "_encode_all", ctrl_c)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    code = train_wmt_module().main(["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size",
                              "60", "--device", "cpu", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "3"])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert [x for x in err.splitlines() if "interrupted" in x] == [
        "interrupted before training began: nothing half-written was kept (the cache and checkpoints are written "
        "whole or not at all); run the command again"]
    left = [p for p in os.listdir(tmp_path / "cache" / "bin") if not p.endswith(".lock")]
    assert left == []                                             # no half-built cache, not even a temporary one


def test_a_corrupt_cache_found_mid_run_is_one_line(corpus, tmp_path):
    """Offsets damaged after a run started: the start cannot see it (it reads no offsets but the
    last), the batch that reads the row does; the error says how to check and rebuild the cache."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    r = run_train(corpus, out, "--max-steps", 2, "--save-every", 2, "--average-last", 1, "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-2000:]
    folder = next(p for p in (cache / "bin").iterdir() if p.is_dir())
    offsets = np.load(folder / "train.de.offsets.npy", mmap_mode="r+")
    offsets[len(offsets) // 2] = -(2**40)
    offsets.flush()
    del offsets
    r = run_train(corpus, out, "--max-steps", 40, "--resume", "--save-every", 2, "--average-last", 1, "--valid-every", 0)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "Errno" not in r.stderr, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "train.de.offsets.npy" in lines[0] and "prepare --verify" in lines[0]


def test_checkpoints_spaced_in_minutes_come_with_their_validations():
    """With both spaced in minutes (base/big: validation at every checkpoint), the validation and the checkpoint fall
    on the same update: the save had read the clock after the update and the validation the agreed clock before it,
    so each checkpoint came one update before its validation (and checkpoint_best.npz at a step with none)."""
    import minitf.train
    events = []

    class Run:
        args = types.SimpleNamespace(log_every=10**9, valid_every=None, valid_every_minutes=1.0, save_every=None,
                                     save_every_minutes=1.0)
        state, window, lead, short_noted, validation = {"step": 0}, minitf.train.new_window(), True, True, True
        console = types.SimpleNamespace(update=lambda step, wall: None)
        clock = 0.0

        def elapsed(self):
            return self.clock

        def save(self, on_grid):
            events.append(("save", self.state["step"]))
    run = Run()
    validate = minitf.train.validate
    try:
        minitf.train.validate = lambda run: events.append(("valid", run.state["step"]))
        for step, (top, after) in enumerate(((59.0, 59.6), (59.6, 60.3), (60.3, 60.9), (119.8, 120.1), (120.1, 120.5)),
                                            start=1):
            run.state["step"], run.elapsed_lead, run.clock = step, top, after
            minitf.train.after_step(run, 1.0, 1.0, 1, 1e-3)
    finally:
        minitf.train.validate = validate
    assert events == [("valid", 3), ("save", 3), ("valid", 5), ("save", 5)]


def test_ranks_that_disagree_are_told_only_what_differs():
    from minitf.errors import ConfigError
    from minitf.train import _agree

    class World:
        def allgather(self, facts):
            other = dict(facts, seed=7, config=dict(facts["config"], dropout=0.3, n_heads=4, output_layer="target",
                                                    pad_id=9, output_vocab=",".join(map(str, range(1, 3000, 2)))))
            return [facts, other]
    cfg = minitf.Config.preset("tiny", vocab_size=60).to_dict()
    with pytest.raises(ConfigError) as e:
        _agree(World(), data_id="abc", config=cfg, seed=1, max_steps=5)
    msg = str(e.value)
    assert "--seed 1 (rank 0) vs 7 (rank 1)" in msg and "--dropout 0.1 (rank 0) vs 0.3 (rank 1)" in msg
    assert "--heads 2 (rank 0) vs 4 (rank 1)" in msg and "d_model" not in msg
    assert "--output-vocab joint (rank 0) vs target (rank 1)" in msg and "the config's pad_id 0 (rank 0) vs 9" in msg
    assert "the config's output_vocab None (rank 0) vs <1,500 pieces: 1,3,5,7,...> (rank 1)" in msg and len(msg) < 600


def test_a_signal_landing_during_the_stop_vote_is_acted_on_by_every_rank_at_the_next_update():
    """SIGTERM arriving on one rank while the ranks sum their stop votes: the other ranks voted on
    a sum without it, so this rank must not stop alone now (they would wait for it in the next
    update's all-reduce forever); all stop together at the next vote."""
    import types
    from minitf.train import StopSignals, should_stop

    signals = StopSignals(2)

    class World:   # rank 1 of two; rank 0 has no signal
        size = 2

        def allreduce_numbers(self, values):
            signals.received.append("SIGTERM")   # lands while the sum is on the wire
            return [float(v) for v in values[:3]] + [2 * values[3], 1.0]   # the clocks: both ranks', rank 0's
    run = types.SimpleNamespace(args=types.SimpleNamespace(max_steps=0, time_budget=0, patience=0), state={"step": 5}, pending=None,
                                elapsed=lambda: 1.0, world=World(), lead=False)
    assert should_stop(run, signals) is None   # what rank 0 decides on the same sum
    assert run.elapsed_mean == 1.0 and run.elapsed_lead == 1.0
    World.allreduce_numbers = lambda self, values: [float(v) for v in values[:3]] + [2 * values[3], 1.0]
    assert should_stop(run, signals) == "SIGTERM"


def test_a_full_disk_while_preparing_the_data_is_one_line(corpus, tmp_path, monkeypatch, capsys):
    import errno
    from minitf.data import prepare

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(prepare._NpyWriter, "append", full)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    code = train_wmt_module().main(["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size",
                              "60", "--device", "cpu", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "3"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "disk is full" in lines[0] and str(tmp_path / "cache" / "bin") in lines[0] and "--keep-last" not in lines[0]


def _start_train(corpus, out, cache, *extra):
    env = dict(os.environ, MINITF_CACHE=str(cache), PYTHONHASHSEED="0")
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
           "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(out), "--quiet",
           "--log-every", "1", *map(str, extra)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_log_lines(p, out, n, timeout=300):
    import time
    deadline = time.time() + timeout
    log = out / "train_log.jsonl"
    while not log.exists() or log.read_text().count("\n") < n:
        if p.poll() is not None:
            raise AssertionError(p.stderr.read()[-2000:])
        assert time.time() < deadline, "training did not start"
        time.sleep(0.02)


def test_ctrl_c_mid_training_then_resume_is_exact(corpus, tmp_path):
    """Ctrl-C lands wherever the update is (forward, backward, Adam): the checkpoint it saves is
    the position after the last COMPLETED update, so --resume gives the straight run bit for bit
    (float64, dropout on)."""
    import signal
    split, straight, cache = tmp_path / "split", tmp_path / "straight", tmp_path / "cache"
    flags = ("--dtype", "float64", "--dropout", 0.1, "--save-every", 100000, "--valid-every", 0,
             "--average-last", 1, "--beam", 1)
    assert run_train(corpus, tmp_path / "warm", "--max-steps", 1, *flags, cache=cache).returncode == 0   # the cache
    p = _start_train(corpus, split, cache, "--max-steps", 0, *flags)
    _wait_for_log_lines(p, split, 3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "interrupted (SIGINT)" in err, err[-2000:]
    assert "SIGINT: stopping after the update in progress, then saving (Ctrl-C again" in err
    saved, = split.glob("checkpoint_*.npz")
    state = load_checkpoint(saved).train_state
    k = state["step"]
    assert state["forward_count"] == k                                 # one batch per update, all of them done
    r = run_train(corpus, split, "--max-steps", k + 3, "--resume", *flags, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(corpus, straight, "--max-steps", k + 3, *flags, cache=cache)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_checkpoint(straight / f"checkpoint_{k + 3:07d}.npz")
    b = load_checkpoint(split / f"checkpoint_{k + 3:07d}.npz")
    assert {n: a.train_state[n] for n in ("epoch", "batch", "forward_count")} == \
        {n: b.train_state[n] for n in ("epoch", "batch", "forward_count")}
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)


def test_sigterm_in_the_final_evaluation_exits_143_in_one_line(corpus, tmp_path):
    script = f"""
import os, signal, sys, time
sys.path.insert(0, {ROOT!r})
import minitf.train
def finish(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
minitf.train.finish = finish
from minitf.train_cli import main
sys.exit(main(sys.argv[1:]))
"""
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, "-c", script, "--dataset", "multi30k", "--data-dir", str(corpus), "--preset",
                        "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(tmp_path / "run"), "--quiet",
                        "--max-steps", "3", "--save-every", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 143, r.stderr[-2000:]
    assert "interrupted (SIGTERM) during the final evaluation" in r.stderr and "checkpoint_0000003.npz" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_full_disk_for_the_log_is_one_line_and_a_torn_line_is_dropped(corpus, tmp_path):
    out = tmp_path / "full"
    out.mkdir()
    (out / "train_log.jsonl").symlink_to("/dev/full")            # every write: ENOSPC
    r = run_train(corpus, out, "--max-steps", 3, "--save-every", 3, cache=tmp_path / "cache")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "train_log.jsonl: cannot append to the training log: No space left on device" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error: ")
    # a record cut mid-write (a kill, a full disk): the next start drops it, and the log stays JSONL
    out = tmp_path / "torn"
    args = ("--save-every", 2, "--valid-every", 0, "--average-last", 1, "--beam", 1)
    assert run_train(corpus, out, "--max-steps", 2, *args, cache=tmp_path / "cache").returncode == 0
    with open(out / "train_log.jsonl", "a") as f:
        f.write('{"step": 3, "epoch": 0.2')
    r = run_train(corpus, out, "--max-steps", 4, "--resume", *args, cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dropped its torn last line (24 bytes" in r.stderr
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records if "loss" in rec] == [1, 2, 3, 4]


def test_a_start_removes_temporary_checkpoints_of_a_killed_save(corpus, tmp_path):
    out = tmp_path / "run"
    args = ("--save-every", 2, "--valid-every", 0, "--average-last", 1, "--beam", 1)
    assert run_train(corpus, out, "--max-steps", 2, *args).returncode == 0
    (out / ".tmp-k1ll3d0xcheckpoint_0000004.npz").write_bytes(b"\0" * 1000)   # atomic_write's temp name
    (out / ".tmp-abcdefghnotes.txt").write_bytes(b"not ours")
    (out / ".tmp-k1ll3d0xtrain_log.jsonl").write_bytes(b"{}\n")   # a resume killed while it cut the log (it had stayed)
    r = run_train(corpus, out, "--max-steps", 4, "--resume", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed 2 temporary files of an earlier run" in r.stderr and ".tmp-k1ll3d0xcheckpoint_0000004.npz" in r.stderr
    assert sorted(p.name for p in out.glob(".tmp-*")) == [".tmp-abcdefghnotes.txt"]


def test_a_failed_data_download_leaves_no_out_folder(tmp_path):
    r = run_train(tmp_path / "nowhere", tmp_path / "run", "--max-steps", 2, "--offline")
    assert r.returncode == 2 and "nowhere" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_without_preset_the_device_chooses_it_and_the_run_says_so(corpus, tmp_path):
    from minitf.train_cli import parse_args
    cpu = parse_args(["--out", str(tmp_path / "a")])
    gpu = parse_args(["--out", str(tmp_path / "b"), "--device", "gpu"])
    given = parse_args(["--out", str(tmp_path / "c"), "--preset", "base"])
    assert (cpu.preset, cpu.preset_chosen, gpu.preset, given.preset, given.preset_chosen) == (
        "small", True, "base", "base", False)
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir",
                        str(corpus), "--vocab-size", "60", "--out", str(tmp_path / "run"), "--quiet", "--max-steps", "1",
                        "--valid-every", "0", "--beam", "1", "--max-nonfinite", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: no --preset given: small, the preset for --device cpu" in r.stderr
    assert "pieces (--output-vocab target)" in r.stderr                       # small's output layer
    assert load_checkpoint(tmp_path / "run" / "model.npz").config.output_layer == "target"


def test_a_run_names_its_task_first_and_an_ambiguous_own_corpus_is_refused(corpus, tmp_path):
    """The first lines name the corpus, the direction and where the scores and model go; an own corpus
    with files of more than the default pair and no --src/--tgt is one line listing its languages."""
    out = tmp_path / "run"
    r = run_train(corpus, out, "--max-steps", 1, "--save-every", 1, "--average-last", 1, "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-2000:]
    task = [line for line in r.stderr.splitlines() if line.startswith("task:")]
    assert task == [f"task: multi30k, en -> de; the scores go to {out / 'results.json'}, the model to "
                    f"{out / 'model.npz'}"]
    recorded = json.loads((out / "config.json").read_text())   # which fields the flags set (FLAG_FIELDS)
    assert recorded["set_by_flags"] == {"max_steps": "max_steps", "save_every": "save_every",
                                        "average_last": "average_last"}
    assert ("note: this run makes about 1 update (--max-steps 1), ending inside the learning rate's 10-update "
            "warmup: expect a much weaker model") in r.stderr
    own = tmp_path / "own"
    own.mkdir()
    for lang, name in (("en", "train.en.gz"), ("de", "train.de.gz"), ("fr", "train.de.gz")):
        (own / f"train.{lang}.gz").write_bytes((corpus / name).read_bytes())
        (own / f"dev.{lang}.gz").write_bytes((corpus / name.replace("train", "val")).read_bytes())
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--train", str(own / "train"), "--valid",
           str(own / "dev"), "--preset", "tiny", "--vocab-size", "60", "--device", "cpu", "--out", str(tmp_path / "o"),
           "--quiet", "--max-steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "has files for de, en, fr: name the pair with --src and --tgt" in r.stderr
    r = subprocess.run(cmd + ["--src", "en", "--tgt", "fr", "--save-every", "1", "--average-last", "1",
                              "--valid-every", "0"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "en -> fr" in r.stderr, r.stderr[-2000:]


def test_a_short_run_is_told_from_max_steps_or_the_rate_under_a_time_budget():
    """short_run_ends: --max-steps is known at the start; a --time-budget is projected from the rate since the
    clock (updates and seconds when it was set); twice the warmup is long enough."""
    from argparse import Namespace
    from minitf.recipe import short_run_ends
    steps = Namespace(max_steps=500, time_budget=None)
    assert short_run_ends(steps, 1067, 0, 0.0, None) == (500, "--max-steps 500")
    assert short_run_ends(Namespace(max_steps=2134, time_budget=None), 1067, 0, 0.0, None) is None
    budget = Namespace(max_steps=None, time_budget=300)
    assert short_run_ends(budget, 1067, 50, 20.0, None) is None                    # no rate yet
    assert short_run_ends(budget, 1067, 80, 32.0, (5, 2.0)) == (80 + int(2.5 * 268), "2.5 updates/s for --time-budget 300s")
    assert short_run_ends(Namespace(max_steps=None, time_budget=1800), 1067, 80, 32.0, (5, 2.0)) is None
    both = Namespace(max_steps=300, time_budget=300)
    assert short_run_ends(both, 1067, 80, 32.0, (5, 2.0))[0] == 300                # the earlier end


def test_patience_stops_when_validation_stops_improving_and_the_run_ends_as_usual(corpus, tmp_path):
    """--patience N: after N validations in a row without a better BLEU (here the loss: --valid-bleu-sentences
    0) than the best, the run stops, then averages, chooses and scores its model; --patience without
    validations is refused in one line."""
    out = tmp_path / "run"
    # a learning rate so high that the loss climbs after the first validations: patience 2 ends the run early
    r = run_train(corpus, out, "--max-steps", 200, "--valid-every", 2, "--valid-bleu-sentences", 0, "--patience", 2,
                  "--lr-factor", 60, "--warmup", 1, "--save-every", 2, "--average-last", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    valid = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if "valid_loss" in x]
    losses = [v["valid_loss"] for v in valid]
    best = min(range(len(losses)), key=losses.__getitem__)
    assert res["steps"] < 200 and len(losses) == best + 3 and valid[best]["step"] == res["best_valid"]["step"]
    assert all(x >= losses[best] for x in losses[best + 1:])
    assert f"training stopped (patience: validation loss no better than step {valid[best]['step']}'s for 2 " \
           f"validations) at step {res['steps']}" in r.stderr
    assert "(--patience 2)" in r.stderr and res["bleu"]
    r = run_train(corpus, tmp_path / "x", "--patience", 3, "--valid-every", 0)
    assert r.returncode == 2 and "--patience 3 counts validations, and --valid-every 0 makes none" in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--fp16", "--bf16", "--device", "gpu"], "--fp16 and --bf16 each choose the 16-bit dtype"),
    (["--bf16"], "--bf16 is for --device gpu"),
    (["--bf16", "--device", "gpu", "--dtype", "float64"], "--bf16 computes in 16 bits beside float32 master weights"),
    (["--fp16", "--arch", "rnn"], "mixed precision (--fp16) is for the Transformer"),
    (["--no-tf32"], "--no-tf32 concerns the float32 products of --device gpu"),
    (["--no-tf32", "--device", "gpu", "--bf16"], "--no-tf32 concerns the float32 products of --device gpu"),
    (["--no-tf32", "--device", "gpu", "--dtype", "float64"], "--no-tf32 concerns the float32 products"),
])
def test_the_mixed_precision_flags_refuse_what_they_cannot_run(flags, message, capsys):
    from minitf.train_cli import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--dataset", "multi30k", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


# train_wmt.py's flags that configure the run, not the model or its recipe (config.json records them apart)
RUN_ONLY_FLAGS = {"alpha", "beam", "bf16", "cache_dir", "init_from", "data_dir", "dataset", "decode_batch", "device", "dtype", "fp16",
                  "keep_last", "log_every", "max_len", "max_nonfinite", "max_ratio", "no_tf32", "offline", "out", "patience",
                  "preset", "quiet", "resume", "seed", "src", "subword", "test", "tgt", "time_budget", "tokenizer",
                  "train", "update_freq", "valid", "valid_bleu_sentences", "valid_every", "valid_every_minutes",
                  "vocab_size"}


def test_every_flag_reaches_a_config_field_or_is_a_run_flag():
    """config.FLAG_FIELDS is the one table from flag to field: every train_wmt.py flag is in it or on
    the run-only list (a new model or recipe flag wired to nothing would be parsed and silently
    dropped), each names a field, build_config sets each from its flag, and --help gives each the
    presets' values read from it."""
    from argparse import Namespace
    from minitf.config import FLAG_FIELDS, PRESETS, Config
    from minitf.recipe import build_config
    from minitf.train_cli import build_parser, parse_args
    fields = {f.name for f in dataclasses.fields(Config)}
    assert set(FLAG_FIELDS.values()) <= fields, set(FLAG_FIELDS.values()) - fields
    parser = build_parser()
    flags = {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "version")}
    assert flags - set(FLAG_FIELDS) - RUN_ONLY_FLAGS == set(), "flags wired to nothing: map them or list them as run flags"
    assert not set(FLAG_FIELDS) & RUN_ONLY_FLAGS and RUN_ONLY_FLAGS <= flags
    # each numeric recipe flag, given, reaches its field
    args = parse_args(["--out", "x", "--preset", "base", "--dropout", "0.25", "--warmup", "123", "--heads", "4",
                       "--d-model", "64", "--lr-fade", "0.3", "--average-last", "3", "--max-tokens", "999"])
    cfg = build_config(args, 100)
    assert (cfg.dropout, cfg.warmup, cfg.n_heads, cfg.d_model, cfg.lr_fade, cfg.average_last, cfg.max_tokens) == (
        0.25, 123, 4, 64, 0.3, 3, 999)
    # the recipe of the architecture asked for (--init-from a recurrent model asks for the recurrent preset's)
    small = parse_args(["--out", "x", "--preset", "small"])
    assert build_config(small, 100, arch="rnn").warmup == Config.preset("small", arch="rnn").warmup != \
        build_config(small, 100).warmup
    helps = {a.dest: a.help for a in parser._actions}
    assert f"small {PRESETS['small']['d_model']}, tiny {PRESETS['tiny']['d_model']}" in helps["d_model"]
    assert f"big {PRESETS['big']['dropout']:g}" in helps["dropout"] and "[presets:" in helps["warmup"]
    assert "[presets:" not in helps["max_tokens"]   # a rule, not a preset's number: its help says the rule
    # --attention's default is written by hand (the Transformer refuses the flag): the recurrent presets' values
    from minitf.config import Config
    attention = {name: Config.preset(name, arch="rnn").attention for name in PRESETS}
    assert attention == {"base": "general", "big": "general", "small": "additive", "tiny": "general"}
    assert "additive in the small preset, general in the others" in " ".join(helps["attention"].split())
    assert isinstance(Namespace, type)


def test_the_recipe_settles_a_read_only_copy_of_the_flags():
    """resolve_recipe fills the flags left unset from the preset (here small's) into Settings, a
    read-only copy: the parsed namespace is untouched, and a later assignment is refused."""
    from minitf.recipe import resolve_recipe
    from minitf.train_cli import parse_args
    args = parse_args(["--out", "x", "--preset", "small"])
    before = dict(vars(args))
    cfg = minitf.Config.preset("small", vocab_size=100)
    s = resolve_recipe(args, cfg)
    assert vars(args) == before and args.max_steps is None
    assert (s.alpha, s.save_every, s.average_last, s.keep_last) == (cfg.decode_alpha, 80, cfg.average_last,
                                                                     cfg.average_last + 1)
    with pytest.raises(AttributeError, match="read-only"):
        s.max_steps = 5


def test_init_from_a_minitf_checkpoint_fine_tunes_from_its_weights_and_tokenizer(corpus, tmp_path):
    """--init-from another run's model.npz (or its .safetensors export): that model and tokenizer, the recipe of
    the preset and the flags; a learning rate of ~0 leaves its weights as they were. A flag asking for another
    model is refused, and so is a checkpoint without a tokenizer, each in one line."""
    first = tmp_path / "first"
    r = run_train(corpus, first, "--max-steps", 3, "--valid-every", 0)
    assert r.returncode == 0, r.stderr[-2000:]
    from minitf.checkpoint import export_safetensors, save_checkpoint
    export_safetensors(first / "model.npz", tmp_path / "first.safetensors")
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")

    def fine_tune(init, out, *extra):
        cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir", str(corpus),
               "--preset", "tiny", "--device", "cpu", "--init-from", str(init), "--out", str(out), "--quiet",
               "--valid-every", "0", "--beam", "1", *map(str, extra)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)

    source = load_checkpoint(first / "model.npz")
    for init in (first / "model.npz", tmp_path / "first.safetensors"):
        out = tmp_path / f"ft-{init.suffix[1:]}"
        r = fine_tune(init, out, "--max-steps", 2, "--lr-factor", 1e-12, "--dropout", 0.3)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"init: the weights of {init}" in r.stderr
        tuned = load_checkpoint(out / "checkpoint_0000002.npz")
        assert tuned.config.model_fields() == source.config.model_fields() and tuned.config.dropout == 0.3
        assert tuned.tokenizer == source.tokenizer
        for name, value in source.params.items():
            np.testing.assert_allclose(tuned.params[name], value, atol=1e-6, err_msg=name)
    for flags, says in ((["--d-model", 32], "drop --d-model"), (["--arch", "transformer"], "drop --arch transformer")):
        r = fine_tune(first / "model.npz", tmp_path / "x", *flags)
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # BPE-dropout: the model's tokenizer decides (a unigram one has no merges), not the --subword default
    r = fine_tune(first / "model.npz", tmp_path / "x", "--bpe-dropout-source", 0.1, "--max-steps", 1)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"error: --init-from {first / 'model.npz'} brings a SentencePiece unigram tokenizer, which has no BPE merges "
        f"for BPE-dropout to leave out: drop --bpe-dropout-source, or start from a model whose tokenizer is BPE (one "
        f"trained with --subword bpe)"), r.stderr[-2000:]   # (it had advised --subword bpe, which --init-from refuses)
    # config.json records --init-from absolute, as the data's paths (a resume from another folder names the same file)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir",
                        str(corpus), "--device", "cpu", "--init-from", "first/model.npz", "--out", "rel", "--max-steps",
                        "1", "--valid-every", "0", "--beam", "1"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "rel" / "config.json").read_text())["args"]["init_from"] == str(first / "model.npz")
    r = fine_tune(tmp_path, tmp_path / "x")
    assert r.returncode == 2 and "a folder, but not a Marian model" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # `prepare --init-from` builds the cache the fine-tuning run then opens (encoded with the model's tokenizer)
    env["MINITF_CACHE"] = str(tmp_path / "cache2")
    r = subprocess.run([sys.executable, "-m", "minitf", "prepare", "--dataset", "multi30k", "--data-dir", str(corpus),
                        "--init-from", str(first / "model.npz")], capture_output=True, text=True, env=env, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0 and "cache: building" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--dataset", "multi30k", "--data-dir",
                        str(corpus), "--preset", "tiny", "--device", "cpu", "--init-from", str(first / "model.npz"),
                        "--out", str(tmp_path / "ft-prepared"), "--max-steps", "1", "--valid-every", "0", "--beam", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "cache: building" not in r.stderr and "init: the weights of" in r.stderr, r.stderr[-2000:]
    save_checkpoint(tmp_path / "bare.npz", source.build_model())
    r = fine_tune(tmp_path / "bare.npz", tmp_path / "x")
    assert r.returncode == 2 and "holds no tokenizer" in r.stderr, r.stderr[-2000:]
    assert [line for line in r.stderr.splitlines() if line.startswith("error")] == r.stderr.splitlines()[-1:]


def test_what_a_stopped_run_left_is_set_right_by_the_next_start(corpus, tmp_path):
    """A run killed after its last checkpoint had gone on (logged steps, a better checkpoint_best.npz): --resume drops
    the log's later records and makes checkpoint_best.npz again from the best checkpoint it knows; a run stopped before
    its first checkpoint left a log and a checkpoint_best.npz: a new run in its folder starts them afresh. Each start
    says what it set right."""
    out = tmp_path / "run"
    args = ("--save-every", 3, "--valid-every", 2, "--valid-bleu-sentences", 0, "--keep-last", 10, "--beam", 1)
    assert run_train(corpus, out, "--max-steps", 6, *args).returncode == 0
    for name in ("checkpoint_0000006.npz", "model.npz", "averaged.npz", "results.json"):   # killed after step 6
        (out / name).unlink()
    from minitf.checkpoint import read_train_state
    best = read_train_state(out / "checkpoint_best.npz")["step"]
    assert best in (4, 6)                                # a validation after step 3, where the run resumes
    r = run_train(corpus, out, "--max-steps", 4, "--resume", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    # updates 4-6, the validations at 4 and 6, the end's two scores
    assert "train_log.jsonl: dropped 7 records after step 3, where this run resumes" in r.stderr, r.stderr[-3000:]
    # the best known at step 3 is step 2's, whose checkpoint is not kept: removed, and written again at step 4
    assert f"note: removed {out / 'checkpoint_best.npz'} of step {best}, after step 3 where this run resumes" in r.stderr
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in recs if "loss" in r and "eval" not in r and "valid_loss" not in r]
    assert trained == [1, 2, 3, 4]                                          # each update once, in order
    assert [r["step"] for r in recs if "valid_loss" in r] == [2, 4]
    assert read_train_state(out / "checkpoint_best.npz")["step"] == 4
    # stopped before its first checkpoint: a log and a best checkpoint of another model are left
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "train_log.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    (fresh / "checkpoint_best.npz").write_bytes((out / "checkpoint_best.npz").read_bytes())
    r = run_train(corpus, fresh, "--max-steps", 1, "--valid-every", 0, "--beam", 1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"note: removed train_log.jsonl, checkpoint_best.npz of a run in {fresh} stopped before its first " \
           f"checkpoint: this run starts afresh" in r.stderr
    assert [json.loads(line)["step"] for line in (fresh / "train_log.jsonl").read_text().splitlines()
            if "loss" in json.loads(line) and "eval" not in json.loads(line)] == [1]


def test_an_interrupt_keeps_a_checkpoint_on_the_spacing_and_off_spacing_ones_give_way_first(corpus, tmp_path):
    """Stops at 7 and 8 leave checkpoints off the --save-every 3 spacing; they are removed before the spaced ones the
    end averages (keep-last 3: the newest and the last two on the spacing), so the end at 9 averages step 6's with its
    own (counted among the last three, the stops' had pushed step 6's out: an average of 1)."""
    out = tmp_path / "run"
    args = ("--save-every", 3, "--valid-every", 0, "--average-last", 3, "--keep-last", 3, "--beam", 1)
    for steps in (6, 7, 8, 9):
        r = run_train(corpus, out, "--max-steps", steps, *(["--resume"] if steps > 6 else ["--dropout", 0.2]), *args)
        assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint_0*.npz")) == [
        "checkpoint_0000003.npz", "checkpoint_0000006.npz", "checkpoint_0000009.npz"]
    assert json.loads((out / "results.json").read_text())["averaged_checkpoints"] == [
        "checkpoint_0000006.npz", "checkpoint_0000009.npz"]
    config = json.loads((out / "config.json").read_text())      # the first start's flags, kept through the resumes
    assert config["args"]["dropout"] == 0.2 and config["set_by_flags"]["dropout"] == "dropout"
    assert config["model"]["dropout"] == 0.2 and config["args"]["max_steps"] == 9


def test_ctrl_c_in_the_final_validation_saves_the_last_updates(corpus, tmp_path, monkeypatch, capsys):
    # after the last update, in the end's validation: the updates since the last checkpoint are saved (it had said
    # "interrupted before training began" and lost them); --resume validates and ends the run
    import minitf.train
    real, calls = minitf.train.validate, []

    def interrupted_at_the_end(run):
        calls.append(run.state["step"])
        if run.state["step"] == 5:
            raise KeyboardInterrupt
        return real(run)
    monkeypatch.setattr(minitf.train, "validate", interrupted_at_the_end)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    cli = train_wmt_module()
    out = tmp_path / "run"
    flags = ["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size", "60", "--device",
             "cpu", "--out", str(out), "--quiet", "--max-steps", "5", "--save-every", "3", "--valid-every", "3",
             "--beam", "1"]
    code = cli.main(flags)
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err, err[-2000:]
    assert "interrupted (SIGINT) in the final validation at step 5: saved" in err and "checkpoint_0000005.npz" in err
    monkeypatch.setattr(minitf.train, "validate", real)
    assert cli.main(flags + ["--resume"]) == 0
    assert json.loads((out / "results.json").read_text())["steps"] == 5


def test_a_later_best_checkpoint_is_made_again_from_the_best_the_resumed_run_knows(tmp_path, capsys):
    from minitf.checkpoint import Checkpoint, load_checkpoint, read_train_state, save_checkpoint
    from minitf.runfolder import settle_leftovers
    cfg = minitf.Config(vocab_size=17, d_model=16, n_heads=2, d_ff=24, n_layers=1)
    four, six = minitf.Transformer(cfg, seed=4), minitf.Transformer(cfg, seed=6)
    best4 = {"step": 4, "best_valid": {"step": 4, "metric": "valid_loss", "value": -3.0}}
    save_checkpoint(tmp_path / "checkpoint_0000004.npz", four, minitf.Adam(four), tokenizer=b"tok", train_state=best4)
    save_checkpoint(tmp_path / "checkpoint_best.npz", six, tokenizer=b"tok", train_state={"step": 6, "best": True})
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 4, "loss": 3.0}, {"step": 5, "loss": 2.9}, {"step": 6, "valid_loss": 2.5}, "not a record",
        {"step": 4, "eval": "valid", "bleu": 1.0}, {"step": 4, "loss": 2.8, "tail": True})))
    settle_leftovers(str(tmp_path), Checkpoint(str(tmp_path / "checkpoint_0000004.npz"), cfg, {}, None, b"tok", best4))
    err = capsys.readouterr().err
    assert "checkpoint_best.npz was of step 6, after step 4 where this run resumes: made again from " \
           "checkpoint_0000004.npz, the best validation up to there" in err
    assert "dropped 2 records after step 4" in err
    # the end's records of the step it resumes from (a run that had ended there, extended): said as what they are
    assert "train_log.jsonl: dropped the records of the run's end at step 4 (1 score and its last training record): " \
           "it ended there, and this start goes on from there" in err
    made = load_checkpoint(tmp_path / "checkpoint_best.npz")
    assert read_train_state(tmp_path / "checkpoint_best.npz")["best"] is True and made.train_state["step"] == 4
    for name, a in four.state_dict().items():
        np.testing.assert_array_equal(made.params[name], a)
    assert [line for line in (tmp_path / "train_log.jsonl").read_text().splitlines()] == [
        json.dumps({"step": 4, "loss": 3.0}), json.dumps("not a record")]


class TwoRanks(distributed.World):
    """What train() sees of a job of two ranks, with MPI's Abort recorded instead of made."""
    size, aborted = 2, None

    def abort(self, code=1):
        TwoRanks.aborted = code
        raise SystemExit(code)


def test_under_mpi_ctrl_c_before_training_ends_the_whole_job(monkeypatch, capsys):
    # Ctrl-C while rank 0 prepared the data had returned on that rank and left the others waiting in a barrier
    import minitf.train
    monkeypatch.setattr(minitf.train.distributed, "init", TwoRanks)

    def interrupted(args, world):
        raise KeyboardInterrupt
    monkeypatch.setattr(minitf.train, "_train", interrupted)
    with pytest.raises(SystemExit):
        minitf.train.train(dataclasses.make_dataclass("A", [("resume", bool)])(False))
    assert TwoRanks.aborted == 130
    assert "rank 0: interrupted (SIGINT) before training began" in capsys.readouterr().err


def test_under_mpi_a_signal_in_the_final_validation_is_agreed_before_anyone_stops(monkeypatch, capsys):
    # one rank raising alone in the validation's collectives had left the other waiting there for good: the signal is
    # now flagged, as in the update loop, agreed after the validation, and every rank saves (rank 0) and stops together
    import signal as signals
    import minitf.train
    from minitf.errors import Interrupted
    saved = []

    class Run:
        world, lead, state = TwoRanks(), True, {"step": 7}
        console = type("C", (), {"line_from_a_signal_handler": staticmethod(lambda text: None)})()
        log = type("L", (), {"close": staticmethod(lambda: None)})()

        def save(self, on_grid):
            saved.append(on_grid)
            return "OUT/checkpoint_0000007.npz"
    monkeypatch.setattr(minitf.train, "validate", lambda run: os.kill(os.getpid(), signals.SIGTERM))
    with pytest.raises(Interrupted) as e:
        minitf.train._final_validation(Run())
    assert e.value.signame == "SIGTERM" and saved == [False]
    assert "interrupted (SIGTERM) in the final validation at step 7: saved OUT/checkpoint_0000007.npz" in \
        capsys.readouterr().err
    monkeypatch.setattr(minitf.train, "validate", lambda run: None)
    minitf.train._final_validation(Run())          # no signal: nothing saved, nothing raised
    assert saved == [False]


@pytest.mark.parametrize("ranks", ["one process", "two ranks"])
def test_a_signal_while_the_end_saves_its_checkpoint_waits_for_the_file(tmp_path, monkeypatch, capsys, ranks):
    # SIGTERM while the end of training wrote its last checkpoint had removed the half-written file and said
    # "interrupted before training began ... run the command again", which the run's checkpoints then refused
    import signal as signals
    import minitf.train
    from minitf.errors import Interrupted
    from minitf.runfolder import checkpoint_paths
    out, written = tmp_path / "run", []
    out.mkdir()

    class Run:
        args = types.SimpleNamespace(out=str(out), valid_every=0, valid_every_minutes=0, time_budget=0, patience=0)
        world, lead, state, validation = (TwoRanks() if ranks == "two ranks" else distributed.World()), True, \
            {"step": 20, "train_wall_s": 7.0}, None
        window = minitf.train.new_window()   # no update since the last log record
        log = type("L", (), {"close": staticmethod(lambda: None)})()
        elapsed = staticmethod(lambda: 8.0)

        def save(self, on_grid):
            os.kill(os.getpid(), signals.SIGTERM)    # lands mid-write
            path = out / "checkpoint_0000020.npz"
            path.write_bytes(b"whole")
            written.append(on_grid)
            return str(path)
    monkeypatch.setattr(minitf.train, "finish", lambda run, stop: pytest.fail("scored after the signal"))
    TwoRanks.aborted = None
    for stop in ("max_steps", "SIGINT"):    # the end of a run, and the save of a first signal's stop
        with pytest.raises(SystemExit if ranks == "two ranks" and stop == "max_steps" else Interrupted):
            minitf.train.end(Run(), stop)
        assert [os.path.basename(p) for p in checkpoint_paths(out)] == ["checkpoint_0000020.npz"]
        (out / "checkpoint_0000020.npz").unlink()
    assert written == [False, False]
    assert TwoRanks.aborted == (143 if ranks == "two ranks" else None)
    err = capsys.readouterr().err
    assert f"interrupted (SIGTERM) at the end of training, step 20: its checkpoint is saved ({out}/checkpoint_0000020" \
           f".npz); `--out {out} --resume` scores the run's end" in err
    assert "interrupted (SIGINT) at step 20: saved" in err and "before training began" not in err


def test_a_signal_in_an_update_on_the_save_spacing_keeps_that_checkpoint_and_saves_no_other(tmp_path, capsys):
    # the update on the --save-every spacing saved its checkpoint, then the signal's stop wrote the same step again
    import minitf.train
    from minitf.errors import Interrupted
    out, written = tmp_path / "run", []
    out.mkdir()

    class Run:
        args = types.SimpleNamespace(out=str(out))
        world, lead, state = distributed.World(), True, {"step": 20}
        log = type("L", (), {"close": staticmethod(lambda: None)})()

        def save(self, on_grid):
            written.append(self.state["step"])
            path = out / f"checkpoint_{self.state['step']:07d}.npz"
            path.write_bytes(b"saved")
            return str(path)
    (out / "checkpoint_0000020.npz").write_bytes(b"on the spacing")
    with pytest.raises(Interrupted):
        minitf.train.end(Run(), "SIGTERM")
    assert written == [] and (out / "checkpoint_0000020.npz").read_bytes() == b"on the spacing"
    assert f"interrupted (SIGTERM) at step 20: saved {out}/checkpoint_0000020.npz; continue with --resume" in \
        capsys.readouterr().err
    run = Run()
    run.state = {"step": 21}    # an update since: its checkpoint is saved
    with pytest.raises(Interrupted):
        minitf.train.end(run, "SIGINT")
    assert written == [21] and "interrupted (SIGINT) at step 21: saved " in capsys.readouterr().err


def test_a_signal_to_a_rank_waiting_for_rank_0_to_score_is_said(monkeypatch, capsys):
    # the rank that waits for rank 0's scoring: a signal rank 0 beat to the end had been dropped without a word
    import minitf.train

    class RankOne(TwoRanks):
        rank, outcome = 1, None

        def wait_for_lead(self, grace=5.0):
            return self.outcome

    class Run:
        args, state, validation, lead, world = types.SimpleNamespace(), {"step": 9}, None, False, RankOne()
        window = minitf.train.new_window()
    Run.world.outcome, TwoRanks.aborted = (["SIGTERM"], True), None
    assert minitf.train.end(Run(), "max_steps") is None and TwoRanks.aborted is None
    assert capsys.readouterr().err == "rank 1: SIGTERM came as rank 0 finished the run, which is complete\n"
    Run.world.outcome = (["SIGTERM"], False)   # rank 0 did not finish within the grace
    with pytest.raises(SystemExit):
        minitf.train.end(Run(), "max_steps")
    assert TwoRanks.aborted == 143 and "rank 1: interrupted (SIGTERM) while rank 0 scored" in capsys.readouterr().err
    Run.world.outcome, TwoRanks.aborted = ([], True), None
    assert minitf.train.end(Run(), "max_steps") is None and TwoRanks.aborted is None and not capsys.readouterr().err


def test_under_mpi_an_error_every_rank_raises_alike_is_said_once(monkeypatch, capsys):
    # the ranks disagree, a resume's batches, a refused --resume: every rank raises the same error, which 64 ranks had
    # printed 64 times: a rank other than 0 waits 2 s, in which rank 0's MPI Abort ends the job, and says its error
    # only if it is still there (an error of its own: a file only that rank lacks)
    import minitf.train
    from minitf.errors import ConfigError, DataError

    class RankOne(TwoRanks):
        rank = 1
    waits = []

    def job_ended_by_rank_0(s):   # the sleep MPI Abort from rank 0 cuts short
        waits.append(s)
        raise SystemExit(2)
    for world, error, sleep, said in (
            (RankOne, ConfigError("the ranks disagree"), job_ended_by_rank_0, ""),
            (TwoRanks, ConfigError("the ranks disagree"), job_ended_by_rank_0, "rank 0: error: the ranks disagree\n"),
            (RankOne, DataError("rank 1 lacks a file"), waits.append, "rank 1: error: rank 1 lacks a file\n")):
        monkeypatch.setattr(minitf.train.time, "sleep", sleep)
        monkeypatch.setattr(minitf.train.distributed, "init", world)
        monkeypatch.setattr(minitf.train, "_train", lambda args, w, e=error: (_ for _ in ()).throw(e))
        TwoRanks.aborted = None
        with pytest.raises(SystemExit):
            minitf.train.train(None)
        assert capsys.readouterr().err == said
        assert TwoRanks.aborted == (2 if said else None)
    assert waits == [2.0, 2.0]   # rank 0 said its error at once


def test_under_mpi_out_of_memory_is_one_line(monkeypatch, capsys):
    # a MemoryError (CuPy's OutOfMemoryError is one) had printed 'unexpected error' and a traceback from every rank
    import minitf.train
    monkeypatch.setattr(minitf.train.distributed, "init", TwoRanks)
    monkeypatch.setattr(minitf.train, "_train", lambda args, w: (_ for _ in ()).throw(MemoryError("Unable to allocate "
                                                                                                  "8.00 GiB")))
    TwoRanks.aborted = None
    with pytest.raises(SystemExit):
        minitf.train.train(None)
    assert TwoRanks.aborted == 2
    assert capsys.readouterr().err == ("rank 0: error: out of memory (Unable to allocate 8.00 GiB); lower --max-tokens, "
                                       "the model size (--preset, --d-model, ...) or --decode-batch\n")


def test_sigterm_before_training_and_flag_errors_under_a_launcher(tmp_path, monkeypatch, capsys):
    """SIGTERM while the data is prepared is Ctrl-C's case with exit 143 (it had killed the process: exit 15, a
    launcher's banner); a flag error is printed by rank 0 alone (every rank of a job had printed it)."""
    import signal
    from minitf import train_cli
    from minitf import train as train_module

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(train_module, "train", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert train_cli.main(["--dataset", "multi30k", "--out", str(tmp_path / "run")]) == 143
    assert "interrupted (SIGTERM) before training began" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("PMI_RANK", rank)
        with pytest.raises(SystemExit):
            train_cli.parse_args(["--bogus"])
        assert ("unrecognized arguments: --bogus" in capsys.readouterr().err) == said


def test_a_resume_whose_time_budget_is_spent_says_so(corpus, tmp_path):
    # --time-budget counts the run's training over all its starts: a resume of a run its budget ended trained nothing
    # and said only "training stopped (time_budget)". A checkpoint every step: the budget runs out during a save, so
    # the last checkpoint, saved on the spacing, had recorded less time than the budget, and the resume trained on
    out = tmp_path / "run"
    assert run_train(corpus, out, "--time-budget", 1, "--valid-every", 0, "--save-every", 1).returncode == 0
    env = dict(os.environ, MINITF_CACHE=str(tmp_path / "cache"), PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_wmt.py"), "--out", str(out), "--resume"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "note: --time-budget 1 counts the run's training over all its starts" in r.stderr, \
        r.stderr[-2000:]


def test_a_checkpoint_the_file_system_refuses_stops_the_run_saying_where_resume_goes_on(corpus, tmp_path, monkeypatch,
                                                                                        capsys):
    # the file-size limit (`ulimit -f`) while a checkpoint was saved had been a traceback; it is one line naming the
    # checkpoint and the one --resume continues from, and the run goes on from there
    import errno
    from minitf import checkpoint, fileio
    real = checkpoint.atomic_write

    def limited(path, *args, **kwargs):
        if os.path.basename(path) == "checkpoint_0000002.npz":
            raise fileio.WriteFailed(path, OSError(errno.EFBIG, "File too large"))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "atomic_write", limited)
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    flags = ["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size", "60", "--device",
             "cpu", "--out", str(out), "--quiet", "--max-steps", "3", "--save-every", "1", "--valid-every", "0", "--log-every",
             "1"]
    assert train_wmt_module().main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {out / 'checkpoint_0000002.npz'}: cannot write it (File too large); the run stopped: "
                       f"--resume continues from {out / 'checkpoint_0000001.npz'}"), err[-3:]
    monkeypatch.setattr(checkpoint, "atomic_write", real)
    assert train_wmt_module().main(flags + ["--resume"]) == 0
    assert sorted(losses(out)) == [1, 2, 3]


def test_a_damaged_checkpoint_is_averaged_without_and_resume_names_the_one_before(corpus, tmp_path):
    # a damaged checkpoint in the averaging window had stopped the run's end (and every --resume after it) at the
    # average; a damaged last checkpoint refused --resume without saying that the one before it is there to go on from
    out = tmp_path / "run"
    flags = ("--save-every", 1, "--valid-every", 0, "--average-last", 3, "--keep-last", 12)
    assert run_train(corpus, out, "--max-steps", 8, *flags).returncode == 0
    (out / "checkpoint_0000007.npz").write_bytes(b"\x00" * 1000)
    r = run_train(corpus, out, "--max-steps", 9, "--resume", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"note: {out / 'checkpoint_0000007.npz'} is not a minitf checkpoint" in r.stderr
    assert json.loads((out / "results.json").read_text())["averaged_checkpoints"] == [   # an older one in its place
        "checkpoint_0000006.npz", "checkpoint_0000008.npz", "checkpoint_0000009.npz"]
    (out / "checkpoint_0000010.npz").write_bytes(b"\x00" * 1000)   # the last checkpoint damaged
    r = run_train(corpus, out, "--max-steps", 12, "--resume", *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: --resume: {out / 'checkpoint_0000010.npz'} is not a ")
    assert r.stderr.strip().endswith(f"; move it out of {out}, and --resume continues from "
                                     f"{out / 'checkpoint_0000009.npz'}, the checkpoint before it")


def _tiny_flags(corpus, out, *extra):
    return ["--dataset", "multi30k", "--data-dir", str(corpus), "--preset", "tiny", "--vocab-size", "60", "--device",
            "cpu", "--out", str(out), "--quiet", "--log-every", "1", "--beam", "1", *map(str, extra)]


def test_a_signal_in_the_last_update_or_as_the_loop_ends_saves_and_stops(corpus, tmp_path, monkeypatch, capsys):
    # SIGTERM in the update that reached --max-steps had been announced ("stopping after the update in progress, then
    # saving"), then ignored: the run went on through its end and exited 0. One as the loop had ended (while the
    # last training record was written) had been taken for a second Ctrl-C: nothing saved, "again", SIGINT's 130.
    # Both now save the last update and stop with the signal's status; --resume makes the end, as a straight run's
    import signal
    from minitf import train
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    straight = tmp_path / "straight"
    flags = ("--max-steps", 4, "--save-every", 10, "--valid-every", 0, "--log-every", 3)
    assert train_wmt_module().main(_tiny_flags(corpus, straight, *flags)) == 0
    real_step, real_record = train.take_step, train.log_record
    real_reduce = distributed.World.allreduce_numbers
    for name, sig, code in (("last_update", signal.SIGTERM, 143), ("tail_record", signal.SIGINT, 130),
                            ("deciding", signal.SIGTERM, 143)):
        out = tmp_path / name
        sent = []

        def reduce(world, values):   # while the ranks agree on the stop, after the signals were read
            if name == "deciding" and not sent and train_state[0]["step"] == 4:
                sent.append(os.kill(os.getpid(), sig))
            return real_reduce(world, values)
        train_state = [{"step": 0}]
        real_set_up = train.set_up

        def set_up(args, world):
            run = real_set_up(args, world)
            train_state[0] = run.state
            return run
        monkeypatch.setattr(distributed.World, "allreduce_numbers", reduce)
        monkeypatch.setattr(train, "set_up", set_up)

        def step(run, update):
            if name == "last_update" and run.state["step"] == 3:
                os.kill(os.getpid(), sig)
            return real_step(run, update)

        def record(run, tail=False):
            if name == "tail_record" and tail:
                os.kill(os.getpid(), sig)
            return real_record(run, tail)
        monkeypatch.setattr(train, "take_step", step)
        monkeypatch.setattr(train, "log_record", record)
        capsys.readouterr()
        assert train_wmt_module().main(_tiny_flags(corpus, out, *flags)) == code, name
        err = capsys.readouterr().err
        assert f"interrupted ({signal.Signals(sig).name}) at step 4: saved {out / 'checkpoint_0000004.npz'}" in err, err
        assert not (out / "results.json").exists()
        monkeypatch.setattr(train, "take_step", real_step)
        monkeypatch.setattr(train, "log_record", real_record)
        monkeypatch.setattr(distributed.World, "allreduce_numbers", real_reduce)
        monkeypatch.setattr(train, "set_up", real_set_up)
        assert train_wmt_module().main(_tiny_flags(corpus, out, *flags, "--resume")) == 0
        assert losses(out) == losses(straight)
        assert json.loads((out / "results.json").read_text())["bleu"] == \
            json.loads((straight / "results.json").read_text())["bleu"]


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_it_again(corpus, tmp_path, monkeypatch, capsys):
    # a kill in a run's first minutes (before its first --save-every) had left a folder that --resume refused for good,
    # so a re-launch that always passes --resume never ran again; it now starts the run from the beginning
    from minitf import train
    monkeypatch.setenv("MINITF_CACHE", str(tmp_path / "cache"))
    out, straight = tmp_path / "run", tmp_path / "straight"
    # the model's and the recipe's flags too (no checkpoint brings them): the defaults' model had been trained
    flags = ("--max-steps", 3, "--save-every", 10, "--valid-every", 0, "--dropout", 0.3, "--warmup", 5, "--d-ff", 40)
    assert train_wmt_module().main(_tiny_flags(corpus, straight, *flags)) == 0
    real = train.take_step

    def killed(run, update):
        if run.state["step"] == 1:
            raise SystemExit(137)   # (as kill -9 leaves it: config.json and the log of one update, no checkpoint)
        return real(run, update)
    monkeypatch.setattr(train, "take_step", killed)
    with pytest.raises(SystemExit):
        train_wmt_module().main(_tiny_flags(corpus, out, *flags))
    assert (out / "config.json").is_file() and not list(out.glob("checkpoint_*.npz"))
    again = train_wmt_module().parse_args(["--out", str(out), "--resume", "--seed", "7", "--preset", "small"])
    assert (again.seed, again.preset, again.dropout) == (7, "small", 0.3)   # given: theirs; the rest recorded
    monkeypatch.setattr(train, "take_step", real)
    capsys.readouterr()
    assert train_wmt_module().main(["--out", str(out), "--resume", "--quiet"]) == 0
    assert f"note: --resume: {out} holds no checkpoint yet (the run stopped before its first): it starts from the " \
           f"beginning, with its recorded flags" in capsys.readouterr().err
    assert losses(out) == losses(straight) and len(losses(out)) == 3
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["dropout"], model["warmup"], model["d_ff"]) == (0.3, 5, 40)
    with pytest.raises(SystemExit):   # a folder that holds no run at all is still refused (a typo in --out)
        train_wmt_module().parse_args(["--out", str(tmp_path / "typo"), "--resume"])
