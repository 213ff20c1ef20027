"""The README's code runs as written: each Python block executes (in a folder holding a tiny model at
the path the README names), each `train_wmt.py` command's flags are accepted by its parser, and the
`translate` command runs on that model. The install lines (network) and the 30-minute training are not
run here; tests/test_install.py installs the package, tests/test_train.py trains end to end."""
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


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A folder holding runs/m30k/model.npz (a tiny untrained model), the README's working folder."""
    (tmp_path / "runs" / "m30k").mkdir(parents=True)
    make_tiny_checkpoint(tmp_path / "runs" / "m30k")
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


def test_the_translate_command_runs_as_written(run_folder):
    lines = [ln for kind, code in BLOCKS if kind == "bash" for ln in code.splitlines()
             if ln.startswith("python -m minitf translate")]
    assert lines, "the README's quick start translates a sentence"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for line in lines:
        r = subprocess.run(["bash", "-c", line.replace("python ", f"{shlex.quote(sys.executable)} ", 1)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(r.stdout.splitlines()) == 1, r.stdout
