"""`python -m minitf plot pe|lr|curves|attention|masks|packing|table1`: pictures of the model and of a run.

    plot pe         the sinusoidal positional encoding (paper 3.5) and its two properties:
                    every position has the same norm, and the distance between two
                    positions depends only on their offset (printed for 10 positions at D = 10:
                    --table-n, --table-d)
    plot lr         the learning-rate schedule of 5.3 (eq. 3), peak marked at `warmup`
    plot curves     loss, perplexity, BLEU/chrF and learning rate of a run (train_log.jsonl)
    plot attention  encoder self-, masked decoder self- and encoder-decoder attention of
                    one layer and head for one sentence
    plot masks      which keys each query may see: padding (encoder, cross-attention) and
                    causal + padding (decoder), for a batch of sentences of different lengths
    plot packing    pad-free rows: a padded [B, L] batch and the rows the position-wise
                    layers run on in training
    plot table1     the paper's Table 1 measured on minitf's layers (bench/table1.py's JSON):
                    self-attention, recurrent and convolutional layers

The numbers behind the pictures are pure NumPy functions (`pe_norms`,
`pe_distance_by_offset`, `noam_curve`, `read_train_log`, `attention_maps`), testable without
matplotlib. matplotlib (the `viz` extra) is imported only inside the plotting functions,
which draw on an Agg canvas (no display, no change to pyplot's global backend).
"""
import argparse
import json
import math
import os
import sys

import numpy as np

from .errors import ConfigError, DataError, MinitfError
from .fileio import check_output_file
from .flags import MAX_ALPHA, MAX_BEAM, MAX_LEN_B, Number, fraction, path_arg, positive
from .trainlog import plural
from .validation import NLL_CAP

DPI = 100
PICTURE_MAX = 100_000    # positions or widths a picture draws: past any model, before the arrays run out of memory
MAX_STEPS = 10 ** 9      # updates a schedule draws (the paper's big model: 300,000)
DRAWN_LEN = 100          # a sentence's positions in the masks and packing pictures, each a labelled cell
DRAWN_ROWS = 200         # the packed rows the packing picture labels, all sentences together
FORMATS = ("png", "svg", "pdf")


# ------------------------------------------------------------------------------ matplotlib
def _figure(width, height):
    """A matplotlib Figure attached to an Agg canvas; MinitfError if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MinitfError(NO_MATPLOTLIB) from None
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


NO_MATPLOTLIB = "matplotlib is not installed: pip install matplotlib (in a clone: pip install -e \".[viz]\")"


def _need_matplotlib():
    """MinitfError unless matplotlib is there: called once a plot's input is checked and before its costly work (a
    translation, a printed table), which had run first and then failed."""
    import importlib
    try:
        importlib.import_module("matplotlib")   # only whether it imports
    except ImportError:
        raise MinitfError(NO_MATPLOTLIB) from None


def _check_out(out):
    fmt = os.path.splitext(os.fspath(out))[1].lower().lstrip(".")
    if fmt not in FORMATS:
        raise ConfigError(f"--out {out}: the file name must end in .png, .svg or .pdf")
    check_output_file(out, "--out")
    return fmt


def _save(fig, out):
    from .fileio import WriteFailed, atomic_write
    fmt = _check_out(out)
    try:
        atomic_write(out, lambda f: fig.savefig(f, format=fmt, dpi=DPI))   # mode 0666 less the umask
    except WriteFailed as e:
        raise DataError(f"--out {out}: cannot write the picture ({e.reason})") from None
    print(f"wrote {out}", file=sys.stderr)


# ------------------------------------------------------------------------------ positional encoding
def pe_norms(table):
    """table [n, D] -> [n] Euclidean norm of every position's vector.

    For the sinusoids with D even each position holds D/2 pairs (sin a, cos a), each of
    squared norm 1, so every norm is exactly sqrt(D/2).
    """
    return np.sqrt((np.asarray(table, dtype=np.float64) ** 2).sum(axis=1))


def pe_distance_by_offset(table, start=0):
    """table [n, D] -> [n - start]: entry k is ||PE(start) - PE(start + k)||.

    For the sinusoids ||PE(p) - PE(p+k)||^2 = sum_i 2 - 2 cos(k w_i) = 4 sum_i sin^2(k w_i / 2)
    (w_i = 10000^(-2i/D)): a function of the offset k alone, the same for every start p.
    """
    t = np.asarray(table, dtype=np.float64)
    if not 0 <= start < t.shape[0]:
        raise ConfigError(f"start {start} is outside the table's {t.shape[0]} positions")
    return np.sqrt(((t[start:] - t[start]) ** 2).sum(axis=1))


def pe_distance_matrix(table):
    """table [n, D] -> [n, n] distances ||PE(p) - PE(q)|| (a Toeplitz matrix for the sinusoids)."""
    t = np.asarray(table, dtype=np.float64)
    sq = (t ** 2).sum(axis=1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * t @ t.T
    return np.sqrt(np.maximum(d2, 0.0))


def _check_pe_size(max_len, d_model, what="--max-len/--d-model"):
    if max_len < 2 or d_model < 2 or d_model % 2:
        raise ConfigError(f"{what}: need at least 2 positions and an even d_model >= 2, "
                          f"got {max_len} positions and d_model {d_model}")


def pe_report(n=10, d=10):
    """The text table `plot pe` prints: norms and distances of the first n positions for d = D."""
    from .layers.positional import sinusoid_table
    _check_pe_size(n, d, "table size")
    t = sinusoid_table(n, d)
    norms, dist = pe_norms(t), pe_distance_matrix(t)
    by_k = pe_distance_by_offset(t)
    spread = max(float(np.ptp(np.diagonal(dist, k))) for k in range(n))
    lines = [f"sinusoidal positional encoding, first {n} positions, d_model = {d}",
             (f"norm of every position: sqrt(d/2) = {math.sqrt(d / 2):.4f} "
              f"(largest deviation {np.abs(norms - math.sqrt(d / 2)).max():.1e})"),
             "distance ||PE(p) - PE(q)||:",
             "pos    norm  " + " ".join(f"{q:>6d}" for q in range(n))]
    for p in range(n):
        lines.append(f"{p:>3d}  {norms[p]:.4f} " + " ".join(f"{x:6.4f}" for x in dist[p]))
    lines.append("distance by offset k = |p - q| (the same for every p: largest spread "
                 f"{spread:.1e}):")
    lines.append("  k  " + " ".join(f"{k:>6d}" for k in range(n)))
    lines.append("     " + " ".join(f"{x:6.4f}" for x in by_k))
    falls = np.flatnonzero(np.diff(by_k) <= 0)
    if falls.size:
        lines.append(f"not monotonic: the distance grows up to offset {int(falls[0])}, then falls (the fastest "
                     f"pair of dimensions, sin(pos) and cos(pos), repeats every 2*pi = {2 * math.pi:.2f} positions)")
    return "\n".join(lines)


def plot_pe(out, max_len=100, d_model=128, table_n=10, table_d=10):
    """Heatmap of sinusoid_table(max_len, d_model), norm vs position, distance vs offset;
    prints pe_report(table_n, table_d)."""
    from .layers.positional import sinusoid_table
    _check_out(out)
    _check_pe_size(max_len, d_model)
    _check_pe_size(table_n, table_d, "--table-n/--table-d")
    _need_matplotlib()
    print(pe_report(table_n, table_d))
    t = sinusoid_table(max_len, d_model)
    fig = _figure(11, 7.5)
    gs = fig.add_gridspec(2, 2, height_ratios=[1.25, 1])
    ax = fig.add_subplot(gs[0, :])
    half = d_model // 2   # sin dimensions 2i below, cos dimensions 2i+1 above, i = frequency index
    im = ax.imshow(np.concatenate([t[:, 0::2], t[:, 1::2]], axis=1).T, aspect="auto", cmap="RdBu_r",
                   vmin=-1, vmax=1, interpolation="nearest", origin="lower")
    ax.axhline(half - 0.5, color="k", lw=1)
    ax.set_yticks([0, half // 2, half, half + half // 2],
                  ["sin, i=0", f"sin, i={half // 2}", "cos, i=0", f"cos, i={half // 2}"])
    ax.set_ylabel(f"dimension 2i (sin) / 2i+1 (cos), i < {half}")
    ax.set_xlabel("position pos")
    ax.set_title(f"PE(pos, 2i) = sin(pos / 10000^(2i/d)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d)),  "
                 f"d = {d_model}")
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01)

    ax = fig.add_subplot(gs[1, 0])
    ax.plot(np.arange(max_len), pe_norms(t), lw=5, alpha=0.6, label="||PE(pos)||")
    ax.axhline(math.sqrt(d_model / 2), color="k", ls="--", lw=1, label=f"sqrt(d/2) = {math.sqrt(d_model / 2):.3f}")
    ax.set_ylim(0, 1.25 * math.sqrt(d_model / 2))
    ax.set_xlabel("position pos")
    ax.set_ylabel("norm")
    ax.set_title("every position has the same norm")
    ax.legend(loc="lower right")

    ax = fig.add_subplot(gs[1, 1])
    starts = sorted({0, max_len // 4, max_len // 2})
    for i, p in enumerate(starts):
        dk = pe_distance_by_offset(t, p)
        ax.plot(np.arange(dk.size), dk, lw=4 - 1.3 * i, label=f"from position p = {p}")
    ax.set_xlabel("offset k")
    ax.set_ylabel("||PE(p) - PE(p + k)||")
    ax.set_title("distance depends only on the offset k, not on p (curves coincide);\n"
                 "it grows with k, though not monotonically", fontsize=10)
    ax.legend(loc="lower right")
    _save(fig, out)


# ------------------------------------------------------------------------------ learning rate
def noam_curve(d_model, warmup, factor=1.0, steps=100_000, points=2000, fade=0.0):
    """(steps [m], lr [m]) of minitf.schedule.learning_rate, the rate training uses, at about
    `points` steps from 1 to `steps`, `warmup` itself included; with `fade`, faded for a run that
    ends after `steps` updates (as --lr-fade with --max-steps)."""
    from .schedule import learning_rate
    s = np.unique(np.concatenate([np.linspace(1, steps, points).astype(np.int64),
                                  [warmup] if 1 <= warmup <= steps else []]).astype(np.int64))
    return s, np.array([learning_rate(int(k), d_model, warmup, factor, fade, (k - 1) / steps) for k in s])


def plot_lr(out, d_model=512, warmup=4000, factor=1.0, steps=100_000, fade=0.0):
    from .schedule import noam
    _check_out(out)
    if d_model < 1 or warmup < 1 or steps < 2 or not factor > 0 or not 0 <= fade <= 1:
        raise ConfigError(f"need d_model >= 1, warmup >= 1, steps >= 2, factor > 0 and 0 <= fade <= 1, got d_model "
                          f"{d_model}, warmup {warmup}, steps {steps}, factor {factor}, fade {fade}")
    s, lr = noam_curve(d_model, warmup, factor, steps, fade=fade)
    fig = _figure(8, 4.5)
    from matplotlib.ticker import StrMethodFormatter
    peak = noam(warmup, d_model, warmup, factor)
    print(f"noam schedule: d_model {d_model}, warmup {warmup}, factor {factor}: peak lr {peak:.3e} at step {warmup}"
          f"{'' if warmup <= steps else ' (after the plotted steps)'}; lr at step {steps}: {lr[-1]:.3e}"
          + (f" (the fade's last step; the paper's schedule: {noam(steps, d_model, warmup, factor):.3e})" if fade else ""))
    ax = fig.add_subplot()
    if fade:
        ax.plot(*noam_curve(d_model, warmup, factor, steps), lw=1, ls=":", color="C0",
                label="lrate = factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5)")
        ax.plot(s, lr, lw=2, color="C0", label=f"x min(1, (1 - progress) / {fade:g}): --lr-fade {fade:g}")
    else:
        ax.plot(s, lr, lw=2, label="lrate = factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5)")
    if warmup <= steps:
        ax.axvline(warmup, color="k", ls="--", lw=1)
        ax.plot([warmup], [peak], "o", color="C3", label=f"peak {peak:.2e} at step {warmup} (= warmup)")
    ax.set_xlabel("training step")
    ax.set_ylabel("learning rate")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, 1.1 * max(lr.max(), peak if warmup <= steps else 0))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.1e}"))
    ax.set_title(f"learning-rate schedule (paper eq. 3): d_model {d_model}, warmup {warmup}, factor {factor:g}"
                 + (f", fade {fade:g}" if fade else ""))
    ax.legend(loc="upper right")
    _save(fig, out)


# ------------------------------------------------------------------------------ training curves
TRAIN_KEYS = ("loss", "nll", "ppl", "lr")
VALID_KEYS = ("valid_loss", "valid_nll", "valid_ppl", "valid_bleu")


def _number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_train_log(path):
    """Parse train_log.jsonl (or RUN/ containing it) into series:
    {'path', 'train': {key: (steps, values)}, 'valid': {...}, 'eval': {set name: {'step', 'bleu', 'chrf'
     (, 'model')}}, 'valid_bleu_sentences', 'skipped': number of unreadable lines, 'first_bad_line'}.

    Training lines carry loss/nll/ppl/lr, validation lines valid_loss/valid_nll/valid_ppl/valid_bleu,
    final evaluation lines eval/bleu/chrf; event lines (e.g. nonfinite_loss_skipped) and
    unknown keys are ignored. Series are sorted by step; a step logged twice (a resumed run
    repeats the steps after its last checkpoint) keeps its last value. DataError (naming the file) if it is missing, empty, or holds
    no training, validation or evaluation record; unreadable lines among readable ones are counted and skipped (a run
    killed mid-write can leave one).
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "train_log.jsonl")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _parse_train_log(path, f)
    except FileNotFoundError:
        raise DataError(f"{path}: training log not found (train_wmt.py writes OUT/train_log.jsonl)") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read the training log ({e.strerror or e})") from None


def _parse_train_log(path, lines):
    train, valid, evals = {k: {} for k in TRAIN_KEYS}, {k: {} for k in VALID_KEYS}, {}
    skipped, first_bad, n_lines, bleu_sentences = 0, None, 0, None
    skips, not_finite = [], set()   # (step, event) of each skipped update (one step may skip several); steps of
    # values neither drawn nor finite
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        n_lines += 1
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not _number(rec.get("step")):
            skipped += 1
            first_bad = first_bad or lineno
            continue
        step = rec["step"]
        if "event" in rec:
            if rec["event"] in ("nonfinite_loss_skipped", "overflow_skipped"):
                skips.append((step, rec["event"]))   # a skipped update does not advance the step: each counted
            continue
        if "eval" in rec:
            if isinstance(rec["eval"], str) and _number(rec.get("bleu")):
                e = evals.setdefault(rec["eval"], {"step": [], "bleu": [], "chrf": []})
                if isinstance(rec.get("model"), str):
                    e["model"] = rec["model"]   # which model the run reported: "averaged" or "last"
                e["step"].append(step)
                e["bleu"].append(rec["bleu"])
                e["chrf"].append(rec["chrf"] if _number(rec.get("chrf")) else float("nan"))
            continue
        for series, keys in ((train, TRAIN_KEYS), (valid, VALID_KEYS)):
            for k in keys:
                if _number(rec.get(k)):
                    series[k][step] = rec[k]   # a resumed run re-logs steps: the later line wins
                elif isinstance(rec.get(k), float):   # NaN or an infinity: left out of the lines, and said
                    not_finite.add(step)
        if _number(rec.get("valid_bleu_sentences")):
            bleu_sentences = rec["valid_bleu_sentences"]
    if n_lines == 0:
        raise DataError(f"{path}: the training log is empty (no step has been logged yet)")
    found = any(train.values()) or any(valid.values()) or evals
    if not found and any(event == "nonfinite_loss_skipped" for _, event in skips):
        raise DataError(f"{path}: {plural(len(skips), 'update')} skipped (a non-finite loss or gradient) and none "
                        f"logged: nothing to draw; the run diverged from its start (its learning rate, --lr-factor, or "
                        f"data)")
    if not found and skips:   # float16's loss scale settling at a run's start: no record yet, nothing wrong
        raise DataError(f"{path}: {plural(len(skips), 'update')} skipped while the float16 loss scale settled "
                        f"(overflows) and no record logged yet: nothing to draw")
    if not found:
        raise DataError(f"{path}: no training, validation or evaluation records in {n_lines} lines "
                        f"({skipped} unreadable{f', first at line {first_bad}' if first_bad else ''}); "
                        f"is this a minitf train_log.jsonl?")
    as_arrays = lambda d: {k: (np.asarray(sorted(v), dtype=float), np.asarray([v[s] for s in sorted(v)], dtype=float))
                           for k, v in d.items()}
    return {"path": path, "train": as_arrays(train), "valid": as_arrays(valid), "eval": evals,
            "valid_bleu_sentences": bleu_sentences, "skipped": skipped, "first_bad_line": first_bad,
            "skipped_updates": sorted(step for step, _ in skips), "not_finite_steps": sorted(not_finite)}


def bleu_title(data):
    """The BLEU panel's title: what was scored when, as the run did it (the model the final evaluation
    says it reported, the number of sentences of the greedy validation BLEU during training)."""
    models = {e["model"] for e in data["eval"].values() if "model" in e}
    model = ("the averaged checkpoints" if models == {"averaged"} else "the last checkpoint" if models == {"last"}
             else "the reported model")
    parts = []
    if data["valid"]["valid_bleu"][0].size:
        n = data.get("valid_bleu_sentences")
        parts.append(f"validation during training (greedy{f', {n:,} sentences' if n else ''})")
    if data["eval"]:
        parts.append(f"at the end (beam search, {model})")
    return "sacreBLEU / chrF: " + ("\nand ".join(parts) if parts else "no scores yet")   # two lines: it fits the panel


def plot_curves(log, out):
    """2x2 panels against steps: loss (smoothed and NLL, train and valid), perplexity
    (log scale), BLEU (the validation BLEU during training, and BLEU and chrF of the final
    evaluations of the model the run reported), learning rate."""
    _check_out(out)
    data = read_train_log(log)
    _need_matplotlib()
    if data["skipped"]:
        print(f"warning: {data['path']}: skipped {data['skipped']} unreadable line(s), first at line "
              f"{data['first_bad_line']}", file=sys.stderr)
    skips, bad = data["skipped_updates"], data["not_finite_steps"]
    if skips:
        print(f"note: {data['path']}: {plural(len(skips), 'update')} skipped (a non-finite loss or gradient), marked "
              f"in the loss panel", file=sys.stderr)
    if bad:
        print(f"warning: {data['path']}: values that are NaN or infinite at {plural(len(bad), 'step')} (first "
              f"{bad[0]:g}) are left out of the lines", file=sys.stderr)
    tr, va, ev = data["train"], data["valid"], data["eval"]
    fig = _figure(11, 7.5)
    axes = fig.subplots(2, 2)

    def line(ax, series, key, label, **kw):
        s, v = series[key]
        if s.size:
            ax.plot(s, v, label=label, marker="o" if s.size < 30 else None, ms=3, **kw)
            return True
        return False

    def empty(ax, what):
        ax.text(0.5, 0.5, f"no {what} in the log", ha="center", va="center", transform=ax.transAxes, color="gray")

    ax = axes[0, 0]
    drawn = [line(ax, tr, "loss", "train loss (label-smoothed)", color="C0"),
             line(ax, tr, "nll", "train NLL", color="C0", ls=":"),
             line(ax, va, "valid_loss", "valid loss (label-smoothed)", color="C1"),
             line(ax, va, "valid_nll", "valid NLL", color="C1", ls=":")]
    if skips:
        ax.vlines(sorted(set(skips)), 0, 1, transform=ax.get_xaxis_transform(), colors="red", alpha=0.4, lw=0.8,
                  label=f"{plural(len(skips), 'update')} skipped")
    ax.set_title("loss per target token (nats)")
    ax.legend() if any(drawn) else empty(ax, "loss records")

    ax = axes[0, 1]
    drawn = [line(ax, tr, "ppl", "train", color="C0"), line(ax, va, "valid_ppl", "valid", color="C1")]
    cap = math.exp(NLL_CAP)
    if any(v.size and v.max() >= cap * (1 - 1e-6) for _, v in (tr["ppl"], va["valid_ppl"])):
        ax.axhline(cap, ls="--", color="gray", label=f"exp({NLL_CAP}): the log's cap (the value was higher)")
    if any(drawn):
        ax.set_yscale("log")
        ax.legend()
    else:
        empty(ax, "perplexity records")
    ax.set_title("perplexity exp(NLL)")

    ax = axes[1, 0]
    during = line(ax, va, "valid_bleu", "valid BLEU during training (greedy)", color="C7")
    for i, (name, e) in enumerate(sorted(ev.items())):
        ax.plot(e["step"], e["bleu"], "o", ms=7, color=f"C{i}", label=f"{name} BLEU {e['bleu'][-1]:.1f}")
        ax.plot(e["step"], e["chrf"], "s", ms=7, mfc="none", color=f"C{i}", label=f"{name} chrF {e['chrf'][-1]:.1f}")
    if ev or during:
        scores = [v for e in ev.values() for v in e["bleu"] + e["chrf"] if _number(v)] + list(va["valid_bleu"][1])
        ax.set_ylim(0, min(100, max(scores + [1]) * 1.25))   # BLEU of 0-2 had been a flat line at the bottom
        ax.legend(fontsize=8, loc="upper left")
    else:
        empty(ax, "BLEU evaluations")
    ax.set_title(bleu_title(data), fontsize=9)

    ax = axes[1, 1]
    if line(ax, tr, "lr", "learning rate", color="C2"):
        from matplotlib.ticker import StrMethodFormatter
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.1e}"))
    else:
        empty(ax, "learning-rate records")
    ax.set_title("learning rate")

    steps = [s.max() for d in (tr, va) for s, _ in d.values() if s.size]
    steps += [max(e["step"]) for e in ev.values()]
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.set_xlim(0, max(steps) * 1.05 if steps and max(steps) > 0 else 1)
        ax.grid(alpha=0.3)
    name = os.path.basename(data["path"])   # a run's log: its folder's name; a log kept under another name: that name
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(data["path"]))) if name == "train_log.jsonl"
                 else name)
    _save(fig, out)


# ------------------------------------------------------------------------------ attention
def _check_layer_head(model, layer, head):
    if model.cfg.arch != "transformer":
        raise ConfigError(f"plot attention draws the Transformer's multi-head attention; this checkpoint is "
                          f"--arch {model.cfg.arch}")
    n_heads = model.cfg.n_heads
    n_layers = max(model.cfg.n_layers, model.cfg.n_decoder_layers)   # layer l of each stack that has one is drawn
    if not 0 <= layer < n_layers:
        stacks = (plural(n_layers, "layer") if model.cfg.n_layers == model.cfg.n_decoder_layers else
                  f"{model.cfg.n_layers} encoder and {model.cfg.n_decoder_layers} decoder layers")
        raise ConfigError(f"--layer {layer} is out of range: this model has {stacks}, "
                          f"valid --layer is 0..{n_layers - 1}")
    if not 0 <= head < n_heads:
        raise ConfigError(f"--head {head} is out of range: this model has {plural(n_heads, 'head')}, "
                          f"valid --head is 0..{n_heads - 1}")


def attention_maps(model, tokenizer, src, layer, head, tgt=None, beam_size=4, alpha=0.6, max_len_b=50):
    """Attention probabilities of layer `layer`, head `head` for one sentence.

    src: raw source text; tgt: raw target text, or None to translate src first (beam search,
    greedy if beam_size == 1). Runs model.forward(src ids + EOS, BOS + tgt ids) in eval mode
    and reads the softmax p of each attention's cache. Returns {'src_pieces' [S],
    'tgt_pieces' [T] (decoder inputs, BOS first), 'translated' (bool), 'target' (text),
    'enc_self' [S, S], 'dec_self' [T, T], 'cross' [T, S]} as NumPy float64; row = query. A stack with fewer layers
    than `layer` + 1 has no maps in it (the encoder's 'enc_self', the decoder's 'dec_self' and 'cross').
    """
    from .backend import to_numpy
    from .translate import translate_ids
    _check_layer_head(model, layer, head)
    if beam_size < 1:
        raise ConfigError(f"--beam must be >= 1, got {beam_size}")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    src_ids = tokenizer.encode([src])[0] + [eos]
    limit = model.cfg.max_len if model.cfg.positional == "learned" else None   # sinusoids have no limit
    if limit and len(src_ids) > limit:
        raise ConfigError(f"--src has {len(src_ids)} pieces (EOS included), more than the learned positions' "
                          f"max_len {limit}")
    translated = tgt is None
    was_training = model.training      # decoding and this forward run in eval mode (no dropout)
    try:
        if translated:
            tgt_ids = translate_ids(model, [src_ids], beam_size, alpha, 1, max_len_b)[0]
        else:
            tgt_ids = getattr(tokenizer, "encode_target", tokenizer.encode)([tgt])[0]   # a Marian model: its target.spm
        tgt_in = [bos] + list(tgt_ids)
        if limit and len(tgt_in) > limit:
            raise ConfigError(f"--tgt has {len(tgt_in)} pieces (BOS included), more than the learned positions' "
                              f"max_len {limit}")
        model.eval()
        model.forward(np.asarray([src_ids], dtype=np.int64), np.asarray([tgt_in], dtype=np.int64))
    finally:
        model.train(was_training)
    get = lambda attn: to_numpy(attn.cache[3])[0, head].astype(np.float64)   # p of (q, k, v, p)
    maps = {}   # a stack shallower than `layer` has no maps of it
    if layer < model.cfg.n_layers:
        maps["enc_self"] = get(model.encoder.layer_list[layer].self_attn)
    if layer < model.cfg.n_decoder_layers:
        dec = model.decoder.layer_list[layer]
        maps.update(dec_self=get(dec.self_attn), cross=get(dec.cross_attn))
    return {"src_pieces": [tokenizer.id_to_piece(i) for i in src_ids],
            "tgt_pieces": [tokenizer.id_to_piece(i) for i in tgt_in],
            "translated": translated, "target": tokenizer.decode([tgt_ids])[0], **maps}


CELL = 0.32               # inches a piece takes in the attention maps, labelled at font size 8
ATTENTION_WIDTH = 40.0    # inches the three maps' cells may take together; beyond it the cells shrink


def plot_attention(checkpoint, src, out, layer=0, head=0, tgt=None, beam_size=4, alpha=None, max_len_b=50,
                   device="cpu"):
    from .translate import load_for_inference
    _check_out(out)
    if not src.strip():
        raise ConfigError("--src is empty: give the sentence whose attention to draw")
    model, tok = load_for_inference(checkpoint, device)
    alpha = model.cfg.decode_alpha if alpha is None else alpha
    _check_layer_head(model, layer, head)
    _need_matplotlib()
    m = attention_maps(model, tok, src, layer, head, tgt, beam_size, alpha, max_len_b)
    if m["translated"]:
        how = ("greedy" if beam_size == 1 else f"beam {beam_size}") + " translation"
    else:
        how = "the given --tgt"
    print(f"source: {' '.join(m['src_pieces'])}")
    print(f"target ({how}): {m['target']}")
    print(f"decoder input: {' '.join(m['tgt_pieces'])}")
    s, t = len(m["src_pieces"]), len(m["tgt_pieces"])
    cell = min(CELL, ATTENTION_WIDTH / (2 * s + t))   # inches a piece: a long sentence's cells shrink
    font = 8 * cell / CELL
    if font < 4:
        print(f"note: {s} source and {t} target pieces: too many to label at this size; the axes number them "
              f"(the pieces are the lines above)", file=sys.stderr)
    panels = [(title, m[key], keys, queries) for title, key, keys, queries in (
        ("encoder self-attention", "enc_self", m["src_pieces"], m["src_pieces"]),
        ("masked decoder self-attention", "dec_self", m["tgt_pieces"], m["tgt_pieces"]),
        ("encoder-decoder attention", "cross", m["src_pieces"], m["tgt_pieces"])) if key in m]
    columns = sum(len(keys) for _, _, keys, _ in panels)   # the panels drawn: a figure as wide as they are
    width = max(9.0 if len(panels) > 1 else 5.0, cell * columns + 1.5 * len(panels))
    height = max(3.8, cell * max(len(queries) for _, _, _, queries in panels) + 2.5)
    if len(panels) < 3:
        print(f"note: layer {layer} is the {'encoder' if 'enc_self' in m else 'decoder'}'s alone (this model has "
              f"{model.cfg.n_layers} encoder and {model.cfg.n_decoder_layers} decoder layers): its maps alone are "
              f"drawn", file=sys.stderr)
    fig = _figure(width, height)
    axes = fig.subplots(1, len(panels), gridspec_kw={"width_ratios": [max(len(k), 3) for _, _, k, _ in panels]},
                        squeeze=False)[0]
    for ax, (title, p, keys, queries) in zip(axes, panels):
        im = ax.imshow(p, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        if font >= 4:
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=font)
            ax.set_yticks(range(len(queries)), queries, fontsize=font)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=list(axes), fraction=0.02, pad=0.01, label="attention probability")
    fig.suptitle(f"{os.path.basename(os.fspath(checkpoint))}: layer {layer}, head {head} "
                 f"(of {model.cfg.n_layers}+{model.cfg.n_decoder_layers} layers x {model.cfg.n_heads} heads); target: {how}", fontsize=10)
    _save(fig, out)


# ------------------------------------------------------------------------------ masks and packing
def mask_grids(src_lens, tgt_lens):
    """The masks the model builds (masks.padding_bias, masks.causal_bias), as booleans
    "may attend" for a batch of sentences with these source/target lengths (right-padded).
    Returns {'encoder': [B, S, S], 'decoder': [B, T, T], 'cross': [B, T, S]}."""
    from .masks import causal_bias, padding_bias
    b, s, t = len(src_lens), max(src_lens), max(tgt_lens)
    src = np.array([[1] * n + [0] * (s - n) for n in src_lens])
    tgt = np.array([[1] * n + [0] * (t - n) for n in tgt_lens])
    src_ok = padding_bias(src, 0, np.float64) == 0                                      # [B, 1, 1, S]
    dec_ok = (causal_bias(t, np, np.float64)[None, None] + padding_bias(tgt, 0, np.float64)) == 0   # [B, 1, T, T]
    return {"encoder": np.broadcast_to(src_ok[:, 0], (b, s, s)), "decoder": dec_ok[:, 0],
            "cross": np.broadcast_to(src_ok[:, 0], (b, t, s))}


def packing_grid(lens):
    """packing.Rows of a right-padded batch with these lengths: ([B, L] packed row index of
    each position, -1 at pads; the number of packed rows)."""
    from .packing import make_rows
    width = max(lens)
    keep = np.array([[True] * n + [False] * (width - n) for n in lens])
    rows = make_rows(keep, np, whole=True)   # a batch without padding too
    grid = np.full(keep.shape, -1)
    grid.reshape(-1)[rows.host_index] = np.arange(len(rows.host_index))
    return grid, len(rows.host_index)


def plot_masks(out, src_lens=(5, 3), tgt_lens=(4, 6)):
    _check_out(out)
    if min(src_lens) < 1 or min(tgt_lens) < 1:
        raise ConfigError("every sentence needs at least one source and one target position")
    if len(src_lens) != len(tgt_lens):
        raise ConfigError(f"--src-lens gives {plural(len(src_lens), 'sentence')} and --tgt-lens "
                          f"{len(tgt_lens)}: give each sentence a source and a target length")
    grids = mask_grids(list(src_lens), list(tgt_lens))
    b = len(src_lens)
    fig = _figure(3.2 * 3, 3.0 * b)
    titles = {"encoder": "encoder self-attention\n(padding)", "decoder": "decoder self-attention\n(causal + padding)",
              "cross": "encoder-decoder attention\n(source padding)"}
    for i in range(b):
        for j, name in enumerate(("encoder", "decoder", "cross")):
            ax = fig.add_subplot(b, 3, 3 * i + j + 1)
            ax.imshow(grids[name][i], cmap="Greens", vmin=0, vmax=1.3)
            ax.set_xlabel("key position")
            ax.set_ylabel(f"sentence {i + 1}: query")
            ax.set_title(titles[name] if i == 0 else "")
            ax.set_xticks(range(grids[name].shape[2]))
            ax.set_yticks(range(grids[name].shape[1]))
    fig.suptitle(f"masks (green: may attend; white: bias -1e9): source lengths {list(src_lens)}, "
                 f"target lengths {list(tgt_lens)}")
    _save(fig, out)


def plot_packing(out, lens=(5, 2, 4)):
    _check_out(out)
    if min(lens) < 1:
        raise ConfigError("every sentence needs at least one position")
    if sum(lens) > DRAWN_ROWS:
        raise ConfigError(f"--lens add up to {sum(lens):,} positions, each a labelled cell: at most {DRAWN_ROWS} are "
                          f"drawn to be read")
    grid, n = packing_grid(list(lens))
    fig = _figure(max(6, 0.55 * n + 1), 1.6 + 0.5 * len(lens))
    top, bottom = fig.subplots(2, 1, height_ratios=[len(lens), 1])
    top.imshow(grid >= 0, cmap="Blues", vmin=0, vmax=1.6)
    for (r, c), v in np.ndenumerate(grid):
        top.text(c, r, str(v) if v >= 0 else "pad", ha="center", va="center", fontsize=9)
    top.set_title(f"padded batch [B, L] = [{grid.shape[0]}, {grid.shape[1]}]: attention unpacks to this")
    top.set_xlabel("position")
    top.set_ylabel("sentence")
    top.set_xticks(range(grid.shape[1]))
    top.set_yticks(range(grid.shape[0]))
    bottom.imshow(np.ones((1, n)), cmap="Blues", vmin=0, vmax=1.6)
    for c in range(n):
        bottom.text(c, 0, str(c), ha="center", va="center", fontsize=9)
    bottom.set_xticks([])
    bottom.set_yticks([])
    bottom.set_title(f"{n} packed rows: Linear, FFN, LayerNorm, dropout run on these")
    _save(fig, out)


# ------------------------------------------------------------------------------ Table 1
# the measurements recorded beside the package (docs/img of the repository the package was installed from, found
# from any working folder)
TABLE1_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "table1.json")


def read_table1(path):
    """The JSON bench/table1.py writes; a DataError naming the file if it is not one."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
    except FileNotFoundError:
        if os.fspath(path) == TABLE1_JSON:   # installed without the repository's docs/
            raise DataError("no --results given, and the measurements recorded in the repository (docs/img/table1.json) "
                            "are not beside this installation: measure them with python bench/table1.py --out "
                            "table1.json (from a clone of the repository) and give --results table1.json") from None
        raise DataError(f"--results {path} does not exist: write it with python bench/table1.py --out {path}") from None
    except ValueError as e:
        raise DataError(f"--results {path} is not the JSON bench/table1.py writes ({e})") from None
    except OSError as e:   # a folder, no permission
        raise DataError(f"--results {path}: cannot read it ({e.strerror or e})") from None
    missing = [key for key in ("by_n", "by_d", "path") if not isinstance(res, dict) or key not in res]
    if missing:
        raise DataError(f"--results {path} is not the JSON bench/table1.py writes (no {', '.join(missing)})")
    names = ("self-attention", "self-attention+", "recurrent", "convolutional")
    for key in ("by_n", "by_d"):
        for row in res[key]:
            if not isinstance(row, dict) or any(name not in (row.get("seconds") or {}) or name not in
                                                (row.get("steps") or {}) for name in names):
                raise DataError(f"--results {path}: a row of {key} lacks the seconds or steps of one of "
                                f"{', '.join(names)}: not the JSON bench/table1.py writes")
    return res


def plot_table1(results, out):
    """Table 1 measured: layer time against n and against d, sequential steps, path gradients."""
    _check_out(out)
    res = read_table1(results)
    names = ("self-attention", "self-attention+", "recurrent", "convolutional")
    fig = _figure(13, 3.6)
    by_n, by_d, steps_ax, path_ax = fig.subplots(1, 4)
    for ax, rows, vary, fixed in ((by_n, res["by_n"], "n", "d"), (by_d, res["by_d"], "d", "n")):
        if not rows:
            continue
        x = [r[vary] for r in rows]
        for name in names:
            ax.loglog(x, [1e3 * r["seconds"][name] for r in rows], "o-", ms=3, label=name)
        ax.axvline(rows[0][fixed], color="gray", ls=":", lw=1)
        # Table 1's orders, one constant for both (fitted to self-attention's largest point):
        # n^2 d and n d^2 meet at n = d
        n_d = [(r["n"], r["d"]) for r in rows]
        c = 1e3 * rows[-1]["seconds"]["self-attention"] / (n_d[-1][0] ** 2 * n_d[-1][1])
        ax.loglog(x, [c * n * n * d for n, d in n_d], "--", color="gray", lw=0.8, label="n^2 d (Table 1)")
        ax.loglog(x, [c * n * d * d for n, d in n_d], "-.", color="gray", lw=0.8, label="n d^2 (Table 1)")
        ax.set_xlabel(vary)
        ax.set_ylabel("forward + backward, ms")
        ax.set_title(f"{fixed} = {rows[0][fixed]}: time against {vary} ({vary} = {fixed} dotted)", fontsize=9)
    if res["by_n"]:
        by_n.legend(fontsize=7)
    rows = res["by_n"]
    for name in names:
        steps_ax.loglog([r["n"] for r in rows], [r["steps"][name] for r in rows], "o-", ms=3, label=name)
    steps_ax.set_xlabel("n")
    steps_ax.set_ylabel("sequential steps in one forward")
    steps_ax.set_title("sequential operations: O(n) recurrent, O(1) others", fontsize=9)
    for r in res["path"]:
        path_ax.semilogy(r["n"], r["grad_norm"], "o-", ms=3, label=f"{r['arch']} encoder (trained)")
    path_ax.set_xlabel("n")
    path_ax.set_ylabel("|d out[n] / d in[1]|")
    path_ax.set_title("path length: input 1 seen from position n", fontsize=9)
    if res["path"]:
        path_ax.legend(fontsize=7)
    fig.suptitle(f"Table 1 measured ({res.get('machine', '?')}, batch {res.get('batch', '?')}, k = {res.get('k', '?')})",
                 fontsize=10)
    _save(fig, out)


def add_plot_parser(sub):
    """Register `plot` and its sub-commands on the argparse sub-parsers of minitf.cli."""
    p = sub.add_parser("plot", help="pictures: pe, lr, curves, attention, masks, packing, table1",
                       description=__doc__.split("\n\n")[1] if "\n\n" in __doc__ else None,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_subparsers(dest="what", required=True, metavar="WHAT")

    q = what.add_parser("pe", help="sinusoidal positional encoding (3.5): heatmap, norms, distance by offset")
    q.add_argument("--max-len", type=Number(int, 2, PICTURE_MAX), default=100, help="positions to draw (default 100)")
    q.add_argument("--d-model", type=Number(int, 2, PICTURE_MAX), default=128, help="model width, even (default 128)")
    q.add_argument("--table-n", type=Number(int, 2, PICTURE_MAX), default=10,
                   help="positions in the printed table (default 10)")
    q.add_argument("--table-d", type=Number(int, 2, PICTURE_MAX), default=10,
                   help="d_model of the printed table (default 10)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_pe(a.out, a.max_len, a.d_model, a.table_n, a.table_d))

    q = what.add_parser("lr", help="learning-rate schedule (5.3, eq. 3) with its peak at warmup")
    q.add_argument("--d-model", type=positive(high=PICTURE_MAX), default=512)
    q.add_argument("--warmup", type=positive(high=MAX_STEPS), default=4000)
    q.add_argument("--factor", type=positive(float), default=1.0)
    q.add_argument("--steps", type=Number(int, 2, MAX_STEPS), default=100_000, help="last step drawn (default 100000)")
    q.add_argument("--fade", type=fraction(), default=0.0,
                   help="train_wmt.py's --lr-fade for a run that ends at --steps (default 0: the paper's)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_lr(a.out, a.d_model, a.warmup, a.factor, a.steps, a.fade))

    q = what.add_parser("curves", help="loss, perplexity, BLEU and learning rate of a run against steps")
    q.add_argument("--log", type=path_arg, required=True, help="RUN/train_log.jsonl (or the RUN folder)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_curves(a.log, a.out))

    q = what.add_parser("attention", help="attention maps of one layer and head for one sentence (a Transformer's: --arch rnn models are refused)")
    q.add_argument("--checkpoint", type=path_arg, required=True, help="a minitf checkpoint (.npz or .safetensors) with its tokenizer, or "
                                                      "a Marian model folder (docs/interop.md)")
    q.add_argument("--src", required=True, help="source sentence (raw text)")
    q.add_argument("--tgt", help="target sentence (raw text); default: translate --src first")
    q.add_argument("--layer", type=Number(int, 0), default=0, help="layer index, from 0 (default 0)")
    q.add_argument("--head", type=Number(int, 0), default=0, help="head index, from 0 (default 0)")
    q.add_argument("--beam", type=Number(int, 1, MAX_BEAM), default=4, help="beam size when translating (1 = greedy; default 4)")
    q.add_argument("--alpha", type=Number(float, 0, MAX_ALPHA), default=None, help="length penalty when translating (default: the "
                   "checkpoint's preset)")
    q.add_argument("--max-len-b", type=Number(int, 0, MAX_LEN_B), default=50, help="max output length = input length (in pieces, its EOS "
                   "included) + this; with learned positions at most max_len - 1")
    q.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_attention(a.checkpoint, a.src, a.out, a.layer, a.head, a.tgt, a.beam,
                                                 a.alpha, a.max_len_b, a.device))

    q = what.add_parser("masks", help="the attention masks: padding, causal + padding, cross-attention")
    q.add_argument("--src-lens", type=positive(high=DRAWN_LEN), nargs="+", default=[5, 3],
                   help=f"source lengths, one a sentence (default 5 3; at most {DRAWN_LEN} each, to be read)")
    q.add_argument("--tgt-lens", type=positive(high=DRAWN_LEN), nargs="+", default=[4, 6],
                   help="target lengths, as many (default 4 6)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_masks(a.out, a.src_lens, a.tgt_lens))

    q = what.add_parser("packing", help="pad-free rows: a padded batch and its packed rows")
    q.add_argument("--lens", type=positive(high=DRAWN_LEN), nargs="+", default=[5, 2, 4],
                   help=f"sentence lengths (default 5 2 4; at most {DRAWN_LEN} each and {DRAWN_ROWS} in all, "
                        f"to be read)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_packing(a.out, a.lens))

    q = what.add_parser("table1", help="Table 1 measured: self-attention, recurrent and convolutional layers")
    q.add_argument("--results", type=path_arg, default=TABLE1_JSON, help="the JSON of bench/table1.py --out (default: the one "
                                                          "recorded in the repository, docs/img/table1.json)")
    q.add_argument("--out", type=path_arg, required=True, help="picture file (.png, .svg or .pdf)")
    q.set_defaults(func=lambda a: plot_table1(a.results, a.out))
    return p
