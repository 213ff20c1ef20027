#!/usr/bin/env python
"""Data at the paper's scale: prepare time and peak memory, start time with the cache, resident
memory while training, and batch planning time per epoch, on WMT14-shaped corpora.

For each size n of --sizes it writes a WMT14-shaped corpus of n pairs on the fly (two random Multi30k sentences
joined per line, the same pair on both sides: ~25 words a side, WMT14's volume per pair), then:
  prepare   `python -m minitf prepare --train ...` in a child process: wall time and peak RSS
            (the first run trains the joint SentencePiece model, then encodes and cleans)
  start     `train_wmt.py --train ...` with the cache already built: seconds from launch to the
            first update (its line in train_log.jsonl), median of --runs launches; then the same
            run's peak RSS (VmHWM) after --steps updates; `--resume` from its checkpoint is timed
            the same way
  baseline  the same model (same tokenizer) trained on a 1,000-pair corpus: its peak RSS is the
            model + optimizer + activations + Python (the `[rows, V]` logits dominate, and vary
            with the batches drawn, so this difference is noisy)
  data RSS  the data path alone in a child process (open the cache, plan an epoch, collate 1000
            batches of --max-tokens) above the RSS after train.py's imports: steady and peak, anonymous and
            mapped; and the median time to collate one batch
  planning  `token_batches` for one epoch on the lengths loaded from the cache (median of 3 epochs)
With --synthetic n it also writes a cache of n random pairs straight through the cache writer
(lengths drawn like the real corpus, no SentencePiece: 36M pairs would take ~30 minutes to encode on
2 cores) and measures start, RSS and planning on it: En-Fr's 36M pairs.

usage: python bench/data.py --multi30k $MULTI30K --sizes 100000 1000000 4500000 \\
           --synthetic 36000000 --work /tmp/minitf-data-bench --json docs/data_bench.json
"""
import gzip
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.flags import count, output_path, parser, run  # noqa: E402
from bench.train_step import cpu_model  # noqa: E402


def write_corpus(multi30k, out, n, seed=0):
    """The WMT14-shaped corpus: n lines of two random Multi30k sentences joined, plus val/test."""
    os.makedirs(out, exist_ok=True)
    en = gzip.open(os.path.join(multi30k, "train.en.gz"), "rt", encoding="utf-8").read().splitlines()
    de = gzip.open(os.path.join(multi30k, "train.de.gz"), "rt", encoding="utf-8").read().splitlines()
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, len(en), n), rng.integers(0, len(en), n)
    with open(os.path.join(out, "train.en"), "w") as fe, open(os.path.join(out, "train.de"), "w") as fd:
        for i in range(0, n, 100_000):
            pairs = list(zip(a[i:i + 100_000], b[i:i + 100_000]))
            fe.write("".join(f"{en[x]} {en[y]}\n" for x, y in pairs))
            fd.write("".join(f"{de[x]} {de[y]}\n" for x, y in pairs))
    for split, lo in (("val", 0), ("test", 100)):
        for lang, lines in (("en", en), ("de", de)):
            with open(os.path.join(out, f"{split}.{lang}"), "w") as f:
                f.write("".join(line + "\n" for line in lines[lo:lo + 100]))
    return os.path.join(out, "train")


def run_measured(cmd, env):
    """(wall seconds, peak RSS MiB) of a child process (wait4's rusage: its own peak); exits with its
    stderr if it fails."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return wall, usage.ru_maxrss / 1024


def rss_mib(pid):
    """The process's peak resident set so far (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def steps_logged(log):
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


def start_run(prefix, out, cache, preset, steps, resume=False, max_tokens=None, tokenizer=None):
    """(seconds from launch to the first update, RSS MiB after `steps` updates). The run is then
    stopped with SIGTERM (it saves a checkpoint: what --resume starts from)."""
    env = dict(os.environ, MINITF_CACHE=cache)
    cmd = [sys.executable, os.path.join(ROOT, "train_wmt.py"), "--train", prefix, "--valid",
           os.path.join(os.path.dirname(prefix), "val"), "--src", "en", "--tgt", "de",
           "--cache-dir", cache, "--preset", preset, "--device", "cpu", "--out", out, "--quiet",
           "--log-every", "1", "--valid-every", "0", "--save-every", "1000000", "--max-steps", "0"]
    if max_tokens:
        cmd += ["--max-tokens", str(max_tokens)]
    cmd += ["--tokenizer", tokenizer] if tokenizer else ["--vocab-size", "37000"]   # one or the other
    if resume:
        cmd.append("--resume")
    log = os.path.join(out, "train_log.jsonl")
    before = len(steps_logged(log))
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while True:
        if p.poll() is not None:
            sys.exit(f"training stopped early:\n{p.stderr.read().decode()[-3000:]}")
        n = len(steps_logged(log)) - before
        if n >= 1 and first is None:
            first = time.perf_counter() - t0
        if n >= steps:
            break
        time.sleep(0.02)
    rss = rss_mib(p.pid)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)
    return first, rss


def planning(cache_folder, max_tokens, runs=3):
    from minitf.data import open_cache, token_batches
    pairs = open_cache(cache_folder).pairs("en", "de")
    times = []
    for epoch in range(runs):
        t0 = time.perf_counter()
        batches = token_batches(pairs.src_lens, pairs.tgt_lens, max_tokens, seed=1, epoch=epoch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(batches)


def data_memory(cache_folder, max_tokens, batches=1000):
    """RSS of the training data path alone, in a child process: after the imports of train.py
    (and glibc's keep-freed-memory setting the CPU trainer makes), open the cache, plan an epoch
    (then trim the heap, as the trainer does: minitf/feed.py) and collate `batches` batches. Returns MiB above the post-import RSS: steady and peak, and
    the steady part split into anonymous memory (the process's own) and mapped file pages; and the median time to
    collate one of those batches (collate_ms: what the training loop's feed does once a batch)."""
    code = f"""
import json, statistics, sys, time
sys.path.insert(0, {ROOT!r})
import minitf.train
from minitf.backend import keep_freed_memory, release_freed_memory
from minitf.data import open_cache, token_batches
from minitf.data.batching import training_batch
def mem():
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {{k: int(d[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}}
keep_freed_memory()
base = mem()
c = open_cache({cache_folder!r}); p = c.pairs("en", "de")
plan = token_batches(p.src_lens, p.tgt_lens, {max_tokens}, 1, 0)
release_freed_memory()   # as the trainer does after planning an epoch (minitf/feed.py)
times = []
for idx in plan[:{batches}]:
    t0 = time.perf_counter()
    training_batch(p, idx, c.tokenizer)
    times.append(time.perf_counter() - t0)
now = mem()
print(json.dumps({{"collate_ms": 1e3 * statistics.median(times),
                  "imports_rss_mib": base["VmRSS"], "data_rss_mib": now["VmRSS"] - base["VmRSS"],
                  "data_peak_mib": now["VmHWM"] - base["VmRSS"], "data_anon_mib": now["RssAnon"] - base["RssAnon"],
                  "data_file_mib": now["RssFile"] - base["RssFile"]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return {k: round(v, 2 if k == "collate_ms" else None) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def prepare(prefix, cache, extra=()):
    """`python -m minitf prepare` on PREFIX.{en,de}: (wall s, peak RSS MiB, cache folder, manifest)."""
    wall, peak = run_measured([sys.executable, "-m", "minitf", "prepare", "--train", prefix, "--valid",
                               os.path.join(os.path.dirname(prefix), "val"), "--vocab-size", "37000",
                               "--cache-dir", cache, "--quiet", *extra], dict(os.environ))
    folder = os.path.join(cache, [d for d in os.listdir(cache) if not d.startswith(".")][0])
    with open(os.path.join(folder, "manifest.json")) as f:
        return wall, peak, folder, json.load(f)


def wmt_lengths(rng, n):
    """n source and target lengths in pieces, shaped like the WMT14-shaped corpus: source
    normal with mean 33 and deviation 10, target 1.05x it (+-10%), both clipped to [1, 250]."""
    s = np.clip(rng.normal(33, 10, n), 1, 250).astype(np.int64)
    return s, np.clip((s * rng.normal(1.05, 0.1, n)).astype(np.int64), 1, 250)


def wmt_batch(cfg, tokens, seed=0):
    """One batch of a token_batches epoch over WMT14-shaped lengths (+EOS / +BOS), <= `tokens`
    padded tokens a side: host arrays src [B, S], tgt_in, tgt_out [B, T] with random ids."""
    from minitf.data import token_batches
    rng = np.random.default_rng(seed)
    src_lens, tgt_lens = wmt_lengths(rng, 40 * max(1, tokens // 30))
    batches = token_batches(src_lens, tgt_lens, tokens, seed, 0)
    idx = max(batches, key=len) if tokens < 1000 else batches[len(batches) // 2]
    ls, lt = src_lens[idx] + 1, tgt_lens[idx] + 1
    src = np.full((len(idx), ls.max()), cfg.pad_id, np.int64)
    tgt_in, tgt_out = (np.full((len(idx), lt.max()), cfg.pad_id, np.int64) for _ in range(2))
    for i in range(len(idx)):
        src[i, :ls[i]] = np.append(rng.integers(4, cfg.vocab_size, ls[i] - 1), cfg.eos_id)
        y = np.append(rng.integers(4, cfg.vocab_size, lt[i] - 1), cfg.eos_id)
        tgt_in[i, :lt[i]], tgt_out[i, :lt[i]] = np.append(cfg.bos_id, y[:-1]), y
    return src, tgt_in, tgt_out



def make_synthetic(folder, manifest, n, seed=0, chunk=2_000_000):
    """Swap the arrays of a real cache for n random pairs (lengths like the WMT-shaped corpus, ids
    below its vocabulary), written by the cache's own writer; the manifest is updated to match, so
    train_wmt.py opens it as it opens any cache. Costs seconds per million pairs instead of
    SentencePiece's minutes."""
    from minitf.data import prepare
    vocab = manifest["tokenizer"]["vocab_size"]
    rng = np.random.default_rng(seed)
    writers = {(lang, kind): prepare._NpyWriter(os.path.join(folder, f"train.{lang}.{kind}.npy"), dt)
               for lang in ("de", "en") for kind, dt in (("tokens", np.uint16), ("offsets", np.int64),
                                                          ("lengths", np.uint16))}
    ends = {"de": 0, "en": 0}
    for lang in ends:
        writers[lang, "offsets"].append(np.zeros(1, np.int64))
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        s, t = wmt_lengths(rng, m)
        lens = {"en": s, "de": t}
        for lang, ln in lens.items():
            writers[lang, "tokens"].append(rng.integers(4, vocab, int(ln.sum())).astype(np.uint16))
            writers[lang, "lengths"].append(ln)
            writers[lang, "offsets"].append(ends[lang] + np.cumsum(ln))
            ends[lang] += int(ln.sum())
    manifest["files"] = {f"train.{lang}.{kind}.npy": w.close() for (lang, kind), w in writers.items()}
    manifest["counts"] = {"total": n, "kept": n, "empty": 0, "too_long": 0, "ratio": 0}
    manifest["tokens"] = ends
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def markdown(results):
    """The results as the table of docs/benchmarks.md."""
    rows = ["| pairs | text | kept pairs | cache | prepare (first run) | prepare peak RSS | launch -> first update "
            f"(median of {results.get('runs', 3)}) | --resume -> first update | data RSS: mapped + own (after 1,000 batches) | "
            f"collating a batch of {results.get('max_tokens', 4096)} tokens (median of 1,000) | "
            "training process peak RSS (its 1,000-pair baseline) | planning one epoch, 4096 / 25000 tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["corpora"]:
        synthetic = r.get("synthetic")
        plan = " / ".join(f"{r['planning_s'][k]:.2f} s" for k in sorted(r["planning_s"], key=int))
        rows.append("| " + " | ".join([
            f"{r['pairs']:,}" + (" (synthetic cache)" if synthetic else ""),
            "-" if synthetic else f"{r['text_mb']:,} MB",
            "-" if synthetic else f"{r['kept']:,}",
            f"{r['cache_mb']:,} MB",
            "-" if synthetic else f"{r['prepare_s']:.0f} s",
            "-" if synthetic else f"{r['prepare_peak_rss_mib']:,} MiB",
            f"{r['start_s_median']:.1f} s ({', '.join(f'{x:.1f}' for x in r['start_s'])})",
            f"{r['resume_s_median']:.1f} s",
            f"{r['data_rss_mib']} MiB: {r['data_file_mib']} + {r['data_anon_mib']} (peak {r['data_peak_mib']})",
            f"{r['collate_ms']:.2f} ms" if "collate_ms" in r else "-",
            f"{r['train_rss_mib']:,} MiB ({r['baseline_rss_mib']:,})",
            plan]) + " |")
    return "\n".join(rows)


def main():
    p = parser(__doc__)
    p.add_argument("--multi30k", default=os.environ.get("MULTI30K"), required="MULTI30K" not in os.environ,
                   help="a folder holding Multi30k's train/val .en/.de[.gz] (default: $MULTI30K)")
    p.add_argument("--sizes", type=count(), nargs="*", default=[100_000, 1_000_000, 4_500_000])
    p.add_argument("--synthetic", type=count(), nargs="*", default=[], help="pair counts of synthetic caches")
    p.add_argument("--work", default="/tmp/minitf-data-bench")
    p.add_argument("--preset", default="tiny",
                   help="model trained in the start / RSS runs (tiny: its update takes ~0.1 s, so the start time "
                        "is the data's and the program's own)")
    p.add_argument("--max-tokens", type=count(), default=4096, help="batch size of the start runs")
    p.add_argument("--plan-tokens", type=count(), nargs="*", default=[4096, 25000], help="batch sizes timed for planning")
    p.add_argument("--runs", type=count(), default=3, help="launches per start measurement (median)")
    p.add_argument("--steps", type=count(), default=5, help="updates before the RSS reading")
    p.add_argument("--keep", action="store_true", help="keep the corpora, caches and runs in --work (else removed, "
                                                       "also when the measurement stops early)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    output_path(p, args.json, "--json")
    os.makedirs(args.work, exist_ok=True)
    there = set(os.listdir(args.work))   # kept by an earlier --keep, or the user's: never removed here
    try:
        measure_all(args)
    finally:
        if not args.keep:
            for name in set(os.listdir(args.work)) - there:   # what this run made there
                if WORK_NAMES.fullmatch(name):
                    path = os.path.join(args.work, name)
                    shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)


_MADE = r"base|base-cache|n\d+|cache\d+|run-.*|synthetic-cache\d+|synthetic\.model"
WORK_NAMES = re.compile(rf"(?:{_MADE})|\.(?:{_MADE})\.lock")   # and the runs' and caches' lock files beside them


def measure_all(args):
    results = {"runs": args.runs,
               "machine": f"{platform.node()} {cpu_model()}, {os.cpu_count()} cores",
               "date": time.strftime("%Y-%m-%d"), "preset": args.preset, "max_tokens": args.max_tokens,
               "numpy": np.__version__, "corpora": []}

    base_prefix = write_corpus(args.multi30k, os.path.join(args.work, "base"), 1000)

    def starts_and_rss(prefix, cache, tokenizer, name):
        """Median launch-to-first-update of fresh starts and of --resume; RSS of the run and of the
        same model on the 1,000-pair corpus (same tokenizer, so the same model and optimizer)."""
        row, starts, resumes, base = {}, [], [], []
        for k in range(args.runs):
            out = os.path.join(args.work, f"run-{name}-{k}")
            for o in (out, out + "-base"):
                shutil.rmtree(o, ignore_errors=True)
            starts.append(start_run(prefix, out, cache, args.preset, args.steps, max_tokens=args.max_tokens,
                                    tokenizer=tokenizer))
            resumes.append(start_run(prefix, out, cache, args.preset, args.steps, resume=True,
                                     max_tokens=args.max_tokens, tokenizer=tokenizer))
            base.append(start_run(base_prefix, out + "-base", os.path.join(args.work, "base-cache"), args.preset,
                                  args.steps, max_tokens=args.max_tokens, tokenizer=tokenizer))
            for o in (out, out + "-base"):
                shutil.rmtree(o, ignore_errors=True)
        row["start_s"] = [round(r[0], 2) for r in starts]
        row["start_s_median"] = round(statistics.median(r[0] for r in starts), 2)
        row["resume_s"] = [round(r[0], 2) for r in resumes]
        row["resume_s_median"] = round(statistics.median(r[0] for r in resumes), 2)
        row["train_rss_mib"] = round(statistics.median(r[1] for r in starts))
        row["baseline_rss_mib"] = round(statistics.median(r[1] for r in base))
        row["rss_above_baseline_mib"] = row["train_rss_mib"] - row["baseline_rss_mib"]
        return row

    def measure(row, prefix, cache, cache_folder, tokenizer, name):
        """Data memory, starts and RSS, planning: added to `row`, which is printed and kept."""
        row.update(data_memory(cache_folder, args.max_tokens))
        row.update(starts_and_rss(prefix, cache, tokenizer, name))
        plans = {m: planning(cache_folder, m) for m in args.plan_tokens}
        row["planning_s"] = {m: round(t, 3) for m, (t, _) in plans.items()}
        row["batches_per_epoch"] = {m: b for m, (_, b) in plans.items()}
        results["corpora"].append(row)
        print(json.dumps(row), flush=True)

    for n in args.sizes:
        folder = os.path.join(args.work, f"n{n}")
        t0 = time.perf_counter()
        prefix = write_corpus(args.multi30k, folder, n)
        text_mb = sum(os.path.getsize(f"{prefix}.{lang}") for lang in ("en", "de")) / 1e6
        cache = os.path.join(args.work, f"cache{n}")
        shutil.rmtree(cache, ignore_errors=True)
        print(f"{n:,} pairs: corpus written ({text_mb:.0f} MB, {time.perf_counter() - t0:.0f}s); preparing...", flush=True)
        wall, peak, cache_folder, manifest = prepare(prefix, cache)
        row = {"pairs": n, "text_mb": round(text_mb), "kept": manifest["counts"]["kept"],
               "vocab": manifest["tokenizer"]["vocab_size"],
               "cache_mb": round(sum(f["bytes"] for f in manifest["files"].values()) / 1e6),
               "prepare_s": round(wall, 1), "prepare_peak_rss_mib": round(peak)}
        print(json.dumps(row), flush=True)
        measure(row, prefix, cache, cache_folder, os.path.join(cache_folder, "tokenizer.model"), str(n))
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)

    for n in args.synthetic:
        cache = os.path.join(args.work, f"synthetic-cache{n}")
        shutil.rmtree(cache, ignore_errors=True)
        _, _, cache_folder, manifest = prepare(base_prefix, cache)
        tokenizer = os.path.join(args.work, "synthetic.model")
        shutil.copy(os.path.join(cache_folder, "tokenizer.model"), tokenizer)
        t0 = time.perf_counter()
        make_synthetic(cache_folder, manifest, n)
        print(f"synthetic {n:,} pairs: cache written in {time.perf_counter() - t0:.0f}s", flush=True)
        row = {"pairs": n, "synthetic": True, "vocab": manifest["tokenizer"]["vocab_size"],
               "cache_mb": round(sum(f["bytes"] for f in manifest["files"].values()) / 1e6)}
        measure(row, base_prefix, cache, cache_folder, tokenizer, f"s{n}")
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(markdown(results))


if __name__ == "__main__":
    run(main)
