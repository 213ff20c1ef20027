"""The package's rooms import one way: the graph of imports between minitf's modules (at module
level and inside functions alike) has no circle, so every module can be read knowing only the
ones below it. A package's face (`__init__.py`) re-exports its rooms and is left out."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minitf"


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules):
    """The minitf modules `path` imports (a package's name alone counts as no module: its face)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    return found - {name}


def graph():
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def find_circle(g):
    """A list of modules importing each other round (the first found), or None."""
    done, path = set(), []

    def visit(m):
        if m in done:
            return None
        if m in path:
            return path[path.index(m):] + [m]
        path.append(m)
        for n in sorted(g[m]):
            circle = visit(n)
            if circle:
                return circle
        path.pop()
        done.add(m)
        return None
    for m in sorted(g):
        circle = visit(m)
        if circle:
            return circle
    return None


def test_the_import_graph_has_no_circle():
    g = graph()
    assert len(g) > 30 and "minitf.kernels" in g["minitf.functional"] and "minitf.runfolder" in g["minitf.train"]
    circle = find_circle(g)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    """The check above can fail: two modules importing each other, one inside a function, are a circle."""
    pkg = tmp_path / "minitf"
    pkg.mkdir()
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from minitf import a\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", tmp_path)
    monkeypatch.setattr(here, "PACKAGE", pkg)
    g = graph()
    assert g == {"minitf.a": {"minitf.b"}, "minitf.b": {"minitf.a"}, "minitf.c": {"minitf.a"}}
    assert find_circle(g) == ["minitf.a", "minitf.b", "minitf.a"]
