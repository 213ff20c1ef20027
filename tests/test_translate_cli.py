"""`python -m minitf translate|evaluate` end to end on a tiny model and files made here."""
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tr")
    _, lines = make_tiny_checkpoint(d)
    (d / "src.txt").write_text("\n".join(lines[:7]) + "\n")
    (d / "ref.txt").write_text("\n".join(lines[7:14]) + "\n")
    (d / "short.txt").write_text("\n".join(lines[:3]) + "\n")
    return d


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minitf", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_translate_file_and_stdin(setup):
    d = setup
    out = run("translate", "--checkpoint", d / "model.npz", "--input", d / "src.txt", "--beam", 2, "--max-len-b", 3)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 7
    out2 = run("translate", "--checkpoint", d / "model.npz", "--beam", 2, "--max-len-b", 3, "--quiet",
               "--output", d / "hyp.txt", stdin=(d / "src.txt").read_text())
    assert out2.returncode == 0, out2.stderr
    assert (d / "hyp.txt").read_text() == out.stdout


def test_evaluate_prints_bleu_chrf_and_signatures(setup):
    d = setup
    out = run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref", d / "ref.txt",
              "--beam", 2, "--max-len-b", 3, "--json", "--quiet")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert 0 <= res["bleu"] <= 100 and 0 <= res["chrf"] <= 100 and res["n"] == 7
    assert res["bleu_signature"].startswith("nrefs:1|") and res["chrf_signature"].startswith("nrefs:1|")
    assert res["bleu_paper"] is None and "--lang" in res["bleu_paper_method"]   # the tiny checkpoint names no language
    assert res["alpha"] == 0.6                                # the checkpoint's preset's decode_alpha (tiny: the paper's)
    again = run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref", d / "ref.txt",
                "--beam", 2, "--max-len-b", 3, "--json", "--quiet", "--alpha", "1.5")
    assert json.loads(again.stdout)["alpha"] == 1.5
    text = run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref", d / "ref.txt",
               "--beam", 1, "--max-len-b", 3, "--quiet", "--lang", "de")
    assert text.returncode == 0 and "BLEU" in text.stdout and "chrF" in text.stdout
    assert "paper BLEU" in text.stdout and "compound splitting" in text.stdout


def test_user_errors_are_one_line(setup):
    d = setup
    out = run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref", d / "short.txt")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "short.txt" in out.stderr
    one = d / "one_line.txt"
    one.write_text("a cat\n")
    out = run("evaluate", "--checkpoint", d / "model.npz", "--src", one, "--ref", d / "src.txt")
    assert out.returncode == 2 and f"--src {one} has 1 line but --ref" in out.stderr, out.stderr
    out = run("translate", "--checkpoint", d / "missing.npz", "--input", d / "src.txt")
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr
    out = run("translate", "--checkpoint", d / "model.npz", "--input", d / "nope.txt")
    assert out.returncode == 2 and "nope.txt" in out.stderr and "Traceback" not in out.stderr


def test_translate_on_a_terminal_answers_each_line_as_it_is_entered(setup):
    # a pseudo-terminal as stdin: the translation of the first line comes back before the
    # input ends (piped input, above, is read whole and decoded in batches)
    import os
    import pty
    import select
    import time
    d = setup
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(d / "model.npz"),
                          "--beam", "2", "--max-len-b", "3"], stdin=follower, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.close(follower)
    try:
        line = (d / "src.txt").read_text().splitlines()[0]
        os.write(leader, b"caf\xe9\n")             # Latin-1, not UTF-8: said, and the next line translated
        os.write(leader, (line + "\n").encode())
        deadline = time.time() + 120
        ready = []
        while not ready and time.time() < deadline and p.poll() is None:
            ready, _, _ = select.select([p.stdout], [], [], 1.0)
        assert ready, "no translation before the end of input"
        first = p.stdout.readline()
        assert p.poll() is None                    # still waiting for the next line
        os.write(leader, b"\x04")                  # Ctrl-D
        rest, err = p.communicate(timeout=120)
    finally:
        os.close(leader)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert first.endswith("\n") and rest == ""
    assert "error: that line is not UTF-8 (bytes 0xe9)" in err and "Traceback" not in err
    want = run("translate", "--checkpoint", d / "model.npz", "--beam", 2, "--max-len-b", 3, "--quiet", stdin=line + "\n")
    assert first == want.stdout


def test_standard_input_is_read_as_a_file_is(setup):
    # the same UTF-8 check as a file's, and gzip recognised by its first bytes
    import gzip
    d = setup
    args = [sys.executable, "-m", "minitf", "translate", "--checkpoint", str(d / "model.npz"), "--beam", "2",
            "--max-len-b", "3", "--quiet"]
    want = run("translate", "--checkpoint", d / "model.npz", "--input", d / "src.txt", "--beam", 2, "--max-len-b", 3)
    packed = gzip.compress((d / "src.txt").read_bytes())
    got = subprocess.run(args, input=packed, capture_output=True, timeout=300)
    assert got.returncode == 0 and got.stdout.decode() == want.stdout, got.stderr
    bad = subprocess.run(args, input=b"a cat\ncaf\xe9\n", capture_output=True, timeout=300)
    err = bad.stderr.decode()
    assert bad.returncode == 2 and err == ("error: standard input:2: invalid UTF-8 (bytes 0xe9); convert the file to "
                                           "UTF-8 (e.g. iconv) or fix that line\n"), err
    cut = subprocess.run(args, input=packed[:len(packed) // 2], capture_output=True, timeout=300)
    err = cut.stderr.decode()
    assert cut.returncode == 2 and err.startswith("error: standard input: cannot read") and err.count("\n") == 1, err


def test_bad_files_and_folders_are_one_line(setup, tmp_path):
    d = setup
    (tmp_path / "empty.txt").write_text("")
    cases = [
        (["translate", "--checkpoint", d / "model.npz", "--input", d / "src.txt", "--output", tmp_path / "no" / "f.txt"],
         "the folder"),
        (["translate", "--checkpoint", d / "model.npz", "--input", d / "src.txt", "--output", tmp_path], "is a folder"),
        (["translate", "--checkpoint", d / "model.npz", "--input", tmp_path], "is a folder, not a text file"),
        (["evaluate", "--checkpoint", d / "model.npz", "--src", tmp_path / "empty.txt", "--ref", tmp_path / "empty.txt"],
         "are empty"),
        (["translate", "--checkpoint", d / "src.txt", "--input", d / "src.txt"], "is not a minitf checkpoint"),
    ]
    for args, what in cases:
        out = run(*args, "--quiet")
        assert out.returncode == 2 and what in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr)
        assert "--data-dir" not in out.stderr and "unsafely" not in out.stderr
    assert not (tmp_path / "no").exists()                      # no folder made for the output


def test_out_of_memory_is_one_line(setup, monkeypatch, capsys):
    from minitf import cli, translate

    def huge(*args, **kwargs):
        raise MemoryError("Unable to allocate 29.8 GiB for an array with shape (100000, 80000)")
    monkeypatch.setattr(translate, "translate_lines", huge)
    d = setup
    code = cli.main(["translate", "--checkpoint", str(d / "model.npz"), "--input", str(d / "src.txt"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "out of memory" in err and "--beam" in err and "29.8 GiB" in err


@pytest.fixture(scope="module")
def alpha2(tmp_path_factory):
    """A tiny checkpoint whose preset's length penalty is 2.0 (as small's), and lines to translate."""
    import minitf
    from minitf.checkpoint import save_checkpoint
    d = tmp_path_factory.mktemp("alpha2")
    path, lines = make_tiny_checkpoint(d)
    ckpt = minitf.checkpoint.load_checkpoint(path)
    cfg = minitf.Config.from_dict({**ckpt.config.to_dict(), "decode_alpha": 2.0})
    model = minitf.Transformer(cfg, seed=3)
    save_checkpoint(d / "alpha2.npz", model, tokenizer=ckpt.tokenizer, train_state={"languages": ["en", "de"]})
    return d / "alpha2.npz", lines[:12]


def test_the_library_translates_in_one_call_as_the_cli_does(alpha2):
    import minitf
    path, lines = alpha2
    assert "load" in minitf.__all__ and "Translator" in minitf.__all__
    translator = minitf.load(path)
    assert translator.alpha == 2.0
    ours = translator.translate(lines, max_len_b=8)
    cli = run("translate", "--checkpoint", path, "--max-len-b", 8, stdin="".join(line + "\n" for line in lines))
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == ours
    assert translator.translate(lines, max_len_b=8, alpha=0.6) != ours     # the checkpoint's alpha matters here
    assert translator.translate(lines[0], max_len_b=8) == ours[0]          # one string in, one out
    best = translator.nbest(lines[:2], n=2, max_len_b=8)
    one = translator.nbest(lines[1], n=2, max_len_b=8)                    # one string: its list, not each character's
    # the same hypotheses; their float32 scores as a batch of one or of two may differ in the last bits (the BLAS's
    # sums are taken in another order on some CPUs)
    assert [h.text for h in one] == [h.text for h in best[1]]
    assert [h.score for h in one] == pytest.approx([h.score for h in best[1]], rel=1e-5)
    assert [h[0].text for h in best] == ours[:2]
    heard = {}   # done(i, result): each line as it is translated, with what the list holds for it
    assert translator.translate(lines + [""], max_len_b=8, done=heard.__setitem__) == ours + [""]
    assert heard == dict(enumerate(ours + [""]))
    heard.clear()
    assert translator.nbest(lines[:2], n=2, max_len_b=8, done=heard.__setitem__) == [heard[0], heard[1]]


def test_the_library_refuses_what_the_flags_refuse_naming_the_setting(alpha2):
    import minitf
    from minitf.translate import translate_ids
    path, lines = alpha2
    t = minitf.load(path)
    for kw, error, says in ((dict(beam=0), ValueError, "beam=0: expected 1 to 1024"),
                            (dict(beam=2.5), TypeError, "beam=2.5: expected a whole number"),
                            (dict(batch_size=0), ValueError, "batch_size=0: expected 1 or more"),
                            (dict(max_len_b=-1), ValueError, "max_len_b=-1: expected 0 to 10000"),
                            (dict(max_len_b=10 ** 19), ValueError, "max_len_b=10000000000000000000: expected 0 to 10000"),
                            (dict(alpha=-0.5), ValueError, "alpha=-0.5: expected 0 to 10 (0: no length penalty)"),
                            (dict(alpha=float("inf")), ValueError, "alpha=inf: expected 0 to 10"),
                            (dict(alpha=1000), ValueError, "alpha=1000: expected 0 to 10"),
                            (dict(alpha="2"), TypeError, "alpha='2': expected a number"),
                            (dict(stop="fairsec"), ValueError, "stop='fairsec': choose one of fairseq, bound, ctranslate2")):
        with pytest.raises(error) as e:
            t.translate(lines[:2], **kw)
        assert says in str(e.value), str(e.value)
        with pytest.raises(error):
            t.nbest(lines[:2], n=1, **kw)
    with pytest.raises(TypeError, match="line 2 of 3 is NoneType, not a string"):
        t.translate([lines[0], None, lines[1]])
    with pytest.raises(TypeError, match="expected a string or a list of strings as the lines, got NoneType"):
        t.translate(None)
    with pytest.raises(TypeError, match="expected a string or a list of strings as the translations, got int"):
        t.score(lines[:1], 7)
    undecodable = b"caf\xe9".decode("utf-8", errors="surrogateescape")      # what SentencePiece cannot take
    for call in (lambda: t.translate([lines[0], undecodable]), lambda: t.nbest([undecodable], n=1),
                 lambda: t.score([lines[0]], [undecodable])):
        with pytest.raises(ValueError, match=r"2 of 2 holds U\+DCE9 at character 4, a lone surrogate|"
                                             r"1 of 1 holds U\+DCE9 at character 4, a lone surrogate"):
            call()
    with pytest.raises(ValueError, match="beam_size=0"):
        translate_ids(t.model, [[5, 3]], beam_size=0)
    with pytest.raises(ValueError, match="nbest=3: expected 1 to 2"):
        translate_ids(t.model, [[5, 3]], beam_size=2, nbest=3)
    assert t.translate(lines[:2], beam=1, max_len_b=0, batch_size=1, alpha=0, stop="bound") == \
        t.translate(lines[:2], beam=1, max_len_b=0)     # the edges of each range are taken


def test_empty_lines_stay_empty_and_no_bar_is_drawn_off_a_terminal(setup):
    d = setup
    src = (d / "src.txt").read_text().splitlines()
    text = f"{src[0]}\n\n   \n{src[1]}\n"
    out = run("translate", "--checkpoint", d / "model.npz", "--beam", 2, "--max-len-b", 3, stdin=text)
    assert out.returncode == 0, out.stderr
    got = out.stdout.split("\n")
    assert len(got) == 5 and got[1] == "" and got[2] == "" and got[0] and got[3] and got[4] == ""
    assert out.stderr == ""                                  # stderr is a pipe here: no progress bar
    from minitf.translate import progress_bar

    class Terminal:
        def isatty(self):
            return True
    from minitf.progress import Lines
    one = progress_bar(1, "translate", stream=Terminal())                   # one sentence: no bar, no lines
    assert isinstance(one, Lines) and one.every is None
    assert not isinstance(progress_bar(100, "translate", stream=Terminal()), Lines)   # a tqdm bar


def test_evaluate_reads_pipes(setup, tmp_path):
    import gzip
    import shutil
    d = setup
    with gzip.open(tmp_path / "ref.txt.gz", "wt") as f:
        f.write((d / "ref.txt").read_text())
    want = run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref", d / "ref.txt",
               "--beam", 1, "--max-len-b", 3, "--json", "--quiet")
    assert want.returncode == 0, want.stderr
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash for a process substitution")
    cmd = (f"{sys.executable} -m minitf evaluate --checkpoint {d / 'model.npz'} --src <(cat {d / 'src.txt'}) "
           f"--ref <(cat {tmp_path / 'ref.txt.gz'}) --beam 1 --max-len-b 3 --json --quiet")
    got = subprocess.run([bash, "-c", cmd], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["bleu"] == json.loads(want.stdout)["bleu"]


def test_nbest_and_scores_lines(setup):
    """--nbest N --scores: S-, H- (best first, the first one the plain translation) and P- lines;
    the P- values are the model's log-probabilities of each piece and the end of sentence (checked
    by teacher forcing), and H = their sum over the length penalty."""
    import numpy as np
    import minitf
    from minitf.decode import length_penalty
    d = setup
    src = (d / "src.txt").read_text().splitlines()[:3]
    out = run("translate", "--checkpoint", d / "model.npz", "--beam", 3, "--nbest", 2, "--scores", "--max-len-b", 4,
              stdin="".join(s + "\n" for s in src))
    assert out.returncode == 0, out.stderr
    plain = run("translate", "--checkpoint", d / "model.npz", "--beam", 3, "--max-len-b", 4,
                stdin="".join(s + "\n" for s in src)).stdout.splitlines()
    translator = minitf.load(d / "model.npz")
    model, tok = translator.model, translator.tokenizer
    lines = out.stdout.splitlines()
    for i, s in enumerate(src):
        mine = [line for line in lines if line.split("\t")[0][2:] == str(i)]
        assert mine[0] == f"S-{i}\t{s}"
        h = [m.split("\t") for m in mine if m.startswith("H-")]
        p = [m.split("\t")[1].split() for m in mine if m.startswith("P-")]
        assert len(h) == len(p) == 2 and h[0][2] == plain[i]
        assert float(h[0][1]) >= float(h[1][1])
        for (_, score, text), pos in zip(h, p):
            pos = [float(v) for v in pos]
            assert float(score) == pytest.approx(sum(pos) / length_penalty(len(pos), 0.6), abs=2e-4)
        hyp = translator.nbest([s], n=1, beam=3, max_len_b=4)[0][0]
        ids = tok.encode([hyp.text])[0]
        logits = model.forward(np.array([tok.encode([s])[0] + [tok.eos_id]]), np.array([[tok.bos_id] + ids]))
        logp = logits[0] - np.log(np.exp(logits[0] - logits[0].max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits[0].max(1, keepdims=True)
        forced = [logp[t, tok_id] for t, tok_id in enumerate(ids + [tok.eos_id])]
        np.testing.assert_allclose(hyp.token_logprobs, forced, atol=1e-4)
        assert hyp.positional is hyp.token_logprobs   # the former name still reads
    greedy = run("translate", "--checkpoint", d / "model.npz", "--beam", 1, "--scores", "--max-len-b", 4,
                 stdin=src[0] + "\n")
    assert greedy.returncode == 0 and [line[:2] for line in greedy.stdout.splitlines()] == ["S-", "H-", "P-"]
    bad = run("translate", "--checkpoint", d / "model.npz", "--beam", 2, "--nbest", 3, stdin=src[0] + "\n")
    assert bad.returncode == 2 and "--nbest 3" in bad.stderr


def test_average_leaves_out_what_is_not_a_training_checkpoint_and_takes_the_last_of_a_folder(setup, tmp_path):
    import minitf
    from minitf.checkpoint import average_checkpoints, load_checkpoint, save_checkpoint
    ckpt = load_checkpoint(setup / "model.npz")
    for step in (1, 2, 3):
        model = minitf.Transformer(ckpt.config, seed=step)
        save_checkpoint(tmp_path / f"checkpoint_{step:07d}.npz", model, tokenizer=ckpt.tokenizer,
                        train_state={"step": step})
    average_checkpoints([tmp_path / "checkpoint_0000001.npz"], tmp_path / "averaged.npz")
    save_checkpoint(tmp_path / "checkpoint_best.npz", minitf.Transformer(ckpt.config, seed=9), train_state={"best": True})
    names = sorted(str(p) for p in tmp_path.glob("*.npz"))
    out = run("average", "--inputs", *names, "--output", tmp_path / "all.npz")
    assert out.returncode == 0, out.stderr
    assert "left out" in out.stderr and "averaged.npz: an average" in out.stderr
    assert "checkpoint_best.npz: the best validation checkpoint" in out.stderr
    assert "averaged 3 checkpoints (checkpoint_0000001.npz, checkpoint_0000002.npz, checkpoint_0000003.npz)" \
        in out.stderr
    out = run("average", "--folder", tmp_path, "--last", 2, "--output", tmp_path / "last2.npz")
    assert out.returncode == 0 and "averaged 2 checkpoints (checkpoint_0000002.npz, checkpoint_0000003.npz)" \
        in out.stderr, out.stderr
    out = run("average", "--folder", tmp_path, "--last", 1, "--output", tmp_path / "last1.npz")
    assert "averaged 1 checkpoint (checkpoint_0000003.npz)" in out.stderr
    out = run("average", "--inputs", tmp_path / "averaged.npz", tmp_path / "checkpoint_best.npz",
              "--output", tmp_path / "none.npz")
    assert out.returncode == 2 and "every checkpoint given was left out" in out.stderr, out.stderr
    assert [x for x in out.stderr.splitlines() if not x.startswith("note: left out")] == [
        x for x in out.stderr.splitlines() if x.startswith("error:")] and not (tmp_path / "none.npz").exists()
    helped = run("average", "--help").stdout
    assert "--inputs" in helped and "--folder" in helped and "--last" in helped and "training checkpoint" in helped


def test_export_safetensors_without_adam_state_and_translate_from_it(setup, tmp_path):
    import struct
    import numpy as np
    import minitf
    from minitf.checkpoint import load_checkpoint, save_checkpoint
    ckpt = load_checkpoint(setup / "model.npz")
    model = ckpt.build_model()
    opt = minitf.Adam(model)
    model.zero_grad()
    opt.step()                                            # Adam's moments exist after a step
    save_checkpoint(tmp_path / "train.npz", model, optimizer=opt, tokenizer=ckpt.tokenizer,
                    train_state={"step": 7, "languages": ["en", "de"]})
    assert any(k.startswith("m.") for k in load_checkpoint(tmp_path / "train.npz").optimizer)
    out = run("export", "--checkpoint", tmp_path / "train.npz", "--output", tmp_path / "m.safetensors")
    assert out.returncode == 0, out.stderr
    data = (tmp_path / "m.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]                  # the format, read here by hand
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__")
    assert set(header) == set(ckpt.params) and (8 + n) % 8 == 0
    for name, info in header.items():
        a, b = info["data_offsets"]
        assert info["dtype"] == "F32"
        got = np.frombuffer(data[8 + n + a:8 + n + b], dtype="<f4").reshape(info["shape"])
        np.testing.assert_array_equal(got, ckpt.params[name])
    assert json.loads(meta["config"]) == ckpt.config.to_dict() and json.loads(meta["train_state"])["step"] == 7
    params = sum(a.nbytes for a in ckpt.params.values())
    assert len(data) - (8 + n) == params                 # the parameters' bytes and nothing else (no Adam moments)
    lines = (setup / "src.txt").read_text()
    a = run("translate", "--checkpoint", setup / "model.npz", "--max-len-b", 3, stdin=lines)
    b = run("translate", "--checkpoint", tmp_path / "m.safetensors", "--max-len-b", 3, stdin=lines)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout, b.stderr
    assert minitf.load(tmp_path / "m.safetensors").languages == ["en", "de"]
    bad = run("export", "--checkpoint", tmp_path / "train.npz", "--output", tmp_path / "m.bin")
    assert bad.returncode == 2 and "safetensors" in bad.stderr


def test_version():
    import minitf
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"minitf {minitf.__version__}"


def test_translate_help_tells_of_interactive_translation():
    """On a terminal, translate works line by line as you type: --help says so."""
    out = run("translate", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "translated as you type it (Ctrl-D ends)" in text and "on a terminal" in text.lower()


def test_python_m_minitf_beside_a_folder_named_minitf_is_one_line_not_a_traceback(tmp_path):
    """From the folder that holds a clone named minitf, `python -m minitf` meets that folder first:
    it either runs (the install wins) or says in one line what to do, never a bare ImportError."""
    (tmp_path / "minitf").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "minitf", "--version"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    if r.returncode == 0:
        assert r.stdout.startswith("minitf ")
    else:
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "shadows" in r.stderr, r.stderr


def test_the_stop_rule_of_beam_search_is_a_flag(setup):
    """--stop bound (beam search ends a sentence once no live beam can beat its best finished one)
    reaches the search from the command line and the library; its score is never worse than fairseq's
    rule, and a bad value is one line."""
    import minitf
    d = setup
    src = (d / "src.txt").read_text().splitlines()
    for stop in ("fairseq", "bound"):
        out = run("translate", "--checkpoint", d / "model.npz", "--beam", 3, "--max-len-b", 4, "--stop", stop,
                  "--input", d / "src.txt")
        assert out.returncode == 0 and len(out.stdout.splitlines()) == len(src), out.stderr
    t = minitf.load(d / "model.npz")
    fair, bound = (t.nbest(src, n=1, beam=3, max_len_b=4, stop=s) for s in ("fairseq", "bound"))
    # (never worse up to float32 round-off: the two searches batch their beams differently, and
    # BLAS sums a row differently in a differently shaped product)
    assert all(b[0].score >= f[0].score - 1e-6 * abs(f[0].score) for f, b in zip(fair, bound))
    bad = run("translate", "--checkpoint", d / "model.npz", "--stop", "never", stdin="x\n")
    assert bad.returncode == 2 and "--stop" in bad.stderr and "Traceback" not in bad.stderr


def test_info_says_what_each_kind_of_model_file_is(setup, tmp_path, capsys):
    import json
    import minitf
    from minitf.checkpoint import average_checkpoints, export_safetensors, load_checkpoint, save_checkpoint
    from minitf.cli import main
    source = load_checkpoint(setup / "model.npz")
    model = source.build_model()
    state = {"step": 7, "epoch": 0, "batch": 7, "train_tokens": 1234, "train_wall_s": 3.2, "data_id": "abc123",
             "languages": ["en", "de"]}
    save_checkpoint(tmp_path / "checkpoint_0000007.npz", model, minitf.Adam(model, lr=1e-3),
                    tokenizer=source.tokenizer, train_state=state)
    average_checkpoints([tmp_path / "checkpoint_0000007.npz"], tmp_path / "avg.npz")
    save_checkpoint(tmp_path / "model.npz", model, tokenizer=source.tokenizer,
                    train_state={"model": "averaged", "from": ["a.npz", "b.npz"], "step": 7, "languages": ["en", "de"]})
    export_safetensors(tmp_path / "model.npz", tmp_path / "model.safetensors")
    save_checkpoint(tmp_path / "last.npz", model, tokenizer=source.tokenizer,
                    train_state={"model": "last", "from": ["checkpoint_0000007.npz"], "step": 7, "languages": ["en", "de"]})
    expected = {"checkpoint_0000007.npz": "a training checkpoint that holds Adam's moments (--resume continues from a run's last one)",
                "avg.npz": "an average of 1 checkpoint",
                "model.npz": "a run's reported model: the average of 2 checkpoints",
                "model.safetensors": "a run's reported model: the average of 2 checkpoints, exported as .safetensors",
                "last.npz": "a run's reported model: its last checkpoint (checkpoint_0000007.npz)"}
    n = sum(a.size for a in model.state_dict().values())
    c = model.cfg
    for name, kind in expected.items():
        assert main(["info", str(tmp_path / name)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == f"{tmp_path / name}: {kind}"
        assert f"  model: Transformer, {c.n_layers}+{c.n_decoder_layers} layers, post-norm, D {c.d_model}, " \
               f"{c.n_heads} heads of {c.d_k}, F {c.d_ff}" in lines[2] and f"{n:,} parameters (float32)" in lines[2]
        assert f"{c.activation}, sinusoidal positions; " in lines[2]       # no bound: sinusoids reach any length
        assert lines[1] == "  languages: en -> de"
        assert f"  vocabulary: {c.vocab_size:,} pieces (a SentencePiece" in lines[3]
    assert main(["info", str(tmp_path / "checkpoint_0000007.npz")]) == 0
    out = capsys.readouterr().out
    assert "  training: 7 updates, 1,234 target tokens, 3 s of training, corpus abc123" in out
    assert f"{c.update_tokens:,} tokens an update\n" in out             # no record of the batches: the preset's
    save_checkpoint(tmp_path / "ranks.npz", model, minitf.Adam(model, lr=1e-3), tokenizer=source.tokenizer,
                    train_state=dict(state, batch_tokens=200, update_batches=2))   # 2 ranks of --max-tokens 200
    assert main(["info", str(tmp_path / "ranks.npz")]) == 0
    assert "400 tokens an update (at most, padding included)" in capsys.readouterr().out
    # an average (a run's averaged.npz, its model.npz) and an export keep the update's size where the inputs agree on
    # it (the preset's had been said for them)
    average_checkpoints([tmp_path / "ranks.npz"], tmp_path / "ranks_avg.npz")
    export_safetensors(tmp_path / "ranks_avg.npz", tmp_path / "ranks_avg.safetensors")
    average_checkpoints([tmp_path / "ranks.npz", tmp_path / "checkpoint_0000007.npz"], tmp_path / "mixed.npz")
    for name, said in (("ranks_avg.npz", "400 tokens an update (at most"), ("ranks_avg.safetensors", "400 tokens an "
                       "update (at most"), ("mixed.npz", f"{c.update_tokens:,} tokens an update\n")):
        assert main(["info", str(tmp_path / name)]) == 0
        assert said in capsys.readouterr().out, name
    assert main(["info", str(tmp_path / "model.safetensors"), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["parameters"] == n and facts["config"] == c.to_dict() and facts["resumable"] is False
    assert facts["train_state"]["from"] == ["a.npz", "b.npz"] and facts["tokenizer"]["pieces"] == c.vocab_size
    learned = minitf.Transformer(minitf.Config(**{**c.to_dict(), "positional": "learned", "max_len": 40}))
    save_checkpoint(tmp_path / "learned.npz", learned, tokenizer=source.tokenizer)
    assert main(["info", str(tmp_path / "learned.npz")]) == 0
    assert ", learned positions (at most 40); " in capsys.readouterr().out
    assert "recipe: dropout 0.1, label smoothing" in out   # the paper's recipe: nothing more to say
    # the recipe's options beyond the paper's, where set (they had been left out)
    extra = minitf.Transformer(minitf.Config(**{**c.to_dict(), "lr_fade": 0.5, "attention_dropout": 0.1,
                                                "bidirectional_epochs": 1, "relu_dropout": 0.2}))
    save_checkpoint(tmp_path / "extra.npz", extra, tokenizer=source.tokenizer)
    assert main(["info", str(tmp_path / "extra.npz")]) == 0
    out = capsys.readouterr().out
    assert "recipe: dropout 0.1, label smoothing" in out and ("tokens an update; beyond the paper's: "
                                                              "--attention-dropout 0.1, --relu-dropout 0.2, "
                                                              "--bidirectional-epochs 1, --lr-fade 0.5\n") in out
    assert main(["info", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz does not exist" in capsys.readouterr().err
    # a run's folder: its checkpoints, scores and model; before its end, its newest checkpoint
    run = tmp_path / "run"
    run.mkdir()
    for step in (4, 7):
        save_checkpoint(run / f"checkpoint_{step:07d}.npz", model, minitf.Adam(model, lr=1e-3),
                        tokenizer=source.tokenizer, train_state=dict(state, step=step))
    assert main(["info", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"{run}: a training run without results.json (running, or stopped before its end)",
                         "  checkpoints: 2 training checkpoints (steps 4, 7): --resume continues from step 7"]
    assert lines[2] == f"{run / 'checkpoint_0000007.npz'}: {expected['checkpoint_0000007.npz']}"
    save_checkpoint(run / "model.npz", model, tokenizer=source.tokenizer,
                    train_state={"model": "last", "from": ["checkpoint_0000007.npz"], "step": 7})
    save_checkpoint(run / "checkpoint_best.npz", model, tokenizer=source.tokenizer, train_state={"best": True})
    (run / "results.json").write_text(json.dumps({"steps": 7, "beam": 4, "alpha": 0.6,
                                                  "bleu": {"valid": 1.5, "news": 2.25}}))
    assert main(["info", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [f"{run}: a training run that ended after 7 updates",
                         "  checkpoints: 2 training checkpoints (steps 4, 7; checkpoint_best.npz): --resume continues "
                         "from step 7",
                         "  scores: sacreBLEU valid 1.5, news 2.25 (beam 4, alpha 0.6; results.json)",
                         f"{run / 'model.npz'}: a run's reported model: its last checkpoint (checkpoint_0000007.npz)"]
    assert main(["info", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["parameters"] == n
    # how a resume goes on from a run that ended on its budget or its steps (config.json's record of its flags)
    for flags, end in (({"time_budget": 60, "max_steps": 100}, "(its --time-budget 60 is spent over its starts: give "
                                                                 "a larger one, or a --max-steps)"),
                       ({"time_budget": None, "max_steps": 7}, "(it reached its --max-steps 7: give a larger one)")):
        (run / "config.json").write_text(json.dumps({"model": {}, "args": flags}))
        (run / "results.json").write_text(json.dumps({"steps": 7, "train_wall_s": 60.2, "beam": 4, "alpha": 0.6}))
        assert main(["info", str(run)]) == 0
        assert capsys.readouterr().out.splitlines()[1].endswith(f"--resume continues from step 7 {end}")
    (run / "config.json").unlink()
    # resumed past its end and stopped before ending again: its results are of the earlier end, and say so
    save_checkpoint(run / "checkpoint_0000009.npz", model, minitf.Adam(model, lr=1e-3), tokenizer=source.tokenizer,
                    train_state=dict(state, step=9))
    assert main(["info", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{run}: a training run that ended after 7 updates, then was resumed and stopped at step 9 before ending "
        f"again: its results.json and model.npz are of step 7")
    (run / "checkpoint_0000009.npz").unlink()
    # the last checkpoint cut short: the line names the one --resume takes once it is moved away (it had said "--resume
    # continues from step 7", which --resume then refused); a model that cannot be read is exit 2 after the run's facts
    # (it had been exit 0)
    for name in ("checkpoint_0000007.npz", "model.npz"):
        whole = (run / name).read_bytes()
        (run / name).write_bytes(whole[:2000])
        assert main(["info", str(run)]) == (0 if name.startswith("checkpoint") else 2)
        said = capsys.readouterr()
        line = said.out.splitlines()[1]
        if name.startswith("checkpoint"):
            assert re.fullmatch(r"  checkpoints: 2 training checkpoints \(steps 4, 7; checkpoint_best\.npz\): the last "
                                r"cannot be read \(checkpoint \S+checkpoint_0000007\.npz is truncated or corrupt \(.+\)\): "
                                rf"move it out of {re.escape(str(run))}, and --resume continues from step 4", line), line
            assert f"{run / 'model.npz'}: a run's reported model" in said.out
        else:
            assert line.endswith("--resume continues from step 7") and "cannot be read" not in said.out
            assert re.fullmatch(rf"error: {re.escape(str(run / name))}: cannot be read: checkpoint \S+ is truncated or "
                                r"corrupt \(.+\)\n", said.err), said.err
        (run / name).write_bytes(whole)
    one = tmp_path / "one"   # its only checkpoint cut short: no step to go on from, and a new run there is refused
    one.mkdir()
    (one / "checkpoint_0000004.npz").write_bytes((run / "checkpoint_0000004.npz").read_bytes()[:2000])
    (one / "model.npz").write_bytes((run / "model.npz").read_bytes())
    (one / "results.json").write_text(json.dumps({"steps": 4}))
    assert main(["info", str(one)]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith(
        f"move it out of {one}, and --resume cannot continue this run, and a new run in this folder is refused")
    (tmp_path / "empty").mkdir()
    assert main(["info", str(tmp_path / "empty")]) == 2
    assert "neither a run's --out folder" in capsys.readouterr().err
    (tmp_path / "early").mkdir()                 # a run before its first checkpoint
    (tmp_path / "early" / "train_log.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    assert main(["info", str(tmp_path / "early")]) == 2   # nobody holds its lock: it stopped (it had said "yet")
    assert "is the folder of a training run that stopped before its first checkpoint (its log's last record is of " \
           "step 1): no model to describe" in capsys.readouterr().err
    from minitf.fileio import folder_lock, refuse_if_busy
    with folder_lock(str(tmp_path / "early"), refuse_if_busy("--out", str(tmp_path / "early"))):   # a run training
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        r = subprocess.run([sys.executable, "-m", "minitf", "info", str(tmp_path / "early")], capture_output=True,
                           text=True, cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 2 and "is the folder of a training run in progress (process " in r.stderr and \
        "that has not written its first checkpoint yet" in r.stderr, r.stderr
    # odd folders: a hand-edited results.json, a model.npz cut short, a folder with only checkpoint_best.npz
    for text, head in (('{"steps": "7"}', "a training run that ended (its results.json gives no count of updates)"),
                       ("[1, 2]", "a training run whose results.json cannot be read"), ("{", "cannot be read")):
        (run / "results.json").write_text(text)
        assert main(["info", str(run)]) == 0
        assert head in capsys.readouterr().out.splitlines()[0]
    (run / "model.npz").write_bytes((run / "model.npz").read_bytes()[:5000])
    assert main(["info", str(run)]) == 2
    said = capsys.readouterr()
    assert said.out.splitlines()[1].startswith("  checkpoints: 2")
    assert said.err.startswith(f"error: {run / 'model.npz'}: cannot be read: ")
    only = tmp_path / "only_best"
    only.mkdir()
    (only / "checkpoint_best.npz").write_bytes((run / "checkpoint_best.npz").read_bytes())
    assert main(["info", str(only)]) == 0
    out = capsys.readouterr().out
    assert f"{only / 'checkpoint_best.npz'}: the best validation checkpoint of a run" in out
    assert ("  checkpoints: no training checkpoint (checkpoint_best.npz alone): --resume cannot continue this run; "
            "a new run in this folder starts afresh") in out.splitlines()
    for p in run.glob("checkpoint_0*.npz"):    # a run's checkpoints deleted to save space, its model and scores kept
        p.unlink()
    (run / "model.npz").write_bytes((only / "checkpoint_best.npz").read_bytes())
    assert main(["info", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[1] == ("  checkpoints: no training checkpoint (checkpoint_best.npz "
                                                       "alone): --resume cannot continue this run, and a new run in "
                                                       "this folder is refused")


def test_score_gives_a_translation_the_log_probabilities_beam_search_gave_it(setup, tmp_path):
    import numpy as np
    import minitf
    from minitf.decode import length_penalty
    from minitf.translate import score_ids, translate_ids
    d = setup
    t = minitf.load(d / "model.npz")
    tok = t.tokenizer
    src = (d / "src.txt").read_text().splitlines()[:5]
    src_ids = [ids + [tok.eos_id] for ids in tok.encode(src)]
    found = translate_ids(t.model, src_ids, beam_size=3, alpha=0.6, max_len_b=4, nbest=3)
    pairs = [(i, tokens, logps) for i, hyps in enumerate(found) for tokens, logps in hyps]
    for batch in (1, 4, 64):   # batched and padded, in any order, as one at a time
        forced = score_ids(t.model, [src_ids[i] for i, _, _ in pairs], [tokens for _, tokens, _ in pairs], batch)
        for (_, tokens, logps), mine in zip(pairs, forced):
            assert len(mine) == len(tokens) + 1
            np.testing.assert_allclose(mine, logps, atol=1e-5)
    # text in: the translation split as the tokenizer splits text, scored as nbest scores its own
    text = tok.decode([pairs[0][1]])[0]
    (h,) = t.score([src[0]], [text], alpha=0.6)
    expected = score_ids(t.model, [src_ids[0]], tok.encode_target([text]))[0]
    assert h.text == text and h.token_logprobs == expected
    assert h.score == pytest.approx(sum(expected) / length_penalty(len(expected), 0.6))
    assert t.score([src[0]], [""])[0].token_logprobs == score_ids(t.model, [src_ids[0]], [[]])[0]   # EOS alone
    for blank in (" ", "\u200b", "\ufeff"):   # spaces, or characters the tokenizer drops: no piece
        with pytest.raises(ValueError, match="source 2 of 2 is empty"):
            t.score([src[0], blank], ["a", "b"])
    # ... and translated, such a line comes back empty (the model had been asked, and made up a sentence)
    assert t.translate(["\u200b", "\ufeff", " "]) == ["", "", ""]
    assert [h.text for h in t.nbest(["\u200b"], n=2)[0]] == [""]
    with pytest.raises(TypeError, match="got bytes: decode it first"):
        t.translate(b"A dog runs.")
    assert t.score(src[0], text) == h                             # two strings: one pair, one Hypothesis
    with pytest.raises(TypeError, match="two strings"):
        t.score(src[0], [text])
    with pytest.raises(ValueError, match="alpha=-1: expected 0 to 10"):
        t.score([src[0]], [text], alpha=-1)
    with pytest.raises(ValueError, match=r"target 1: piece ids must lie in \[0, "):
        score_ids(t.model, [src_ids[0]], [[4, tok.vocab_size]])
    # learned positions reach max_len: a longer line is named, in one line on the command line
    from minitf.checkpoint import load_checkpoint, save_checkpoint
    ck = load_checkpoint(d / "model.npz")
    learned = minitf.Config(**{**ck.config.to_dict(), "positional": "learned", "max_len": 6})
    save_checkpoint(tmp_path / "learned.npz", minitf.Transformer(learned, seed=1), tokenizer=ck.tokenizer)
    long, short = " ".join(src[:3]), min(src, key=lambda line: len(tok.encode([line])[0]))
    assert len(tok.encode_target([long])[0]) > 5 and len(tok.encode([short])[0]) < 6
    with pytest.raises(ValueError, match="translation 1 has .* pieces: the model's learned positions take at most 5"):
        minitf.load(tmp_path / "learned.npz").score([short], [long])
    (tmp_path / "one.txt").write_text(short + "\n")
    (tmp_path / "long.txt").write_text(long + "\n")
    r = run("score", "--checkpoint", tmp_path / "learned.npz", "--src", tmp_path / "one.txt", "--tgt", tmp_path / "long.txt")
    assert r.returncode == 2 and "at most 5" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = run("score", "--checkpoint", d / "model.npz", "--src", "-", "--tgt", "-", stdin="a\n")
    assert r.returncode == 2 and "standard input can be only one of them" in r.stderr, r.stderr
    # the command: one score a line, or translate's S-/H-/P- lines; mismatched files refused in one line
    (tmp_path / "tgt.txt").write_text("".join(tok.decode([tokens])[0] + "\n" for _, tokens, _ in pairs[:5]))
    (tmp_path / "src.txt").write_text("".join(src[i] + "\n" for i, _, _ in pairs[:5]))
    plain = run("score", "--checkpoint", d / "model.npz", "--src", tmp_path / "src.txt", "--tgt", tmp_path / "tgt.txt")
    assert plain.returncode == 0, plain.stderr
    mine = t.score((tmp_path / "src.txt").read_text().splitlines(), (tmp_path / "tgt.txt").read_text().splitlines())
    assert plain.stdout == "".join(f"{h.score:.4f}\n" for h in mine)
    lines = run("score", "--checkpoint", d / "model.npz", "--src", tmp_path / "src.txt", "--tgt", tmp_path / "tgt.txt",
                "--scores", "--alpha", 0).stdout.splitlines()
    assert [line[:2] for line in lines] == ["S-", "H-", "P-"] * 5
    p = [float(x) for x in lines[2].split("\t")[1].split()]
    assert float(lines[1].split("\t")[1]) == pytest.approx(sum(p), abs=1e-3)
    bad = run("score", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--tgt", tmp_path / "tgt.txt")
    assert bad.returncode == 2 and "has 7 lines but --tgt" in bad.stderr and bad.stderr.count("\n") == 1


def test_output_never_replaces_what_the_command_reads_and_goes_where_it_is_pointed(setup, tmp_path):
    # --output naming the checkpoint or the input had replaced it with text; a link, a pipe or /dev/stdout had been
    # replaced by a regular file (as root) or was a traceback; a .gz name had held plain text that minitf then could
    # not read back
    import gzip
    d = setup
    model = tmp_path / "model.npz"
    model.write_bytes((d / "model.npz").read_bytes())
    src = tmp_path / "src.txt"
    src.write_text((d / "src.txt").read_text())
    flags = ["--beam", 2, "--max-len-b", 3, "--quiet"]
    for args, flag, named in ((["translate", "--checkpoint", model, "--input", src, "--output", model], "--checkpoint",
                               model),
                              (["translate", "--checkpoint", model, "--input", src, "--output", src], "--input", src),
                              (["score", "--checkpoint", model, "--src", src, "--tgt", d / "ref.txt", "--output", src],
                               "--src", src)):
        r = run(*args, *(flags if args[0] == "translate" else ["--quiet"]))
        assert r.returncode == 2 and r.stderr == (f"error: --output {args[-1]} is {flag} {named}: writing it would "
                                                  f"replace that file; name another output\n"), r.stderr
    # the file on standard input (`< src.txt`) is an input too
    for args, flag in ((["translate", "--checkpoint", model, *flags], "--input -"),
                       (["score", "--checkpoint", model, "--src", "-", "--tgt", d / "ref.txt", "--quiet"], "--src -")):
        with open(src) as stdin:
            r = subprocess.run([sys.executable, "-m", "minitf", *map(str, args), "--output", str(src)], stdin=stdin,
                               capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr == (f"error: --output {src} is the file on standard input ({flag}): "
                                                  f"writing it would replace that file; name another output\n"), r.stderr
    assert model.read_bytes() == (d / "model.npz").read_bytes() and src.read_text() == (d / "src.txt").read_text()
    want = run("translate", "--checkpoint", model, "--input", src, *flags).stdout
    run("translate", "--checkpoint", model, "--input", src, "--output", tmp_path / "out.de.gz", *flags)
    assert gzip.decompress((tmp_path / "out.de.gz").read_bytes()).decode() == want
    (tmp_path / "real.txt").write_text("")
    os.symlink(tmp_path / "real.txt", tmp_path / "link.txt")
    run("translate", "--checkpoint", model, "--input", src, "--output", tmp_path / "link.txt", *flags)
    assert os.path.islink(tmp_path / "link.txt") and (tmp_path / "real.txt").read_text() == want
    os.symlink(tmp_path / "real.gz", tmp_path / "link.gz")   # a .gz name through a link: compressed too
    run("translate", "--checkpoint", model, "--input", src, "--output", tmp_path / "link.gz", *flags)
    assert gzip.decompress((tmp_path / "real.gz").read_bytes()).decode() == want
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = subprocess.Popen([sys.executable, "-m", "minitf", "translate", "--checkpoint", str(model), "--input", str(src),
                          "--output", str(fifo), *map(str, flags)], stderr=subprocess.PIPE, text=True)
    with open(fifo) as f:
        assert f.read() == want
    assert p.wait(timeout=300) == 0 and fifo.is_fifo()


def test_output_dash_is_stdout_a_model_files_name_is_refused_and_a_file_keeps_its_permissions(setup, tmp_path):
    # --output - had written a file named -; --output checkpoint_best.npz (or any *.npz, *.safetensors) had replaced
    # a model with text; a private 0600 file written over had become readable by all; a closed stdin or stdout had been
    # a traceback
    d = setup
    flags = ["--checkpoint", d / "model.npz", "--input", d / "src.txt", "--beam", 2, "--max-len-b", 3, "--quiet"]
    want = run("translate", *flags).stdout
    r = subprocess.run([sys.executable, "-m", "minitf", "translate", *map(str, flags), "--output", "-"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == want and not (tmp_path / "-").exists()
    for name in ("checkpoint_best.npz", "model.safetensors"):
        (tmp_path / name).write_bytes(b"a model")
        for cmd in (["translate", *flags], ["score", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--tgt",
                                           d / "ref.txt", "--quiet"]):
            r = run(*cmd, "--output", tmp_path / name)
            assert r.returncode == 2 and r.stderr == (f"error: --output {tmp_path / name}: a model file's name, and "
                                                      f"what is written is text: name the output file otherwise (e.g. "
                                                      f"out.txt)\n"), r.stderr
        assert (tmp_path / name).read_bytes() == b"a model"
    private = tmp_path / "private.txt"
    private.write_text("old")
    os.chmod(private, 0o600)
    assert run("translate", *flags, "--output", private).returncode == 0
    assert private.read_text() == want and (os.stat(private).st_mode & 0o777) == 0o600
    for redirect, says in (("<&-", "standard input is closed: name the input file"),
                           (">&-", "standard output is closed: name a file with --output")):
        cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "minitf", "translate", "--checkpoint", d / "model.npz",
                                          *(["--input", d / "src.txt"] if redirect == ">&-" else [])])
        r = subprocess.run(f"{cmd} {redirect}", shell=True, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr == f"error: {says}" + (
            " (--input, --src, --tgt or --ref)\n" if redirect == "<&-" else "\n"), r.stderr


def test_score_names_its_empty_source_lines_before_scoring_any(setup, tmp_path):
    d = setup
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    # a line of "▁" (no piece, not blank) had been passed over, and the first blank line named as the first
    for empties, says in (([1], "line 2 is empty (no piece)"), ([1, 2, 4], "3 lines are (the first: line 2) empty (no piece)"),
                          ([0, 3], "2 lines are (the first: line 1) empty (no piece)")):
        lines = (d / "src.txt").read_text().splitlines()[:5]
        for i in empties:
            lines[i] = {0: "\u2581\u2581\u2581", 2: " "}.get(i, "")
        src.write_text("\n".join(lines) + "\n")
        tgt.write_text("\n".join(["x"] * 5) + "\n")
        r = run("score", "--checkpoint", d / "model.npz", "--src", src, "--tgt", tgt, "--quiet")
        assert r.returncode == 2 and r.stdout == "" and r.stderr == (
            f"error: --src {src}: {says}: a translation needs a source to be scored against; drop the pairs whose "
            f"source is empty first (no score is written until every pair has a source)\n"), r.stderr


def test_evaluate_names_a_doubled_stdin_and_takes_the_language_in_any_case(setup):
    d = setup
    r = run("evaluate", "--checkpoint", d / "model.npz", "--src", "-", "--ref", "-", stdin="a\n")
    assert r.returncode == 2 and "standard input can be only one of them" in r.stderr
    lower, upper = (json.loads(run("evaluate", "--checkpoint", d / "model.npz", "--src", d / "src.txt", "--ref",
                                   d / "ref.txt", "--beam", 1, "--max-len-b", 3, "--quiet", "--json", "--lang",
                                   lang).stdout) for lang in ("de", "DE"))
    assert "compound splitting" in upper["bleu_paper_method"] and upper["bleu_paper"] == lower["bleu_paper"]



def test_metrics_refuse_lists_of_other_lengths_and_evaluate_a_language_pair():
    """sacreBLEU's functions score the shorter list alone: 2 hypotheses against 3 references had scored 100, and
    none against none failed inside sacreBLEU. --lang en-zh (sacrebleu -l's pair) had been read as English, its
    first half: BLEU 0 on Chinese with the 13a tokenizer."""
    from minitf.cli import _check_lang
    from minitf.errors import ConfigError
    from minitf.translate import metrics, paper_bleu
    two, three = ["Ein Mann fährt Rad.", "Ein Hund läuft."], ["Ein Mann fährt Rad.", "Ein Hund läuft.", "Eine Katze."]
    for hyps, refs in ((two, three), (three, two), ([], [])):
        with pytest.raises(ValueError, match="hypotheses and .* references|nothing to score"):
            metrics(hyps, refs, lang="de")
        with pytest.raises(ValueError):
            paper_bleu(hyps, refs, "de")
    assert metrics(two, two[:], lang="de")["bleu"] == 100.0
    for pair, languages, target in (("en-zh", ["en", "zh"], "zh"), ("en_de", ["en", "de"], "de"),
                                    ("EN-DE", ["en", "de"], "de"), ("en-zh", ["en", "de"], "de"),
                                    ("fr-de", ["en", "de"], "de")):
        with pytest.raises(ConfigError, match=rf"--lang .*: give the target language alone \(--lang {target}\)"):
            _check_lang(pair, languages)
    # a region or a script, in any case, where the model's languages tell (a lowercase region had been refused,
    # pt-br sent to Breton)
    for fine in ("de", "de-AT", "de-at", "de-ch", "zh_CN", "zh_cn", "pt-BR", "pt-br", "zh-hans", "es-419", None,
                 "de-de"):
        _check_lang(fine, ["en", "de"])
    # a model that records no languages (an OPUS-MT folder): a lowercase pair is ambiguous, a capital region taken
    for ambiguous in ("en-zh", "pt-br", "eng-zho"):
        with pytest.raises(ConfigError, match=r"a language pair as sacrebleu -l takes it, or a language and its "
                                              r"region\?"):
            _check_lang(ambiguous, None)
    for fine in ("de", "de-AT", "zh_CN", "pt-BR", "zh-Hans", "es-419", "de-de", None):
        _check_lang(fine, None)
    ko = ["저는 오늘 학교에 갑니다 그리고 친구를 만납니다 ."]
    assert paper_bleu(ko, ko, "ko")[0] == 100.0   # Korean has spaces: Moses splits it (it had been left out)
    assert paper_bleu(["我 喜欢"], ["我 喜欢"], "zh")[0] is None


@pytest.mark.parametrize("flags", [["--beam", "2"], ["--beam", "1"], ["--beam", "3", "--nbest", "2", "--scores"]])
def test_a_stopped_translation_keeps_its_lines_and_the_same_command_goes_on_from_them(setup, tmp_path, monkeypatch,
                                                                                      capsys, flags):
    """translate --output FILE keeps each line in FILE.partial as it is done: stopped (Ctrl-C here, after 15 lines),
    FILE is not written, the kept lines are said, and the same command translates only the others and writes FILE as
    one uninterrupted run does, FILE.partial then removed."""
    from minitf import cli, partial_output, translate
    d = setup
    _, lines = make_tiny_checkpoint(tmp_path, n_lines=40, seed=4)
    lines = lines[:20] + [""] + lines[20:]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    cmd = ["translate", "--checkpoint", str(d / "model.npz"), "--input", str(tmp_path / "in.txt"), "--max-len-b", "4",
           "--quiet", *flags]
    assert cli.main([*cmd, "--output", str(tmp_path / "whole.txt")]) == 0
    assert not (tmp_path / "whole.txt.partial").exists()
    capsys.readouterr()
    add = partial_output.PartialOutput.add

    def stopped_after_15(self, i, text):
        add(self, i, text)
        if len(self.done) == 15:
            raise KeyboardInterrupt
    monkeypatch.setattr(partial_output.PartialOutput, "add", stopped_after_15)
    out = tmp_path / "out.txt"
    assert cli.main([*cmd, "--output", str(out)]) == 130
    kept = (tmp_path / "out.txt.partial").read_text().splitlines()[1:]
    err = capsys.readouterr().err
    assert not out.exists() and len(kept) >= 15
    assert f"interrupted: the {len(kept)} of 41 lines translated so far are kept in {out}.partial, and the same " \
           f"command again goes on from them" in err
    monkeypatch.setattr(partial_output.PartialOutput, "add", add)
    asked = []
    for name in ("translate", "nbest"):
        real = getattr(translate.Translator, name)
        monkeypatch.setattr(translate.Translator, name,
                            lambda self, todo, *a, real=real, **k: asked.append(len(todo)) or real(self, todo, *a, **k))
    assert cli.main([*cmd, "--output", str(out)]) == 0
    assert f"note: going on from {out}.partial: {len(kept)} of 41 lines were translated before" in capsys.readouterr().err
    assert asked == [41 - len(kept)] and not (tmp_path / "out.txt.partial").exists()
    got, want = (f.read_text().splitlines() for f in (out, tmp_path / "whole.txt"))
    # the same lines; a score's last digit may differ (the lines went on in other batches: float32 sums in another order)
    assert [line.split("\t")[::2] for line in got] == [line.split("\t")[::2] for line in want]
    numbers = [(a.split("\t")[1].split(), b.split("\t")[1].split()) for a, b in zip(got, want) if a[:2] in ("H-", "P-")]
    assert len(numbers) == (2 * 2 * 40 + 2 if "--nbest" in flags else 0)   # the empty line: one H- and one P-
    for x, y in numbers:
        assert [float(v) for v in x] == pytest.approx([float(v) for v in y], abs=2e-4)


def test_a_partial_output_of_another_run_or_cut_short_is_handled(setup, tmp_path, capsys, monkeypatch):
    """FILE.partial with a record cut short by a kill: the record is dropped and the others taken; one made from other
    flags, or damaged: noted and begun afresh; a second translation into the same FILE while one runs: refused."""
    import json
    from minitf import cli
    from minitf.errors import ConfigError
    from minitf.partial_output import DECODING_FLAGS, HEADER, PartialOutput, run_key
    d = setup
    cmd = ["translate", "--checkpoint", str(d / "model.npz"), "--input", str(d / "src.txt"), "--max-len-b", "4",
           "--quiet", "--output"]
    assert cli.main([*cmd, str(tmp_path / "whole.txt")]) == 0
    whole = (tmp_path / "whole.txt").read_text().splitlines(keepends=True)
    out, part = tmp_path / "out.txt", tmp_path / "out.txt.partial"
    # what a run of these flags stopped after 3 lines leaves, its 4th record cut short (marked, to see them taken)
    options = {"beam": 4, "max_len_b": 4, "stop": "fairseq", "nbest": None, "scores": False, "alpha": 0.6}
    assert set(options) == set(DECODING_FLAGS)
    key = run_key(str(d / "model.npz"), (d / "src.txt").read_text().splitlines(), options)
    header = json.dumps({"minitf": HEADER, "key": key})
    records = [json.dumps({"i": i, "out": "kept " + whole[i]}) for i in (0, 2, 5)]
    part.write_text("\n".join([header, *records]) + "\n" + '{"i": 6, "out": "cut sh')
    capsys.readouterr()
    assert cli.main([*cmd, str(out)]) == 0
    assert f"note: going on from {part}: 3 of 7 lines were translated before" in capsys.readouterr().err
    assert out.read_text().splitlines(keepends=True) == ["kept " + w if i in (0, 2, 5) else w for i, w in
                                                         enumerate(whole)] and not part.exists()
    other = ("1" if key[0] == "0" else "0") + key[1:]   # (a key that began with 0 had been "changed" into itself)
    for content, why in ((header.replace(key, other) + "\n" + records[0] + "\n",
                          "it was made from another model, input or decoding flags"), ("not json\n", "it is damaged")):
        part.write_text(content)
        assert cli.main([*cmd, str(out)]) == 0
        assert f"note: {part} was not taken ({why}): translating every line afresh" in capsys.readouterr().err
        assert out.read_text().splitlines(keepends=True) == whole and not part.exists()
    # another --batch-size takes the kept lines (the out-of-memory advice is a smaller one)
    part.write_text("\n".join([header, *records]) + "\n")
    assert cli.main([*cmd, str(out), "--batch-size", "2"]) == 0
    assert "note: going on from" in capsys.readouterr().err and not part.exists()
    from minitf import translate   # stopped before any line is done: nothing kept, and no FILE.partial left
    monkeypatch.setattr(translate.Translator, "translate", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main([*cmd, str(tmp_path / "none.txt")]) == 130
    assert "interrupted: nothing half-written was kept" in capsys.readouterr().err
    assert not (tmp_path / "none.txt.partial").exists() and not (tmp_path / "none.txt").exists()
    held = PartialOutput(str(out), "k")
    try:
        with pytest.raises(ConfigError, match="another translation into it is running"):
            PartialOutput(str(out), "k")
        assert cli.main([*cmd, str(out)]) == 2
        assert "another translation into it is running" in capsys.readouterr().err
    finally:
        held.close()


def test_where_the_lines_are_kept_and_what_stops_keeping_them(setup, tmp_path, monkeypatch, capsys):
    """FILE.partial beside the file a link points to; none for a device (/dev/stdout, the shell's file) or a pipe; a
    name near 255 bytes cut; where it cannot be made, the translation runs without it (said); a full disk names it;
    a file system without locks runs unlocked; FILE.partial takes FILE's permissions."""
    import errno
    import fcntl
    from minitf import cli
    from minitf.errors import DataError
    from minitf.partial_output import PartialOutput, partial_path
    d = setup
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.txt").write_text("old\n")
    os.symlink(tmp_path / "real" / "t.txt", tmp_path / "link.txt")
    assert partial_path(str(tmp_path / "link.txt")) == str(tmp_path / "real" / "t.txt.partial")
    os.mkfifo(tmp_path / "fifo")
    assert partial_path("/dev/stdout") is None and partial_path(str(tmp_path / "fifo")) is None
    assert partial_path(None) is None and partial_path(str(tmp_path / "new.txt")) == str(tmp_path / "new.txt.partial")
    long = str(tmp_path / ("x" * 250))
    assert len(os.path.basename(partial_path(long)).encode()) <= 255 and partial_path(long).endswith(".partial")
    cmd = ["translate", "--checkpoint", str(d / "model.npz"), "--input", str(d / "src.txt"), "--max-len-b", "4",
           "--quiet", "--output"]
    assert cli.main([*cmd, str(tmp_path / "whole.txt")]) == 0
    whole = (tmp_path / "whole.txt").read_text()
    assert cli.main([*cmd, long]) == 0 and open(long).read() == whole
    (tmp_path / "blocked.txt.partial").mkdir()   # FILE.partial cannot be made (as in a read-only folder)
    capsys.readouterr()
    assert cli.main([*cmd, str(tmp_path / "blocked.txt")]) == 0
    assert f"note: {tmp_path / 'blocked.txt.partial'}: cannot keep the lines there as they are done" in \
        capsys.readouterr().err and (tmp_path / "blocked.txt").read_text() == whole
    out = tmp_path / "secret.txt"
    out.write_text("")
    out.chmod(0o600)
    part = PartialOutput(str(out), "k")
    assert os.stat(part.path).st_mode & 0o777 == 0o600
    part.remove()
    out.chmod(0o440)   # read-only: its FILE.partial is still its owner's to write (a next run had been refused)
    part = PartialOutput(str(out), "k")
    assert os.stat(part.path).st_mode & 0o777 == 0o640

    class Full:   # a disk that fills in the middle of a record: half of it written, then no space
        calls = 0

        def __getattr__(self, name):
            return getattr(part_file, name)

        def write(self, data):
            Full.calls += 1
            if Full.calls == 1:
                return part_file.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
    part.add(0, "one\n")
    whole_records = open(part.path, "rb").read()
    part_file, part._file = part._file, Full()
    with pytest.raises(DataError, match=r"--output .*secret.txt: cannot keep the lines translated in .*secret.txt.partial "
                                        r"\(No space left on device\); the 1 kept so far stay there"):
        part.add(1, "two\n")
    assert open(part.path, "rb").read() == whole_records and part.done == {0: "one\n"}   # the cut record taken back
    part._file = part_file
    os.unlink(part.path)   # another run's end, and a new run's file in its place: not the file this one locked
    open(part.path, "w").close()
    assert not part._lock()
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda path: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")))
    capsys.readouterr()
    part.remove()
    assert f"note: {out} is written; {part.path} could not be removed (Permission denied): remove it" in \
        capsys.readouterr().err and part._file.closed
    monkeypatch.setattr(os, "unlink", real_unlink)
    if os.path.isdir("/dev/shm"):   # a file under /dev is kept beside like any other, /dev/stdout is not
        assert partial_path("/dev/shm/minitf-out.txt") == "/dev/shm/minitf-out.txt.partial"

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert cli.main([*cmd, str(tmp_path / "nolock.txt")]) == 0 and (tmp_path / "nolock.txt").read_text() == whole


def test_output_is_no_file_of_the_model_and_a_folder_that_cannot_be_written_is_said_first(setup, tmp_path, monkeypatch,
                                                                                          capsys):
    """A Marian folder's source.spm, target.spm, vocabulary or decoder.yml given as --output had been replaced by the
    text (exit 0), and the model could not be loaded again. --output into a folder that cannot be written had been
    refused only after every line was translated; an existing file there that can be written had been refused (no
    temporary file could be made beside it): it is written in place, as a shell's > writes it."""
    from minitf import cli, fileio, translate
    from minitf.marian import export_marian, marian_files
    d, mar = setup, tmp_path / "mar"
    export_marian(str(d / "model.npz"), str(mar))
    _, vocabs, src_spm, tgt_spm = marian_files(str(mar))
    for path in (src_spm, tgt_spm, *vocabs, str(mar / "decoder.yml")):
        before = open(path, "rb").read()
        for cmd in (["translate", "--input", d / "short.txt"], ["score", "--src", d / "short.txt", "--tgt",
                                                                 d / "short.txt"]):
            assert cli.main([*map(str, cmd), "--checkpoint", str(mar), "--quiet", "--output", path]) == 2
            assert capsys.readouterr().err == (f"error: --output {path} is {path}, a file of the model --checkpoint "
                                               f"{mar}: writing it would replace that file; name another output\n")
        assert open(path, "rb").read() == before
    flags = ["--checkpoint", str(d / "model.npz"), "--input", str(d / "short.txt"), "--beam", "2", "--quiet"]
    assert cli.main(["translate", *flags]) == 0
    want = capsys.readouterr().out
    (tmp_path / "ro").mkdir()
    kept = tmp_path / "ro" / "kept.txt"
    kept.write_text("old\n")

    def refused(*args, **kwargs):   # a folder that takes no new file (read-only; the tests may run as root)
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(fileio.tempfile, "mkstemp", refused)
    with monkeypatch.context() as m:
        m.setattr(translate, "load", lambda *a, **k: pytest.fail("the model was loaded before --output was checked"))
        for cmd in (["translate", *flags], ["score", "--checkpoint", str(d / "model.npz"), "--src",
                                            str(d / "short.txt"), "--tgt", str(d / "short.txt"), "--quiet"]):
            assert cli.main([*cmd, "--output", str(tmp_path / "ro" / "new.txt")]) == 2
            assert capsys.readouterr().err == (f"error: --output {tmp_path / 'ro' / 'new.txt'}: cannot write into "
                                               f"{tmp_path / 'ro'} (Permission denied): name another output\n")
    assert cli.main(["translate", *flags, "--output", str(kept)]) == 0
    assert kept.read_text() == want and not (tmp_path / "ro" / "new.txt").exists()


def test_a_line_a_search_thread_finishes_after_an_interruption_is_not_kept_beyond_the_count(tmp_path):
    """After Ctrl-C the search threads still running finish their batch: their lines had been added after the kept
    lines were counted (233 said, 235 kept), and after the file was closed they were writes into a closed file."""
    from minitf.partial_output import PartialOutput
    out = tmp_path / "out.txt"
    part = PartialOutput(str(out), "k")
    part.add(0, "one\n")
    part.stop()
    part.add(1, "two\n")
    assert part.kept() == 1 and part.done == {0: "one\n"}
    part.close()
    part.add(2, "three\n")
    assert PartialOutput(str(out), "k").done == {0: "one\n"}
