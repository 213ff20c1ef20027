"""The documentation stays true to the code.

* Every backticked qualified name `minitf.xxx.yyy` in docs/**/*.md resolves (import the
  longest importable module prefix, then a getattr chain). Names listed under a
  "To be implemented" heading are pending: skipped while they do not resolve.
* Every backward pass in minitf (each `*_backward` function of minitf.functional,
  minitf.loss and minitf.reference, each `backward`/`*_backward` method of a class in
  minitf.layers, minitf.blocks and minitf.model, and minitf.reference.backward) is named in
  some docs/derivations/*.md page.
* docs/README.md opens with the reading order (the plain reference minitf/reference.py, then
  the derivations, then the engine); the reference imports only NumPy, and its shape letters
  are those of the docs' legend.
* The docs index and the project README link to the pages; relative links and their
  #anchors resolve; Markdown tables are well formed; constants quoted in the docs match the code.
* The pages speak to users: no words about how the project is worked on (issue numbers,
  sessions, machines being lent).
"""
import importlib
import inspect
import math
import pkgutil
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DERIVATIONS = DOCS / "derivations"

REQUIRED_DERIVATIONS = ["linear", "softmax", "layernorm", "dropout", "embedding", "positional",
                        "attention", "multihead", "feedforward", "blocks", "loss", "adam", "schedule", "decoding"]
RUNS_MARK = "# runs in tests/test_docs.py"

FENCE_RE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
QUALNAME_RE = re.compile(r"minitf(?:\.[A-Za-z_]\w*)+")
HEADING_RE = re.compile(r"^(#+)\s*(.*?)\s*$")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_files():
    return sorted(DOCS.rglob("*.md"))


def rel(path):
    return path.relative_to(ROOT).as_posix()


def names_in(text):
    """Qualified names at the start of inline code spans (fenced blocks ignored), in order."""
    text = FENCE_RE.sub("", text)
    out = []
    for span in CODE_SPAN_RE.findall(text):
        m = QUALNAME_RE.match(span.strip())
        if m:
            out.append(m.group(0))
    return out


def pending_names_in(text):
    """Names listed under a heading that says 'To be implemented' (up to the next heading
    of the same or a higher level)."""
    pending, level = set(), None
    for line in text.splitlines():
        h = HEADING_RE.match(line)
        if h:
            if level is not None and len(h.group(1)) <= level:
                level = None
            if "to be implemented" in h.group(2).lower():
                level = len(h.group(1))
            continue
        if level is not None:
            pending.update(names_in(line))
    return pending


def collect():
    pairs, pending = [], set()
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        pending |= pending_names_in(text)
        for name in dict.fromkeys(names_in(text)):
            pairs.append((rel(path), name))
    return pairs, pending


DOC_NAMES, PENDING = collect()


def resolve(name):
    """[module, attr1, attr2, ...] objects along `name`; LookupError says where it breaks."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            # only "this prefix is not a module" means: try a shorter one; a module that
            # exists but fails to import (a missing dependency) is a real error
            if e.name and (modname == e.name or modname.startswith(e.name + ".")):
                continue
            raise
        break
    else:
        raise LookupError(f"no importable module in {name!r}")
    chain = [obj]
    for j, attr in enumerate(parts[i:], start=i):
        if not hasattr(obj, attr):
            raise LookupError(f"{'.'.join(parts[:j])} has no attribute {attr!r}")
        obj = getattr(obj, attr)
        chain.append(obj)
    return chain


def test_doc_pages_exist():
    missing = [p for p in ["README.md", "paper_map.md", "deviations.md"] if not (DOCS / p).is_file()]
    missing += [f"derivations/{d}.md" for d in REQUIRED_DERIVATIONS if not (DERIVATIONS / f"{d}.md").is_file()]
    assert not missing, f"missing documentation pages under docs/: {missing}"


def test_docs_mention_qualified_names():
    assert len(DOC_NAMES) > 50, f"found only {len(DOC_NAMES)} backticked minitf.* names in docs/ (is the regex broken?)"


@pytest.mark.parametrize("doc,name", DOC_NAMES, ids=[f"{d}::{n}" for d, n in DOC_NAMES])
def test_qualified_name_resolves(doc, name):
    try:
        resolve(name)
    except LookupError as e:
        if name in PENDING:
            pytest.skip(f"{doc}: `{name}` is listed as to be implemented ({e})")
        pytest.fail(f"{doc} names `{name}`, which does not exist in the code: {e}. "
                    f"Fix the name in {doc} (or the code), or list it under a 'To be implemented' heading.")


def test_pending_names_are_still_pending():
    done = sorted(n for n in PENDING if _resolves(n))
    if done:
        warnings.warn(f"these names are listed as 'To be implemented' in docs/ but now exist; "
                      f"move them out of that list: {done}")


def _resolves(name):
    try:
        resolve(name)
        return True
    except LookupError:
        return False


# ----------------------------------------------------------------------------- coverage
def _modules_with_backward():
    import minitf.layers
    mods = [importlib.import_module(m) for m in ("minitf.functional", "minitf.loss", "minitf.blocks", "minitf.model",
                                                 "minitf.reference")]
    for info in pkgutil.iter_modules(minitf.layers.__path__):
        mods.append(importlib.import_module(f"minitf.layers.{info.name}"))
    return mods


def _is_backward(name):
    return name == "backward" or name.endswith("_backward")


def required_backward_names():
    """Canonical qualified names of every backward pass defined in minitf."""
    functions, methods = [], []   # (qualname, function) and (qualname, class, method name)
    for mod in _modules_with_backward():
        for name, obj in vars(mod).items():
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__ and _is_backward(name):
                functions.append((f"{mod.__name__}.{name}", obj))
            if inspect.isclass(obj) and obj.__module__ == mod.__name__:
                for meth, attr in vars(obj).items():
                    if _is_backward(meth) and callable(attr):
                        methods.append((f"{mod.__name__}.{obj.__qualname__}.{meth}", obj, meth))
    return functions, methods


def test_every_backward_pass_has_a_derivation():
    named_objects, named_methods = set(), set()
    for path in sorted(DERIVATIONS.glob("*.md")):
        for name in names_in(path.read_text(encoding="utf-8")):
            try:
                chain = resolve(name)
            except LookupError:
                continue  # reported by test_qualified_name_resolves
            named_objects.add(id(chain[-1]))
            if len(chain) >= 2:
                named_methods.add((id(chain[-2]), name.rsplit(".", 1)[1]))
    functions, methods = required_backward_names()
    assert functions and methods, "found no backward passes in minitf (did the module layout change?)"
    missing = [q for q, f in functions if id(f) not in named_objects]
    missing += [q for q, cls, meth in methods if (id(cls), meth) not in named_methods]
    assert not missing, ("these backward passes are not named (as `minitf....` in backticks) in any "
                         "docs/derivations/*.md page; add or extend a derivation: " + ", ".join(missing))


# ----------------------------------------------------------------------------- the reference
REFERENCE = ROOT / "minitf" / "reference.py"


def test_docs_readme_opens_with_the_reading_order():
    text = (DOCS / "README.md").read_text(encoding="utf-8")
    headings = [m.group(2) for m in map(HEADING_RE.match, text.splitlines()) if m]
    assert headings[:2] == ["minitf documentation", "Reading order"], f"docs/README.md's first headings: {headings[:2]}"
    order = text.split("## Reading order", 1)[1].split("\n#", 1)[0]
    steps = [order.find(what) for what in ("(../minitf/reference.py)", "(derivations/)", "(walkthrough.md)")]
    assert -1 not in steps and steps == sorted(steps), \
        "docs/README.md's reading order must link the reference, then derivations/, then walkthrough.md (the engine)"


def test_the_reference_imports_only_numpy():
    import ast
    assert REFERENCE.is_file(), "minitf/reference.py (the plain reference docs/README.md names first) is missing"
    tree = ast.parse(REFERENCE.read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"numpy"}, f"minitf/reference.py must import numpy alone (it reads without the engine): {imported}"


def test_the_references_shape_letters_are_the_legends():
    import minitf.reference
    shapes = re.search(r"^Shapes: (.*?)\n\n", minitf.reference.__doc__, re.S | re.M).group(1)
    letters = set(re.findall(r"\b([A-Z]) [a-z]", shapes))
    legend = legend_symbols()
    assert len(letters) >= 9 and letters <= legend, \
        f"minitf/reference.py's shape letters {sorted(letters - legend)} are not in docs/README.md's legend"


# ----------------------------------------------------------------------------- links
def _link_targets(text):
    return LINK_RE.findall(FENCE_RE.sub("", text))


def _normalize(target):
    target = target.split("#", 1)[0]
    while target.startswith("./"):
        target = target[2:]
    return target


def test_docs_index_links_every_page():
    index = DOCS / "README.md"
    if not index.is_file():
        pytest.fail("docs/README.md (the index of the documentation) is missing")
    targets = {_normalize(t).rstrip("/") for t in _link_targets(index.read_text(encoding="utf-8"))}
    wanted = {"paper_map.md", "deviations.md", "derivations"}
    wanted |= {f"derivations/{p.name}" for p in DERIVATIONS.glob("*.md")}
    missing = sorted(wanted - targets)
    assert not missing, f"docs/README.md does not link to: {missing}"


def test_project_readme_links_the_docs():
    readme = ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("README.md is missing at the repository root, so its links to docs/paper_map.md, "
                    "docs/deviations.md and docs/derivations/ cannot be checked yet")
    targets = [_normalize(t) for t in _link_targets(readme.read_text(encoding="utf-8"))]
    missing = [w for w in ("docs/paper_map.md", "docs/deviations.md") if w not in targets]
    if not any(t.rstrip("/") == "docs/derivations" or t.startswith("docs/derivations/") for t in targets):
        missing.append("docs/derivations/")
    assert not missing, f"README.md does not link to {missing} (add Markdown links such as [paper map](docs/paper_map.md))"


def test_relative_links_resolve():
    broken = []
    for path in doc_files():
        for t in _link_targets(path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", t) or t.startswith("#"):
                continue
            if not (path.parent / _normalize(t)).exists():
                broken.append(f"{rel(path)} -> {t}")
    assert not broken, f"broken relative links: {broken}"


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    seen, out = {}, set()
    for line in FENCE_RE.sub("", path.read_text(encoding="utf-8")).splitlines():
        h = HEADING_RE.match(line)
        if h:
            slug = _slug(h.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_link_anchors_resolve():
    # a renamed heading must not leave links into it pointing nowhere
    broken = []
    for path in [ROOT / "README.md", *doc_files()]:
        for t in _link_targets(path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", t) or "#" not in t:
                continue
            page, frag = t.split("#", 1)
            target = (path.parent / _normalize(page)) if page else path
            if target.suffix == ".md" and target.is_file() and frag not in _anchors(target):
                broken.append(f"{rel(path)} -> {t}")
    assert not broken, f"links to headings that do not exist: {broken}"


# words about how the project is worked on, which say nothing to a user of it
PROCESS_WORDS = [
    r"\bissues? ?#?\d+",                    # "issue 17", "issue #5"
    r"\(issue",                              # "(issue 17, item 6)"
    r"\b(?:the|this|that) issue(?:'s)?\b",   # "the aim"
    r"\bsessions?\b",                        # "this session", "sessions' code"
    r"\blent\b",                             # "no GPU was lent"
    r"\bhelpers?\b",
    r"(?<!exit )\bstatus\b",                 # the tool, not a process's exit status
]
PROCESS_RE = re.compile("|".join(PROCESS_WORDS), re.I)


def test_process_word_patterns():
    caught = ["(issue 17)", "Training step (issue 5)", "issue #3", "the issue's aim", "this session",
              "earlier sessions", "the sessions' code", "no GPU was lent", "a helper", "see status"]
    missed = [s for s in caught if not PROCESS_RE.search(s)]
    assert not missed, f"PROCESS_WORDS no longer catch {missed}"
    passed = ["exit status 2", "a lentil", "issues of Multi30k's tokenization", "sessionless"]
    wrong = [s for s in passed if PROCESS_RE.search(s)]
    assert not wrong, f"PROCESS_WORDS catch ordinary text: {wrong}"


def test_pages_speak_to_users():
    hits = []
    for path in [ROOT / "README.md", *doc_files()]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            hits += [f"{rel(path)}:{n}: {m.group(0)!r}" for m in PROCESS_RE.finditer(line)]
    assert not hits, ("pages mention how the project is worked on; say what the software does and "
                      "what was measured (command, machine, date) instead, e.g. 'Not yet measured on "
                      "a GPU.': " + "; ".join(hits))


def test_tables_are_well_formed():
    """Every row of a Markdown table (in the docs and the README) has as many cells as its header (a
    stray `|`, e.g. in |x| inside math, silently breaks a GitHub table) and ends on its own line (a row
    broken over two lines renders its second line as text outside the table)."""
    bad = []
    for path in [ROOT / "README.md", *doc_files()]:
        lines = FENCE_RE.sub("", path.read_text(encoding="utf-8")).splitlines()
        header = None
        for n, line in enumerate(lines, 1):
            if not line.startswith("|"):
                header = None
                continue
            if not line.rstrip().endswith("|"):
                bad.append(f"{rel(path)}:{n} does not end its row")
            cells = len(re.findall(r"(?<!\\)\|", line))
            if header is None:
                header = cells
            elif cells != header:
                bad.append(f"{rel(path)}:{n} has {cells - 1} cells, its header {header - 1}")
    assert not bad, "malformed Markdown tables: " + "; ".join(bad)


# ----------------------------------------------------------------------------- constants
def _train_default(dest):
    from minitf.train_cli import build_parser
    return build_parser().get_default(dest)


def _adam_block():
    from minitf import optim
    return optim._BLOCK


def _peak(preset):
    from minitf.config import PRESETS, Config
    cfg = Config.preset(preset)
    return cfg.lr_factor / math.sqrt(cfg.d_model * cfg.warmup), PRESETS[preset]


def _facts():
    from minitf.config import PRESETS, Config
    from minitf.data.resegment import POOL
    from minitf.masks import NEG_INF
    from minitf.model import Transformer
    from minitf.optim import Adam
    from minitf.schedule import noam
    adam = inspect.signature(Adam).parameters
    small = PRESETS["small"]
    rnn_small = Config.preset("small", arch="rnn")
    decay_only_in_small = (Config().weight_decay == 0 and small["weight_decay"] == 0.1
                           and all(not PRESETS[n].get("weight_decay") for n in ("base", "big")))
    return [
        ("derivations/layernorm.md", r"\epsilon = 10^{-5}", Config().layer_norm_eps == 1e-5),
        ("deviations.md", r"$= 10^{-5}$", Config().layer_norm_eps == 1e-5),
        ("derivations/attention.md", r"-10^9", NEG_INF == -1e9),
        ("deviations.md", r"$= -10^9$", NEG_INF == -1e9),
        ("derivations/adam.md", r"\beta_2 = 0.98", adam["betas"].default == (0.9, 0.98)),
        ("derivations/adam.md", r"\epsilon = 10^{-9}", adam["eps"].default == 1e-9),
        ("derivations/adam.md", "blocks of 32,768 elements", _adam_block() == 32768),
        ("deviations.md", "in a row (5 by default)", _train_default("max_nonfinite") == 5),
        ("deviations.md", "`--patience PATIENCE` (off by default", _train_default("patience") == 0),
        ("benchmarks.md", "warmup 1067, `lr_factor` 1.4", (small["warmup"], small["lr_factor"]) == (1067, 1.4)),
        ("benchmarks.md", r"label smoothing $\epsilon_{ls} = 0.2$", small["label_smoothing"] == 0.2),
        ("benchmarks.md", r"$P_\text{drop} = 0.2$", small["dropout"] == 0.2),
        ("benchmarks.md", "$D = 192$, $H = 4$, $F = 768$, `n_layers` 2",
         (small["d_model"], small["n_heads"], small["d_ff"], small["n_layers"]) == (192, 4, 768, 2)),
        ("benchmarks.md", "3.61M parameters with 8,000 pieces",
         f"{Transformer(Config.preset('small', vocab_size=8000)).num_parameters() / 1e6:.2f}M" == "3.61M"),
        ("benchmarks.md", "(dropout 0.1, no weight decay, label smoothing 0.1, warmup 800, factor 1.0, 4096 tokens per update)",
         (rnn_small.dropout, rnn_small.weight_decay, rnn_small.label_smoothing, rnn_small.warmup, rnn_small.lr_factor,
          rnn_small.update_tokens) == (0.1, 0, 0.1, 800, 1.0, 4096)),
        ("deviations.md", "additive attention and its own length penalty, $\\alpha = 1.5$",
         (rnn_small.attention, rnn_small.decode_alpha) == ("additive", 1.5)),
        ("deviations.md", "off in every preset\n(`attention_dropout`, `relu_dropout`",
         all(Config.preset(name).attention_dropout == Config.preset(name).relu_dropout == 0
             for name in PRESETS)),
        ("deviations.md", "off in every preset\n(`bpe_dropout_source`, `bpe_dropout_target`",
         all(Config.preset(name).bpe_dropout_source == Config.preset(name).bpe_dropout_target == 0
             for name in PRESETS)),
        ("deviations.md", "occurrence takes one of 16 segmentations", POOL == 16),
        ("data.md", "16 segmentations drawn once", POOL == 16),
        ("deviations.md", "is 0 in base and big, as in the paper, and 0.1 in the Transformer's `small`", decay_only_in_small),
        ("benchmarks.md", "decoupled weight decay $\\lambda = 0.1$", small["weight_decay"] == 0.1),
        ("derivations/adam.md", "0 in the paper's presets and 0.1 in the Transformer's `small`", decay_only_in_small),
        ("deviations.md", "(off, the paper's schedule) in every preset", all(not p.get("lr_fade") for p in PRESETS.values())
         and Config().lr_fade == 0),
        ("deviations.md", "base and big\n25000, as in the paper", PRESETS["base"]["update_tokens"] == PRESETS["big"]["update_tokens"]
         == 25000 and Config.preset("base").batch_tokens(8) == 3125),
        ("benchmarks.md", "3072 tokens per update", small["update_tokens"] == 3072),
        ("derivations/schedule.md", "6.99", f"{_peak('base')[0]:.2e}" == "6.99e-04"),
        ("derivations/schedule.md", "4.94", f"{_peak('big')[0]:.2e}" == "4.94e-04"),
        ("derivations/schedule.md", "3.09", f"{_peak('small')[0]:.2e}" == "3.09e-03"),
        ("derivations/schedule.md", "peak", noam(3999, 512, 4000) < noam(4000, 512, 4000) > noam(4001, 512, 4000)),
        ("paper_map.md", "the paper's $\\alpha = 0.6$ for base and big, 2.0 for the Transformer's `small`, 1.5 for the recurrent `small`",
         tuple(Config.preset(n).decode_alpha for n in ("base", "big", "small")) == (0.6, 0.6, 2.0)
         and Config.preset("small", arch="rnn").decode_alpha == 1.5),
        ("paper_map.md", "`update_tokens` in `minitf.config.PRESETS`, split over the ranks",
         all("update_tokens" in PRESETS[n] for n in ("base", "big", "small")) and Config().max_tokens is None),
        ("derivations/schedule.md", "it is still $\\sqrt{w/t}$ of its peak",
         all(abs(noam(t, 512, 4000) / noam(4000, 512, 4000) - (4000 / t) ** 0.5) < 1e-12 for t in (4000, 16_000, 100_000))),
    ]


FACTS = _facts()


@pytest.mark.parametrize("doc,snippet,holds", FACTS, ids=[f"{d}::{s}" for d, s, _ in FACTS])
def test_constants_quoted_in_docs_match_code(doc, snippet, holds):
    text = (DOCS / doc).read_text(encoding="utf-8")
    assert snippet in text, f"docs/{doc} no longer quotes {snippet!r}; update this test or the doc"
    assert holds, f"docs/{doc} quotes {snippet!r}, but the code no longer agrees: update the doc"


def runnable_blocks(path):
    """The ```python blocks of a page whose first line is RUNS_MARK, in order."""
    blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    return [b for b in blocks if b.startswith(RUNS_MARK)]


CONTINUES = "# continues the block above"   # a block's second line when it needs the names of the ones before it


@pytest.mark.parametrize("doc", [d for d in doc_files() if runnable_blocks(d)], ids=rel)
def test_runnable_blocks_of_a_page_run(doc):
    # a page's result is executable: each marked block runs alone, in a fresh namespace (as a reader
    # who copies it runs it), unless its second line says it continues the block above: then in that
    # block's namespace; and the asserts hold against the code as it is today
    namespace = {}
    for i, block in enumerate(runnable_blocks(doc)):
        if block.splitlines()[1:2] != [CONTINUES]:
            namespace = {}
        exec(compile(block, f"{rel(doc)} block {i + 1}", "exec"), namespace)


def test_every_derivation_page_has_a_runnable_result():
    # a page cannot drift silently: its result runs against the code in this suite
    missing = [rel(p) for p in sorted(DERIVATIONS.glob("*.md")) if not runnable_blocks(p)]
    assert not missing, f"derivation pages without a '{RUNS_MARK}' block: {missing}"
    assert len(runnable_blocks(DERIVATIONS / "decoding.md")) >= 2


def test_the_maintainers_map_names_files_and_tests_that_exist():
    """docs/README.md's "Where to change what": every file and folder a row names exists, every
    `tests/...py::test_name` names a test that exists, and each row names at least one test file."""
    import re
    text = (DOCS / "README.md").read_text(encoding="utf-8")
    section = text.split("## Where to change what", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| To change") and "---" not in r]
    assert len(rows) >= 6, rows
    for row in rows:
        paths = re.findall(r"`((?:minitf|tests|docs)/[\w/.]*)(?:::(\w+))?`", row)
        assert any(p.startswith("tests/") for p, _ in paths), f"a row names no test: {row[:80]}"
        for path, test in paths:
            assert (ROOT / path).exists(), f"docs/README.md's map names {path}, which does not exist"
            if test:
                assert f"def {test}(" in (ROOT / path).read_text(encoding="utf-8"), f"{path} has no {test}"


def test_no_page_holds_a_tab_character():
    """A tab in a page is how a backslash escape got lost on the way in (`\\top` written as a tab and
    "op"): the formulas render broken. Every page is tab-free."""
    for path in [ROOT / "README.md", *doc_files()]:
        bad = [i + 1 for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()) if "\t" in line]
        assert not bad, f"{rel(path)} has tab characters on lines {bad[:5]}"


def test_the_small_presets_table_in_deviations_is_the_preset():
    """deviations.md item 17's table: each `field` = value of its first column is the `small` preset's."""
    text = (DOCS / "deviations.md").read_text(encoding="utf-8")
    part = text[text.index("**17. The `small` preset"):text.index("**18. Precision.**")]
    from minitf.config import PRESETS, Config
    cfg = Config.preset("small", vocab_size=8000)
    pairs = re.findall(r"`(\w+)` = ([\w.]+)", "\n".join(line.split("|")[1] for line in part.splitlines()
                                                       if line.startswith("| `")))
    assert len(pairs) >= 12, pairs
    for field, value in pairs:
        have = getattr(cfg, field)
        assert str(have) == value or (isinstance(have, (int, float)) and float(value) == have), (field, value, have)
    assert {f for f, _ in pairs} >= set(PRESETS["small"]), "a field of the preset is not in the table"


def test_the_german_sides_piece_count_is_the_recorded_one_wherever_it_is_quoted():
    """The pieces of Multi30k's German side (the `small` preset's output layer) are counted once, in
    benchmarks.md's record of the tokenizer's run; every other page quotes that count."""
    bench = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    unigram, bpe = re.search(r"([\d,]+) of them occur on the German side, against BPE's ([\d,]+)", bench).groups()
    quotes = {ROOT / "README.md": [f"German side's {unigram}"],
              DOCS / "deviations.md": [f"that is {unigram} of them with the unigram tokenizer ({bpe} with BPE"],
              DOCS / "performance.md": [f"{unigram} of 8,000 on Multi30k's German side", f"{bpe} with BPE"],
              ROOT / "minitf" / "layers" / "embedding.py": [f"{unigram} of 8,000 on Multi30k's German side"]}
    for path, snippets in quotes.items():
        text = path.read_text(encoding="utf-8")
        for snippet in snippets:
            assert snippet in text, f"{path.name} no longer quotes {snippet!r} (benchmarks.md records {unigram}/{bpe})"
    pages = [ROOT / "README.md", *[p for p in DOCS.rglob("*.md") if p.name != "benchmarks.md"],
             *(ROOT / "minitf").rglob("*.py")]
    for path in pages:   # no other count of those pieces anywhere else
        for n in re.findall(r"\b(5,4\d\d)\b", path.read_text(encoding="utf-8")):
            assert n in (unigram, bpe), f"{path.name} quotes {n} pieces; benchmarks.md records {unigram} ({bpe} with BPE)"


def test_the_walkthroughs_call_chain_is_the_engines_update():
    """walkthrough.md's call-by-call table: each name is at the file:line given, and a traced update of
    a tiny model (forward_backward, then step_stats, learning_rate, Adam.step, as take_step and finish_on_host call them)
    makes those calls in the table's order."""
    import sys as _sys
    import numpy as np
    import minitf
    from minitf.schedule import learning_rate
    from minitf.train import finish_on_host, forward_backward, step_stats, take_step, update_rate
    text = (DOCS / "walkthrough.md").read_text(encoding="utf-8")
    part = text[text.index("## One update in the engine, call by call"):text.index("## What the engine does differently")]
    rows = re.findall(r"^\| (\d+) \| `(minitf\.[\w.]+)` \| (minitf/[\w/]+\.py):(\d+) \|", part, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 20
    where = []
    for _, name, path, line in rows:
        obj = resolve(name)[-1]
        src_file, src_line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
        assert Path(src_file).resolve() == (ROOT / path).resolve() and src_line == int(line), (
            f"walkthrough.md puts {name} at {path}:{line}; it is at {Path(src_file).relative_to(ROOT)}:{src_line}")
        where.append((str(Path(src_file).resolve()), src_line))
    # take_step calls row 2, then (on the CPU) finish_on_host: step_stats, learning_rate and Adam.step, in order
    body = inspect.getsource(take_step)
    assert body.index("forward_backward(") < body.index("finish_on_host(")
    body = inspect.getsource(finish_on_host)
    assert body.index("step_stats(") < body.index("update_rate(") < body.index("opt.step(")
    assert "learning_rate(" in inspect.getsource(update_rate)
    cfg = minitf.Config(vocab_size=13, d_model=8, n_heads=2, d_ff=12, n_layers=1, dropout=0.2, max_len=16)
    model = minitf.Transformer(cfg, seed=0)
    opt = minitf.Adam(model, lr=1e-3)
    src = np.array([[5, 6, 7, 3, 0], [9, 10, 5, 6, 3]])
    tgt_in, tgt_out = np.array([[2, 4, 6, 0], [2, 7, 5, 8]]), np.array([[4, 6, 3, 0], [7, 5, 8, 3]])
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append((str(Path(frame.f_code.co_filename).resolve()), frame.f_code.co_firstlineno))
    calls.append(where[0])   # take_step itself (the run object it needs is not built here)
    _sys.setprofile(profile)
    try:
        loss_sum, nll_sum = forward_backward(model, [(0, (src, tgt_in, tgt_out, 7))], 7, 0)
        step_stats(model, loss_sum, nll_sum)
        opt.step(lr=learning_rate(1, cfg.d_model, cfg.warmup))
    finally:
        _sys.setprofile(None)
    at = 0
    for (_, name, _, _), w in zip(rows, where):
        assert w in calls[at:], f"walkthrough.md row {name}: not called after the row before it in a traced update"
        at = calls.index(w, at) + 1


def legend_symbols():
    """The symbols of docs/README.md's shape legend ($B$, $N_t$, $V_o$, $R'$, ...)."""
    text = (DOCS / "README.md").read_text(encoding="utf-8")
    part = text[text.index("## Shape legend"):]
    part = part[:part.index("\n\n", part.index("| Letter"))]
    out = set()
    for line in part.splitlines()[2:]:
        first = line.split("|")[1]
        out |= {m.replace("\\text", "").replace("{", "").replace("}", "") for m in re.findall(r"\$([^$]+)\$", first)}
    return out


def test_every_shape_bracket_of_the_pages_uses_the_legends_letters():
    """One legend: an upper-case symbol inside a shape bracket (`[B, T, D]`, $[N_t, D]$) on any page,
    docstring or comment is one of the legend's; N is never redefined as a row count or layers (`$N = B...`, `N = 6` as a
    shape)."""
    legend = legend_symbols()
    assert {"B", "S", "T", "D", "H", "K", "F", "V", "N", "N_t", "N_s", "V_o", "R", "R'", "L"} <= legend, legend
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "minitf").rglob("*.py"))]
    unknown = {}
    for page in pages:
        text = page.read_text(encoding="utf-8")
        brackets = re.findall(r"`\[([^\]`]+)\]`", text) if page.suffix == ".md" else re.findall(r"\[([^\]\n]+)\]", text)
        for bracket in brackets:
            if "," not in bracket and not re.fullmatch(r"[A-Z](_\w+)?'?", bracket.strip()):
                continue
            for tok in re.split(r"[\s,*·+/()-]+", bracket):
                if (re.fullmatch(r"[A-Z](_[a-z]+)?'?", tok) or re.fullmatch(r"N[a-z]{1,3}", tok) and tok != "None"
                        or re.fullmatch(r"[A-Z]{2,3}", tok)) and tok not in legend:   # HK: two letters run together
                    unknown.setdefault(tok, set()).add(rel(page))
        assert not re.search(r"\$N = B|\bN = (B|b|kept|cfg)|\(N kept", text), f"{rel(page)} redefines N (rows, layers)"
    assert not unknown, f"shape letters the legend (docs/README.md) does not list: {unknown}"


LEGEND_LETTERS = ("B", "S", "T", "D", "H", "K", "F", "V", "N", "L", "R")


def _is_count(rhs):
    """Whether a code block's value for a legend letter is a count: an integer, or one read from a
    config, a shape or a length."""
    rhs = rhs.strip()
    return bool(re.fullmatch(r"\d+", rhs)) or any(k in rhs for k in ("cfg.", "shape", "len(", "int(", ".size"))


def test_a_legend_letter_keeps_its_meaning_in_code_blocks_and_formulas():
    """A page's code blocks give a legend letter a count (`B, S, T = 2, 5, 4`, `D = cfg.d_model`), never
    another quantity (a loss scale `S = 2.0 ** 15`, an array `K = att.keys(memory)`, a float); a formula
    defining one (`$K = ...$`) gives it a number or the legend's own meaning."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    bad = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M):
            for line in block.splitlines():
                m = re.match(r"^\s*((?:\w+\s*,\s*)*\w+)\s*=(?!=)(.*?)(#.*)?$", line)
                if not m:
                    continue
                names = [n.strip() for n in m.group(1).split(",")]
                values = m.group(2).split(",") if len(names) > 1 else [m.group(2)]
                if len(values) != len(names):
                    values = [m.group(2)] * len(names)
                bad += [f"{rel(page)}: {line.strip()}" for n, v in zip(names, values)
                        if n in LEGEND_LETTERS and not _is_count(v)]
        for name, rhs in re.findall(r"\$\s*([A-Z])\s*=\s*([^$]+)\$", text):
            # (4D: a width; \sum_n w_n: the loss's count of its 0/1 token weights, the legend's N)
            if name in LEGEND_LETTERS and not (re.match(r"\d", rhs.strip()) or rhs.strip() in ("4D", "\\sum_n w_n")):
                bad.append(f"{rel(page)}: ${name} = {rhs}$")
    assert not bad, f"legend letters given another meaning: {bad}"


def test_a_legend_letter_is_never_an_array_in_a_formula():
    """In the pages' formulas a legend letter is a size: never an array indexed by a subscript
    ($P_{pos}$ for the positions, $H_{prev}$), transposed ($X^\\top$) or multiplied elementwise
    ($h \\odot M$ for a dropout mask); the legend's own subscripted symbols ($N_t$, $N_s$, $V_o$, ...)
    are sizes too."""
    legend = legend_symbols()
    as_array = re.compile(r"(?<![\\\w{])([BSTDHKFVNLRIOPMAQ])(_\{[^}]*\}|_[a-z0-9]|\^\\top|\^T\b|\s*\\odot)"
                          r"|\\odot\s*([BSTDHKFVNLRIOPMAQ])(?![\w{])")
    bad = []
    for page in sorted(DOCS.rglob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for formula in re.findall(r"\$\$.*?\$\$|\$[^$]+\$", text, flags=re.S):
            for m in as_array.finditer(formula):
                symbol = (m.group(1) or "") + (m.group(2) or "")
                if symbol.replace("\\text", "").replace("{", "").replace("}", "") not in legend:
                    bad.append(f"{rel(page)}: {formula.strip()[:80]!r}")
    assert not bad, f"legend letters used as arrays: {bad}"


def test_a_command_lines_placeholders_are_not_legend_letters():
    """A placeholder in a command line or a path (`--seed SEED`, `--beam BEAM`, `--output AVG.npz`,
    `runs/RUN/`) is a word, not a single capital read as a symbol (`--seed S`, `--beam B`,
    `--bidirectional-epochs E`, `A.npz`, `runs/R/`); the legend's own meaning is fine (`--vocab-size V`, a
    dropout `P`)."""
    same_meaning = {("vocab-size", "V"), ("dropout", "P")}
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for flag, letter in re.findall(r"--([a-z][a-z-]+) ([A-Z])(?![\w\[.])", text):
            if (flag, letter) not in same_meaning:   # a single capital is read as a symbol (E, the embedding; W, a weight)
                bad.append(f"{rel(page)}: --{flag} {letter}")
        bad += [f"{rel(page)}: {m}" for m in re.findall(r"(?<=[ /`(])[BSTDHKFVNLRIOPQMA]\.(?:npz|en|de|gz|txt|json)\b"
                                                        r"|runs/[A-Z]/", text)]
    assert not bad, f"placeholders that are legend letters: {bad}"


def test_blocks_that_need_a_runs_files_say_so_at_their_top():
    """A code block of the README or a page that opens a model or files a run writes (`runs/...`, an
    OPUS-MT folder) says on its first line what it needs, so a reader who copies it alone knows."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for lang, block in re.findall(r"^```(python|bash)\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M):
            written = re.findall(r"--out (runs/\S+)", block)          # what the block makes itself
            read = [p for p in re.findall(r"(?:--checkpoint |--log |load\(\")(\S+?)[\s\"]", block)
                    if not any(p.startswith(w) for w in written)]
            if read and not block.startswith("# needs ") and not block.startswith(RUNS_MARK):
                bad.append(f"{rel(page)}: {block.splitlines()[0]}")
    assert not bad, f"blocks that need a run's files without saying so: {bad}"


def test_blocks_with_placeholders_or_outside_needs_say_so_at_their_top():
    """A bash block that cannot run as written (a `...` for more flags, a `$VARIABLE`, `<this repo>` or
    SEED placeholder, mpiexec, srun, or a GPU) starts with `# needs ...` saying what it needs."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M):
            code = "\n".join(line.split("#")[0] for line in block.splitlines())
            if re.search(r"\.\.\.|\$[A-Z]|<[a-z][^>]*>|\bSEED\b|\bmpiexec\b|\bsrun\b|--device gpu", code) and \
                    not block.startswith("# needs ") and not block.startswith(RUNS_MARK):
                bad.append(f"{rel(page)}: {block.splitlines()[0]}")
    assert not bad, f"blocks that cannot run as written and do not say what they need: {bad}"


def test_formulas_write_a_transpose_and_big_o_apart_from_the_legends_letters():
    """In a formula a transpose is `^\\top` (`^T` would read as the target length T) and big-O is
    `\\mathcal O` (the legend's O is an output width)."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        if page.name == "benchmarks.md":   # measurement records, quoted as measured
            continue
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for formula in re.findall(r"\$\$.*?\$\$|\$[^$]+\$", text, flags=re.S):
            if re.search(r"\^T\b|\^\{T\}|(?<!\\mathcal )(?<![A-Za-z\\])O\(", formula):
                bad.append(f"{rel(page)}: {formula.strip()[:80]!r}")
    assert not bad, f"a transpose or big-O written with a legend letter: {bad}"


def test_the_loops_docstrings_name_every_reason_a_run_stops():
    """run_loop says what it returns: every reason should_stop gives (and the CLI's beam-search stop
    rules are every rule Translator.translate's docstring names)."""
    from minitf import train, translate
    from minitf.cli import build_parser
    reasons = set(re.findall(r'return "(\w+)"', inspect.getsource(train.should_stop)))
    assert {"max_steps", "patience", "time_budget"} <= reasons
    assert all(f'"{r}"' in train.run_loop.__doc__ for r in reasons), (reasons, train.run_loop.__doc__)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["translate"]
    rules = next(a for a in sub._actions if a.dest == "stop").choices
    assert all(f'"{r}"' in translate.Translator.translate.__doc__ for r in rules), rules


def test_the_readmes_gpu_step_figures_are_the_recorded_ones():
    """The README's GPU training-step ratios and rates are those of the table the README links to in
    benchmarks.md, computed from its tokens/s and rounded, not retyped; the table's own ratios are its tokens/s'."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    bench = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| minitf vs the same model in PyTorch, one NVIDIA"))
    anchor = re.search(r"\(docs/benchmarks\.md#([\w-]+)\)", row).group(1)
    section = bench[[m.start() for m in re.finditer(r"^### .*$", bench, re.M)
                     if _slug(m.group(0)[4:]) == anchor][0]:]
    num = lambda x: int(x.replace(",", ""))
    table = {}
    for m in re.finditer(r"^\| (base|big) \| (float32 \(TF32\)|`--fp16`|`--bf16`) \| ([\d,]+) \([\d.]+\) \| ([\d,]+) "
                         r"\([\d.]+\) \| \*\*([\d.]+)\*\* \| ([\d,]+) \([\d.]+\) \| \*\*([\d.]+)\*\* \|", section, re.M):
        ours, eager, strong = num(m.group(3)), num(m.group(4)), num(m.group(6))
        assert abs(float(m.group(5)) - ours / eager) < 6e-4 and abs(float(m.group(7)) - ours / strong) < 6e-4, m.group(0)
        table[m.group(1), m.group(2).strip("`-")] = (ours, ours / eager, ours / strong)
    assert len(table) == 6, table
    r2 = lambda key, i: f"{table[key][i]:.2f}x"
    k = lambda key: f"{round(table[key][0] / 1000)}k"
    b16, bb, b32 = ("base", "fp16"), ("base", "bf16"), ("base", "float32 (TF32)")
    for quoted in (f"{r2(b16, 1)} PyTorch AMP eager's tokens/s with `--fp16` ({k(b16)} target tokens/s)",
                   f"{r2(bb, 1)} with `--bf16` ({k(bb)})", f"{r2(b32, 1)} eager's in float32 (TF32, {k(b32)})",
                   f"{r2(b16, 2)}, {r2(bb, 2)} and {r2(b32, 2)} a strong PyTorch",
                   f"big: {r2(('big', 'fp16'), 1)} eager under `--fp16`, {r2(('big', 'bf16'), 1)} under `--bf16`, "
                   f"{r2(('big', 'float32 (TF32)'), 1)} in float32"):
        assert quoted in row, f"README.md's GPU row no longer quotes {quoted!r} (benchmarks.md: {table})"


def test_the_table1_complexity_table_is_the_recorded_json():
    """rnn_vs_transformer.md's milliseconds against n are table1.json's seconds, each rounded as printed
    (three significant figures, at most two decimals), not retyped."""
    import json
    data = json.loads((DOCS / "img" / "table1.json").read_text(encoding="utf-8"))
    seconds = {row["n"]: row["seconds"] for row in data["by_n"]}
    page = (DOCS / "rnn_vs_transformer.md").read_text(encoding="utf-8")
    header = re.search(r"^\| \$n\$ \|(.*)\|$", page, re.M)
    ns = [int(x) for x in header.group(1).split("|")]
    rows = {"self-attention (the attention itself)": "self-attention", "self-attention with its projections":
            "self-attention+", "recurrent (LSTM)": "recurrent", "convolutional ($k = 3$)": "convolutional"}
    for label, key in rows.items():
        cells = re.search(rf"^\| {re.escape(label)} \|(.*)\|$", page, re.M).group(1).split("|")
        for n, cell in zip(ns, cells):
            ms, shown = 1e3 * seconds[n][key], cell.strip()
            decimals = len(shown.split(".")[1]) if "." in shown else 0
            assert shown == f"{ms:.{decimals}f}", f"{label} at n = {n}: the page says {shown}, table1.json {ms:.3f} ms"


def test_the_walkthroughs_figures_are_the_recorded_ones():
    """The speed figures the walkthrough quotes are computed from their records, not retyped: the
    padded 256-wide step's ratio and the unpadded ones from benchmarks.md's step table, Adam's one
    pass / blocks from performance.md."""
    walk = (DOCS / "walkthrough.md").read_text(encoding="utf-8")
    bench = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    perf = (DOCS / "performance.md").read_text(encoding="utf-8")
    padded = float(re.search(r"\| small \(D 256[^|]*\| padded \|.*\*\*([\d.]+)\*\* \|", bench).group(1))
    unpadded = float(re.search(r"\| small \| no padding \|.*\*\*([\d.]+)\*\* \|", bench).group(1))
    second = float(re.search(r"gave small\s+\*\*([\d.]+)\*\*", bench).group(1))
    lo, hi = sorted((unpadded, second))
    assert f"is {padded:.2f}x as fast as PyTorch eager's, against {lo:.2f}-{hi:.2f}x on a batch without padding" in walk
    one, blocks = re.search(r"([\d.]+) ms per update as one pass, ([\d.]+) ms in blocks", perf).groups()
    assert f"{one} ms per update as one pass, {blocks} ms in blocks, {float(one) / float(blocks):.2f}x" in walk


def quoted_commands(pattern):
    """(page, in a code block, the match, its arguments) of every command matching `pattern` (its last group the
    arguments) that the README and docs quote: in fenced blocks (lines joined where they end in a backslash) and
    code spans (which may wrap a line); the arguments stop at a shell operator or comment."""
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        blocks = [b.replace("\\\n", " ") for b in FENCE_RE.findall(text)]
        spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", FENCE_RE.sub("", text))]
        for block, chunk in [(True, b) for b in blocks] + [(False, s) for s in spans]:
            for m in re.finditer(pattern, chunk):
                yield rel(page), block, m, re.split(r"\s(?:&&|\||;|2>&1|>|#)", m.group(m.lastindex))[0].strip()


def bench_commands():
    """(page, script, arguments) of every `python bench/NAME.py ...` command the pages quote, `$VARIABLES`
    standing for a value."""
    return [(page, m.group(1), re.sub(r"\$\{?[A-Z_0-9]+\}?", "x", args))
            for page, _, m, args in quoted_commands(r"python (bench/[a-z_0-9]+\.py)([^`\n]*)")]


def test_every_bench_command_the_pages_quote_parses(monkeypatch):
    """Each `python bench/NAME.py ...` command quoted in the README and docs parses with that script's
    own argument parser as it is today (every flag exists, every required one is given, every value
    is of the flag's type and choices), so a page cannot keep a command the script no longer takes; the
    script stops right after parsing. Commands shortened with `...` are left out; one holding a `<placeholder>`
    fails (a shell reads it as a redirection)."""
    import argparse
    import contextlib
    import io
    import shlex
    import sys

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.delenv("MULTI30K", raising=False)   # a default some scripts take from the environment
    commands = bench_commands()
    assert len(commands) >= 50 and {s for _, s, _ in commands} >= {"bench/gpu_report.py", "bench/train_step.py"}
    bad, checked = [], 0
    saved_argv = sys.argv
    try:
        argparse.ArgumentParser.parse_args = parse_and_stop
        for page, script, args in commands:
            if "<" in args:   # a shell reads `<word` as a redirection: a placeholder there breaks the command
                bad.append(f"{page}: {script} {args}: a <placeholder> (write the value, or shorten with ...)")
                continue
            if "..." in args:
                continue
            argv = shlex.split(args)
            main = importlib.import_module(script[:-3].replace("/", ".")).main
            sys.argv = [script, *argv]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    main(argv) if "argv" in inspect.signature(main).parameters else main()
                bad.append(f"{page}: {script} {args}: the script did not parse its arguments")
            except Parsed:
                checked += 1
            except SystemExit:
                bad.append(f"{page}: {script} {args}: {err.getvalue().strip().splitlines()[-1:]}")
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = saved_argv
    assert not bad, "\n".join(bad)
    assert checked >= 50


def test_every_flag_of_a_quoted_minitf_command_exists():
    """Each `--flag` of a `python train_wmt.py`, `minitf-train`, `python -m minitf SUB` or `minitf SUB`
    command quoted in the README and docs is one its parser (the sub-command's, e.g. `plot pe`'s) has
    today, and a command in a code block gives every flag its parser requires (a code span in a sentence
    may name a command by one of its flags); commands shortened with `...` are left out. (Values are not checked: the pages write placeholders such as SEED and ALPHA;
    tests/test_readme.py runs the README's commands.)"""
    import argparse

    from minitf import cli, train_cli

    def subparser(parser, words):
        used = 0
        for w in words:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            if not subs or w not in subs[0].choices:
                break
            parser, used = subs[0].choices[w], used + 1
        return parser, words[used:]

    bad, flags = [], 0
    pattern = r"(?:python (train_wmt\.py|-m minitf)|(minitf-train)|(?<![\w/.-])minitf)([^`\n]*)"
    for page, block, m, args in quoted_commands(pattern):
        words = args.split()
        if "..." in words:
            continue
        if m.group(1) == "train_wmt.py" or m.group(2):
            parser = train_cli.build_parser()
        elif words[:1] == ["train"]:
            parser, words = train_cli.build_parser(), words[1:]
        else:
            parser, words = subparser(cli.build_parser(), words)
        given = [w.split("=")[0] for w in words if w.startswith("--")]
        for flag in given:
            flags += 1
            if flag not in parser._option_string_actions:
                bad.append(f"{page}: {m.group(0).strip()}: {flag}")
        missing = [a.option_strings[0] for a in parser._actions
                   if a.required and a.option_strings and not set(a.option_strings) & set(given)]
        if block and given and missing:   # a command in a code block lacks a required flag
            bad.append(f"{page}: {m.group(0).strip()}: needs {', '.join(missing)}")
    assert not bad, "\n".join(bad)
    assert flags >= 300


def test_no_link_sits_inside_math():
    """A markdown link inside `$...$` or `$$...$$` renders as LaTeX text, not a link: every page keeps
    its links outside its formulas (code blocks aside)."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = FENCE_RE.sub("", page.read_text(encoding="utf-8"))
        text = re.sub(r"`[^`\n]*`", "", text)
        for formula in re.findall(r"\$\$.*?\$\$|\$[^$\n]+\$", text, flags=re.S):
            if LINK_RE.search(formula):
                bad.append(f"{rel(page)}: {formula[:80]}")
    assert not bad, "\n".join(bad)


def test_no_prose_line_starts_a_list_by_accident():
    """A line of running text that starts with `+ ` begins a bullet list (CommonMark lets a bullet
    interrupt a paragraph), breaking the paragraph it belongs to: no page has one outside code."""
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        lines = FENCE_RE.sub("", page.read_text(encoding="utf-8")).splitlines()
        bad += [f"{rel(page)}: {line[:60]}" for line in lines if line.startswith("+ ")]
    assert not bad, bad


def test_the_bench_scripts_placeholders_are_not_legend_letters():
    """A bench script's flag placeholder (`--steps-per-round STEPS`, `--also-seed SEED`) is a word, not a single
    capital that the legend gives another meaning (K is d_k, N the tokens with a loss, S the source length):
    the same rule as the pages' command lines, over every `add_argument` of every bench script, the explicit
    metavar or argparse's default (the flag's name in capitals). Read from the source, so scripts that need
    torch are checked without it."""
    import ast

    same_meaning = {"V", "P"}
    no_value = {"store_true", "store_false", "count", "store_const", "append_const", "help", "version"}
    bad, seen = [], 0
    for script in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
            if not flags:
                continue
            seen += 1
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(kw.get("action"), ast.Constant) and kw["action"].value in no_value:
                continue
            if isinstance(kw.get("metavar"), ast.Constant):
                shown = kw["metavar"].value
            else:
                long = max(flags, key=len)
                shown = (kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else long.lstrip("-")).replace("-", "_").upper()
            if isinstance(shown, str) and re.fullmatch(r"[A-Z]", shown) and shown not in same_meaning:
                bad.append(f"bench/{script.name}: {'/'.join(flags)} {shown}")
    assert seen >= 100
    assert not bad, bad
