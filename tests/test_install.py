"""An installed minitf trains and translates from anywhere: `pip install .` (not editable) into a
folder, then, from a folder that is not the clone (and holds an empty `minitf/` folder, as the
clone's parent does), `python -m minitf train`, and the `minitf-train` and `minitf` commands."""
import os
import shutil
import subprocess
import sys

import pytest
from conftest import write_multi30k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package as `pip install --no-deps --target` puts it: (target folder, environment)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"   # a copy of what the wheel is built from, so that no build/ lands in the clone
    shutil.copytree(os.path.join(ROOT, "minitf"), src / "minitf", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    target = tmp / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(target), MINITF_CACHE=str(tmp / "cache"), PYTHONHASHSEED="0")
    return target, env


@pytest.fixture()
def elsewhere(tmp_path):
    """A working folder outside the clone with an empty minitf/ in it (a namespace package
    candidate, as the clone's own folder is for its parent)."""
    (tmp_path / "minitf").mkdir()
    (tmp_path / "data").mkdir()
    write_multi30k(tmp_path / "data", (("train", 200), ("val", 10), ("test_2016_flickr", 5)))
    return tmp_path


def test_the_installed_package_trains_from_outside_the_clone(installed, elsewhere):
    target, env = installed
    from minitf import __version__

    def run(*cmd, **kw):
        return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=elsewhere,
                              timeout=600, **kw)

    where = run(sys.executable, "-c", "import minitf; print(minitf.__file__)")
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stdout + where.stderr
    for cmd in ([sys.executable, "-m", "minitf", "--version"], [sys.executable, "-m", "minitf", "train", "--version"],
                [target / "bin" / "minitf-train", "--version"], [target / "bin" / "minitf", "--version"]):
        r = run(*cmd)
        assert r.returncode == 0 and r.stdout.strip() == f"minitf {__version__}", (cmd, r.stdout, r.stderr)
    r = run(sys.executable, "-m", "minitf", "train", "--dataset", "multi30k", "--data-dir", "data", "--preset", "tiny",
            "--vocab-size", 40, "--max-steps", 4, "--save-every", 2, "--beam", 1, "--out", "run", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (elsewhere / "run" / "results.json").is_file() and (elsewhere / "run" / "model.npz").is_file()
    r = run(target / "bin" / "minitf-train", "--dataset", "multi30k", "--data-dir", "data", "--preset", "tiny",
            "--vocab-size", 40, "--max-steps", 2, "--save-every", 2, "--beam", 1, "--out", "run2", "--quiet")
    assert r.returncode == 0 and (elsewhere / "run2" / "results.json").is_file(), r.stderr[-3000:]
    r = run(target / "bin" / "minitf", "translate", "--checkpoint", "run/model.npz", "--beam", 1,
            input="a man sees a dog\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr[-2000:]
