"""`python -m minitf translate|evaluate` end to end on a tiny model and files made here."""
import json
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
    want = run("translate", "--checkpoint", d / "model.npz", "--beam", 2, "--max-len-b", 3, "--quiet", stdin=line + "\n")
    assert first == want.stdout


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
