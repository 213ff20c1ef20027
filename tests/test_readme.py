"""The README's code runs as written: each Python block executes (in a folder holding a tiny model at
the path the README names), each `train_wmt.py` command's flags are accepted by its parser, and the
`translate` command runs on that model. The install lines (network) and the 30-minute training are not
run here; tests/test_install.py installs the package, tests/test_train.py trains end to end."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)


LOG = [{"step": 10, "epoch": 0.1, "loss": 7.0, "nll": 6.8, "ppl": 900.0, "lr": 1e-4},
       {"step": 20, "epoch": 0.2, "loss": 6.0, "nll": 5.8, "ppl": 330.0, "lr": 2e-4},
       {"step": 20, "valid_loss": 5.9, "valid_nll": 5.7, "valid_ppl": 300.0, "valid_bleu": 1.5, "valid_bleu_sentences": 3},
       {"step": 20, "eval": "valid", "model": "last", "bleu": 2.0, "chrf": 10.0}]


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A folder holding runs/m30k/model.npz (a tiny untrained model) and its train_log.jsonl, the README's
    working folder."""
    (tmp_path / "runs" / "m30k").mkdir(parents=True)
    make_tiny_checkpoint(tmp_path / "runs" / "m30k")
    (tmp_path / "runs" / "m30k" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LOG))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_readme_has_the_blocks_these_tests_run():
    kinds = [kind for kind, _ in BLOCKS]
    assert kinds.count("python") >= 2 and kinds.count("bash") >= 3, kinds


@pytest.mark.parametrize("index", [i for i, (kind, _) in enumerate(BLOCKS) if kind == "python"])
def test_each_python_block_runs_as_written(run_folder, index):
    code = BLOCKS[index][1]
    scope = {"__name__": "__readme__"}
    exec(compile(code, f"README.md python block {index}", "exec"), scope)
    if "forward_loss" in code:   # the training block: three steps made, a finite loss
        assert scope["opt"].step_count == 3 and float(scope["loss"]) > 0
        assert scope["src"].shape[0] == scope["tgt_in"].shape[0] == 2 and (scope["tgt_in"][:, 0] == 2).all()


def shell_commands(prefix):
    """The README's bash lines that run `prefix` (comments stripped), split as the shell would."""
    out = []
    for kind, code in BLOCKS:
        for line in code.splitlines() if kind == "bash" else ():
            words = shlex.split(line, comments=True)
            while words and words[0] in ("mpiexec", "-n") or (words and words[0].isdigit()):
                words = words[1:]
            if words[:len(prefix)] == prefix:
                out.append(words)
    return out


def test_each_training_command_is_accepted_by_the_parser():
    from minitf.train_cli import parse_args
    commands = shell_commands(["python", "train_wmt.py"])
    assert len(commands) >= 5, commands
    for words in commands:
        args = parse_args(words[2:])
        assert args.preset and args.device in ("cpu", "gpu"), words


def minitf_lines(command):
    return [ln for kind, code in BLOCKS if kind == "bash" for ln in code.splitlines()
            if ln.startswith(f"python -m minitf {command}")]


def run_as_written(line):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    r = subprocess.run(["bash", "-c", line.replace("python ", f"{shlex.quote(sys.executable)} ", 1)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"{line}\n{r.stderr[-2000:]}"
    return r


def test_the_translate_command_runs_as_written(run_folder):
    lines = minitf_lines("translate")
    assert lines, "the README's quick start translates a sentence"
    for line in lines:
        assert len(run_as_written(line).stdout.splitlines()) == 1


def test_the_plot_commands_run_as_written(run_folder):
    pytest.importorskip("matplotlib")
    lines = minitf_lines("plot")
    assert {ln.split()[4] for ln in lines} == {"curves", "attention", "lr", "pe", "masks", "packing"}
    for line in lines:
        run_as_written(line)
        out = shlex.split(line, comments=True)[-1]
        assert (run_folder / out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", line
