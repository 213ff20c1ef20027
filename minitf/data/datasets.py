"""The datasets minitf knows how to fetch (`DATASETS`) and `prepare_dataset`.

Every file is looked up in the data folder first (plain or .gz); only what is
missing is downloaded, so a folder that already holds the files needs no network (a folder that already holds
train and valid is used as it is: its missing test sets are skipped, not downloaded).

Layout of a data folder
-----------------------
multi30k (task 1, raw text; downloaded as is, kept gzipped)::

    train.{en,de}.gz  val.{en,de}.gz  test_2016_flickr.{en,de}.gz
    test_2017_flickr.{en,de}.gz  test_2018_flickr.{en,de}.gz

wmt14 (en-de's files shown; en-fr's likewise, with the un and giga archives; the archives from statmt.org,
extracted into the folder)::

    training/europarl-v7.de-en.{en,de}         (training-parallel-europarl-v7.tgz)
    commoncrawl.de-en.{en,de}                  (training-parallel-commoncrawl.tgz)
    training/news-commentary-v9.de-en.{en,de}  (training-parallel-nc-v9.tgz)
    dev/newstest2013.{en,de}                   (dev.tgz)
    test-full/newstest2014-deen-{src,ref}.{en,de}.sgm  (test-full.tgz; sacreBLEU's
                                                        "wmt14/full")
    test/newstest2014-deen-{src,ref}.{en,de}.sgm       (test-filtered.tgz; "wmt14")

(the training corpora are also found directly in the folder, without training/).
"""

import os
import urllib.parse
from dataclasses import dataclass

from minitf.errors import DataError
from minitf.fileio import folder_lock, make_folder
from minitf.data.download import check_gzip, download as _download, extract, note as _note, set_aside
from minitf.data.readers import find_file, read_parallel

MULTI30K_BASE_URL = ("https://raw.githubusercontent.com/multi30k/dataset/master/"
                     "data/task1/raw/")
WMT_BASE_URL = "http://www.statmt.org/"


@dataclass(frozen=True)
class Corpus:
    """A parallel corpus: candidate relative paths of its two sides.

    Paths are templates with ``{src}``/``{tgt}`` (the language codes); the first
    existing candidate (plain or .gz) wins. `archive` names an entry of the
    dataset's archive table holding it; None means each side is its own file,
    downloaded from ``base_url + <first candidate> + ".gz"``.
    """

    archive: object
    src: tuple
    tgt: tuple


def _both(*templates):
    """Corpus candidate lists for the src and tgt sides from {lang} templates."""
    return (tuple(t.replace("{lang}", "{src}") for t in templates),
            tuple(t.replace("{lang}", "{tgt}") for t in templates))


def _direct(stem):
    return Corpus(None, *_both(stem + ".{lang}"))


def _in(archive, *templates):
    return Corpus(archive, *_both(*templates))


def _wmt14(train, sgm_pair):
    """The splits of one WMT14 language pair: its training corpora, newstest2013 to validate, and
    newstest2014, whose SGM files statmt names by `sgm_pair` ("deen", "fren")."""
    return {
        "train": train,
        "valid": [_in("dev", "dev/newstest2013.{lang}", "newstest2013.{lang}")],
        "tests": {
            "newstest2014": Corpus("test-full", (f"test-full/newstest2014-{sgm_pair}-src.{{src}}.sgm",),
                                   (f"test-full/newstest2014-{sgm_pair}-ref.{{tgt}}.sgm",)),
            "newstest2014-filtered": Corpus("test-filtered", (f"test/newstest2014-{sgm_pair}-src.{{src}}.sgm",),
                                            (f"test/newstest2014-{sgm_pair}-ref.{{tgt}}.sgm",)),
        },
    }


# The one URL table. name -> base URL (overridable), its env var, the archives
# (path below the base URL, md5 or None), the language pairs, the defaults of the
# paper / fairseq recipe (vocabulary size, subword model, cleaning ratio; None = no ratio rule),
# and the splits: one set for every pair, or one per unordered pair ("de-en").
DATASETS = {
    "multi30k": {
        "base_url": MULTI30K_BASE_URL,
        "base_url_env": "MINITF_MULTI30K_BASE_URL",
        "archives": {},
        "languages": ("en", "de", "fr", "cs"),
        "pairs": None,  # any two different languages
        "vocab_size": 8000,
        "subword": "unigram",   # chosen on val for the 30-minute CPU recipe (docs/benchmarks.md)
        "max_ratio": None,
        "splits": {
            "train": [_direct("train")],
            "valid": [_direct("val")],
            "tests": {"test_2016_flickr": _direct("test_2016_flickr"),
                      "test_2017_flickr": _direct("test_2017_flickr"),
                      "test_2018_flickr": _direct("test_2018_flickr")},
        },
    },
    "wmt14": {
        "base_url": WMT_BASE_URL,
        "base_url_env": "MINITF_WMT_BASE_URL",
        "archives": {
            "europarl": ("wmt13/training-parallel-europarl-v7.tgz", None),
            "commoncrawl": ("wmt13/training-parallel-commoncrawl.tgz", None),
            "news-commentary": ("wmt14/training-parallel-nc-v9.tgz", None),
            "un": ("wmt13/training-parallel-un.tgz", None),
            "giga": ("wmt10/training-giga-fren.tar", None),
            "dev": ("wmt14/dev.tgz", None),
            # md5 sums as recorded by sacreBLEU for these two files
            "test-full": ("wmt14/test-full.tgz", "a8cd784e006feb32ac6f3d9ec7eb389a"),
            "test-filtered": ("wmt14/test-filtered.tgz",
                              "84c597844c1542e29c2aff23aaee4310"),
        },
        "languages": ("en", "de", "fr"),
        "pairs": (("en", "de"), ("de", "en"), ("en", "fr"), ("fr", "en")),
        "vocab_size": {"de-en": 37000, "en-fr": 32000},   # paper 5.1
        "subword": "bpe",                                  # paper 5.1: BPE for en-de (en-fr: word-pieces)
        "max_ratio": 1.5,
        "splits": {
            # fairseq's prepare-wmt14en2de.sh --icml17 corpora (4.5M pairs: WMT'14's own)
            "de-en": _wmt14([
                _in("europarl", "training/europarl-v7.de-en.{lang}", "europarl-v7.de-en.{lang}"),
                _in("commoncrawl", "commoncrawl.de-en.{lang}", "training/commoncrawl.de-en.{lang}"),
                _in("news-commentary", "training/news-commentary-v9.de-en.{lang}",
                    "news-commentary-v9.de-en.{lang}"),
            ], "deen"),
            # fairseq's prepare-wmt14en2fr.sh corpora (36M pairs; the 10^9 corpus comes gzipped)
            "en-fr": _wmt14([
                _in("europarl", "training/europarl-v7.fr-en.{lang}", "europarl-v7.fr-en.{lang}"),
                _in("commoncrawl", "commoncrawl.fr-en.{lang}", "training/commoncrawl.fr-en.{lang}"),
                _in("un", "un/undoc.2000.fr-en.{lang}", "undoc.2000.fr-en.{lang}"),
                _in("news-commentary", "training/news-commentary-v9.fr-en.{lang}",
                    "news-commentary-v9.fr-en.{lang}"),
                _in("giga", "giga-fren.release2.fixed.{lang}"),
            ], "fren"),
        },
    },
}


def pair_key(src, tgt):
    """The unordered pair as a key: "de-en" for en->de and de->en."""
    return "-".join(sorted((src, tgt)))


def dataset_default(name, key, src, tgt):
    """A dataset's default for `key` ("vocab_size", "subword", "max_ratio") for this language pair."""
    value = DATASETS[name][key]
    return value[pair_key(src, tgt)] if isinstance(value, dict) else value


def default_data_dir(name):
    """~/.cache/minitf/<name> (or $MINITF_CACHE/<name>)."""
    root = os.environ.get("MINITF_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "minitf")
    return os.path.join(root, name)


def _spec(name, src, tgt):
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of "
                        f"{', '.join(sorted(DATASETS))} (or pass your own files)")
    spec = DATASETS[name]
    pairs = spec["pairs"] or [(a, b) for a in spec["languages"]
                              for b in spec["languages"] if a != b]
    if (src, tgt) not in pairs:
        choices = ", ".join(f"{a}-{b}" for a, b in pairs)
        raise DataError(f"dataset {name} has no language pair {src}-{tgt}; choose "
                        f"one of {choices}")
    splits = spec["splits"]
    return spec, splits.get(pair_key(src, tgt), splits)


def _locate(data_dir, corpus, src, tgt):
    """(src_path, tgt_path) if both sides exist in data_dir, else None."""
    found = []
    for templates in (corpus.src, corpus.tgt):
        path = None
        for t in templates:
            path = find_file(data_dir, t.format(src=src, tgt=tgt))
            if path:
                break
        if path is None:
            return None
        found.append(path)
    return tuple(found)


def _expected(data_dir, corpus, src, tgt):
    """'SRC_FILE[.gz] and TGT_FILE[.gz]', the files of `corpus`, and which of them is missing."""
    names = [os.path.join(data_dir, c[0].format(src=src, tgt=tgt)) + "[.gz]" for c in (corpus.src, corpus.tgt)]
    missing = [name for name, c in zip(names, (corpus.src, corpus.tgt))
               if not any(find_file(data_dir, t.format(src=src, tgt=tgt)) for t in c)]
    found = " (neither is there)" if len(missing) == 2 else f" ({missing[0]} is missing)" if missing else ""
    return " and ".join(names) + found


DOWNLOADED = ".minitf-downloaded"   # in a data folder minitf downloaded into (not a user's own copy)


def _fetch(spec, base_url, data_dir, corpus, src, tgt, progress):
    """Download (and extract) what `corpus` needs into data_dir (_get marks the folder as minitf's once it succeeded).

    Returns the path of the downloaded archive (None for direct files)."""
    if corpus.archive is None:
        for templates in (corpus.src, corpus.tgt):
            rel = templates[0].format(src=src, tgt=tgt) + ".gz"
            if not find_file(data_dir, templates[0].format(src=src, tgt=tgt)):
                path = _download(base_url + rel, os.path.join(data_dir, rel), progress=progress)
                _checked_download(base_url + rel, path, check_gzip)
        return None
    rel, md5 = spec["archives"][corpus.archive]
    archive = os.path.join(data_dir, os.path.basename(rel))
    _download(base_url + rel, archive, md5=md5, progress=progress)
    # both directions, so that the reverse pair needs no second download
    wanted = [t.format(src=a, tgt=b) + gz for t in corpus.src + corpus.tgt
              for a, b in ((src, tgt), (tgt, src)) for gz in ("", ".gz")]
    _checked_download(base_url + rel, archive, lambda path: extract(path, data_dir, members=wanted))
    return archive


def _checked_download(url, path, check):
    """check(path); a download that fails it is moved aside (download.set_aside) and the
    DataError says so: the next run downloads it anew instead of tripping on it."""
    try:
        check(path)
    except DataError as e:
        raise _set_aside_error(e, url, path) from None
    if os.path.lexists(path + ".bad"):   # an earlier download that failed its check: this one passed
        try:
            os.unlink(path + ".bad")
        except OSError:
            pass


def _set_aside_error(e, url, path):
    """The DataError `e` of a download at `path` that is unusable, moved aside (download.set_aside)."""
    return DataError(f"{e}, downloaded from {url}; {_moved_aside(path)}, and run again to download it anew")


def _moved_aside(path):
    """download.set_aside(path), said: where it went, or that it could not be moved."""
    bad = set_aside(path)
    return f"moved it aside to {bad}" if bad else "it could not be moved aside: delete it"


def _get(spec, base_url, data_dir, corpus, src, tgt, download, progress, required,
         label, note=_note):
    """Paths of `corpus` (fetching it if allowed); None for a missing optional one."""
    paths = _locate(data_dir, corpus, src, tgt)
    if paths:
        return paths
    if not download:
        if required:
            raise DataError(f"{label}: expected {_expected(data_dir, corpus, src, tgt)}"
                            f"; put the files there or allow downloading")
        names = " and ".join(os.path.basename(c[0].format(src=src, tgt=tgt)) + "[.gz]" for c in (corpus.src, corpus.tgt))
        note(f"test set {label} skipped: {data_dir} has not both {names}")
        return None
    def wait(holder, path):
        note(f"waiting for {holder}, which is downloading into {data_dir}")
    with folder_lock(data_dir, wait):   # one process downloads into a folder at a time (they would share .part files)
        paths = _locate(data_dir, corpus, src, tgt)       # what the process waited for may have fetched it
        if paths:
            return paths
        try:
            archive = _fetch(spec, base_url, data_dir, corpus, src, tgt, progress)
            paths = _fetched(data_dir, corpus, src, tgt, label, archive,
                             archive and base_url + spec["archives"][corpus.archive][0])
        except DataError as e:
            if required or not hasattr(e, "http_status"):   # a damaged download (its checksum, its gzip): said
                raise
            # an optional test set the network did not give (offline, a mirror without it): the run goes on without it
            why = "is not available" if getattr(e, "http_status", None) == 404 else "could not be downloaded"
            note(f"test set {label} {why} for {src}-{tgt} ({e}); skipping it")
            return None
        _mark_downloaded(data_dir)
        return paths


def _mark_downloaded(data_dir):
    """DOWNLOADED in data_dir, once a download into it succeeded (a folder of the user's own that a failed download
    had marked would have been taken for minitf's from then on)."""
    try:
        if not os.path.lexists(os.path.join(data_dir, DOWNLOADED)):
            with open(os.path.join(data_dir, DOWNLOADED), "w") as f:
                f.write("minitf downloads into this folder: a test set missing here is downloaded too\n")
    except OSError:   # a folder that cannot be written: nothing marks it, test sets missing there are skipped
        pass


def _fetched(data_dir, corpus, src, tgt, label, archive, url):
    """The paths of `corpus` once downloaded; the archive removed (the extracted files are what is looked up next
    time). An archive without them is moved aside (it had been kept, and taken again by every later run)."""
    paths = _locate(data_dir, corpus, src, tgt)
    if paths is None:
        e = DataError(f"{label}: the download did not bring {_expected(data_dir, corpus, src, tgt)}")
        if archive is None:
            raise e
        raise DataError(f"{e}, which {archive} ({url}) should hold; {_moved_aside(archive)}. Run again to download it anew if it was "
                        f"cut short; if its layout changed, put the files there by hand")
    if archive:
        os.unlink(archive)  # the extracted files are what is looked up next time
    return paths


def prepare_dataset(name, data_dir=None, src="en", tgt="de", download=True,
                    progress=True, base_url=None, notes=True):
    """Find (or download) a dataset; read its small sets (valid, tests) into memory.

    `data_dir` defaults to ``default_data_dir(name)``. Files already there are
    used as they are, with no network access; missing ones are downloaded (if
    `download`) from `base_url`, else ``$MINITF_WMT_BASE_URL`` /
    ``$MINITF_MULTI30K_BASE_URL``, else the official location. Missing test sets
    (in a folder of the user's that already held train and valid, or that cannot be downloaded) are skipped with a one-line note on stderr (none with `notes=False`); missing
    train/valid files raise DataError. The
    training corpora are NOT read here (they can be tens of GB): their paths go to
    `minitf.data.prepare.prepare_cache`, which streams them.

    Returns a dict::

        {"valid": (src_lines, tgt_lines),           # corpora concatenated
         "tests": {test_name: (src_lines, tgt_lines), ...},
         "paths": {"train": [(src_path, tgt_path), ...], "valid": [...],
                   "tests": {test_name: (src_path, tgt_path)}},
         "data_dir": data_dir}
    """
    spec, splits = _spec(name, src, tgt)
    folder_flag = "--data-dir" if data_dir or not os.environ.get("MINITF_CACHE") else "--data-dir, or MINITF_CACHE"
    data_dir = os.fspath(data_dir) if data_dir else default_data_dir(name)
    if download:
        make_folder(data_dir, "the data folder", folder_flag)
    result = {"tests": {}, "paths": {"tests": {}}, "data_dir": data_dir}
    local_before = (all(_locate(data_dir, c, src, tgt) for split in ("train", "valid") for c in splits[split])
                    and not os.path.lexists(os.path.join(data_dir, DOWNLOADED)))
    wanted = [c for split in ("train", "valid") for c in splits[split]] + ([] if local_before else
                                                                           list(splits["tests"].values()))
    fetching = download and not all(_locate(data_dir, c, src, tgt) for c in wanted)
    # the URL is checked only where something is to be downloaded (--offline, or a folder that holds every file,
    # needs none: a mirror variable left set had refused them)
    base_url = _base_url(base_url, spec) if fetching else None
    args = (spec, base_url, data_dir)
    for split in ("train", "valid"):
        result["paths"][split] = [_get(*args, corpus, src, tgt, download, progress, True, f"{name} {split}")
                                  for corpus in splits[split]]
    result["valid"] = _read_all(result["paths"]["valid"])
    _refuse_empty(result["valid"], f"{name} valid", [p for pair in result["paths"]["valid"] for p in pair],
                  "validate on", "put the set's files back (or delete them to download them again)")
    # a folder that already held train and valid, and that minitf did not download into, is the user's own copy:
    # use the test sets it has and fetch nothing (e.g. a Multi30k folder with only test_2016_flickr)
    note = _note if notes else (lambda msg: None)   # notes=False: MPI ranks other than 0
    for test, corpus in splits["tests"].items():
        p = _get(*args, corpus, src, tgt, download and not local_before, progress, False, f"{name} {test}", note=note)
        if p is not None:
            result["tests"][test] = read_parallel(*p)
            result["paths"]["tests"][test] = p
            gone = ("downloaded again" if download and os.path.lexists(os.path.join(data_dir, DOWNLOADED))
                    else "skipped")   # in a folder minitf downloaded into, a missing test set is fetched again
            _refuse_empty(result["tests"][test], f"{name} {test}", p, "score",
                          f"put the set's files back (or delete them: a test set missing from the folder is {gone})")
    return result


def _base_url(given, spec):
    """The URL the dataset's files are below: `given`, else its environment variable's, else the official one; ends
    with "/". A value that is no http(s)/ftp/file URL is refused naming where it came from (a URL without its scheme,
    or with a space (but in a file:// path), had been tried four times and blamed on the network)."""
    env = spec["base_url_env"]
    url, origin = ((given, "the base URL") if given else
                   (os.environ[env], env) if os.environ.get(env) else (spec["base_url"], "the base URL"))
    parts = urllib.parse.urlsplit(url)
    if (parts.scheme not in ("http", "https", "ftp", "file")
            or (parts.scheme != "file" and (not parts.netloc or any(c.isspace() for c in url)))):
        raise DataError(f"{origin} {url!r} is not a URL the files can be downloaded from: give one as "
                        f"https://HOST/PATH/ (a mirror with the official layout), without spaces")
    return url if url.endswith("/") else url + "/"


def _read_all(pairs):
    src_lines, tgt_lines = [], []
    for p in pairs:
        s, t = read_parallel(*p)
        src_lines += s
        tgt_lines += t
    return src_lines, tgt_lines


def _prefix_files(prefix, src, tgt, label):
    """(PREFIX.src, PREFIX.tgt), each plain or .gz; otherwise a DataError led by `label` (the flag and its value)."""
    prefix = os.fspath(prefix)
    folder, stem = os.path.split(prefix)
    found = [find_file(folder or ".", f"{stem}.{lang}") for lang in (src, tgt)]
    if None in found:
        missing = [f"{prefix}.{lang}" + (" (a folder)" * os.path.isdir(f"{prefix}.{lang}"))
                   for lang, f in zip((src, tgt), found) if f is None]
        raise DataError(f"{label}: expected {prefix}.{src}[.gz] and {prefix}.{tgt}[.gz]; missing {' and '.join(missing)}")
    return tuple(found)


def user_dataset(train, valid, tests=(), src="en", tgt="de"):
    """A user's own parallel corpus, like fairseq's --trainpref/--validpref/--testpref.

    `train`, `valid`: file prefixes (PREFIX.<src> and PREFIX.<tgt>, plain or .gz, line-aligned);
    `tests`: (name, prefix) pairs. Returns the dict `prepare_dataset` returns."""
    if src == tgt:
        raise DataError(f"--src and --tgt are both {src!r}: give two different languages")
    result = {"tests": {}, "paths": {"train": [_prefix_files(train, src, tgt, f"--train {train}")],
                                     "valid": [_prefix_files(valid, src, tgt, f"--valid {valid}")], "tests": {}},
              "data_dir": os.path.dirname(os.path.abspath(os.fspath(train)))}
    result["valid"] = _read_all(result["paths"]["valid"])
    _refuse_empty(result["valid"], f"--valid {valid}", result["paths"]["valid"][0], "validate on")
    for name, prefix in tests:
        p = _prefix_files(prefix, src, tgt, f"--test {name}={prefix}")
        result["tests"][name] = read_parallel(*p)
        result["paths"]["tests"][name] = p
        _refuse_empty(result["tests"][name], f"--test {name}={prefix}", p, "score")
    return result


def _refuse_empty(lines, label, files, what, advice=""):
    """A DataError where a validation or test set (lines: (src, tgt)) holds no lines, or no pair whose two sides both
    hold text, at the start: an empty set had trained to the end, then failed in sacreBLEU; a set of blank lines had
    trained to the end and chosen the best checkpoint on BLEU 0.00 of empty sentences."""
    if not lines[0]:
        raise DataError(f"{label}: {' and '.join(files)} hold no lines: there is nothing to {what}"
                        + (f"; {advice}" if advice else ""))
    if not any(s.strip() and t.strip() for s, t in zip(*lines)):
        n = len(lines[0])
        raise DataError(f"{label}: {' and '.join(files)} hold {n} line{'s' * (n != 1)}, and in none do both sides hold "
                        f"text: there is nothing to {what}" + (f"; {advice}" if advice else ""))
