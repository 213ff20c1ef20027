"""Text in, text out: translate raw sentences with a checkpoint and score them with sacreBLEU.

The library's one call: `minitf.load("model.npz").translate(["A man is riding a bike."])`, with
the command line's defaults (beam 4, the length penalty alpha of the checkpoint's preset).
"""
import collections.abc
import re
from typing import NamedTuple

from . import progress
import concurrent.futures
import threading

import numpy as np

from .backend import blas_threads, can_limit_blas_threads, is_gpu, set_blas_threads, usable_cores
from .data.batching import pad_ids
from .layers.attention import maps_off
from .decode import beam_search, decodes, greedy_search, length_penalty
from .errors import CheckpointError
from .flags import MAX_ALPHA, MAX_BEAM, MAX_LEN_B


def progress_bar(total, desc, enabled=True, stream=None):
    """Sentences done, on stderr (minitf.progress): on a terminal a bar, for more than one sentence
    and once the work has taken a second; in a log file a line every 30 s of a long job."""
    return progress.bar(total, desc, enabled and total > 1, unit="sent", stream=stream, leave=False, delay=1.0)


# ------------------------------------------------------------------------------ searches side by side
MAX_THREADS = 8             # translate_ids: most searches side by side (one per core)
MIN_THREAD_SENTENCES = 16   # ... and at least this many sentences each


def search_threads(model, n_sentences):
    """How many searches `translate_ids` runs side by side by default: on a CPU where each
    thread's BLAS can be made single-threaded (backend.blas_threads), one per core
    (at most MAX_THREADS, each with at least MIN_THREAD_SENTENCES sentences); else one (on a
    GPU the device runs one stream of kernels)."""
    if is_gpu(model.xp) or not can_limit_blas_threads():
        return 1
    return max(1, min(usable_cores(), MAX_THREADS, n_sentences // MIN_THREAD_SENTENCES))


STOPS = ("fairseq", "bound", "ctranslate2")   # decode.beam_search's rules for when a sentence ends


def check_search(beam_size, alpha, batch_size, max_len_b, stop, nbest=None, beam_name="beam_size"):
    """ValueError (TypeError for a value that is no number) naming the setting, as the command line's flags refuse
    it: a misspelt `stop` or a beam of 0 would otherwise decode some other way without a word, or fail deep inside
    the search."""
    def whole(name, value, low, high=None):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r}: expected a whole number")
        if value < low or high is not None and value > high:
            raise ValueError(f"{name}={value}: expected {low} to {high}" if high else f"{name}={value}: expected {low} or more")
    whole(beam_name, beam_size, 1, MAX_BEAM)
    whole("batch_size", batch_size, 1)
    whole("max_len_b", max_len_b, 0, MAX_LEN_B)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise TypeError(f"alpha={alpha!r}: expected a number (the length penalty's exponent)")
    if not 0 <= alpha <= MAX_ALPHA:
        raise ValueError(f"alpha={alpha}: expected 0 to {MAX_ALPHA:g} (0: no length penalty)")
    if stop not in STOPS:
        raise ValueError(f"stop={stop!r}: choose one of {', '.join(STOPS)}")
    if nbest is not None:
        whole("nbest", nbest, 1, beam_size)


@decodes
def translate_ids(model, src_ids, beam_size=4, alpha=0.6, batch_size=64, max_len_b=50, progress=None, stop="fairseq",
                  use_cache=True, threads=None, nbest=None, done=None):
    """Decode lists of source ids (with EOS), sorted by length (little padding), at most
    `batch_size` sentences at a time per search (continuous batching); returns id lists in input order.

    `threads` searches (default: search_threads) run side by side in threads, each on every
    threads-th sentence of the sorted order, each with single-threaded BLAS: most of a
    search step on a CPU is NumPy work outside the matrix products (the exp of the
    logsumexp, attention over small groups, moving cache rows, the search's bookkeeping),
    which runs on one core, so one search leaves the others mostly idle (docs/performance.md).
    Every sentence is decoded as alone: the threads only split the list (the last bits of float32 sums depend on
    the batch a sentence is decoded in, as on --batch-size).
    nbest=n: each sentence's n best hypotheses with their scores (beam_search's nbest; with
    beam_size 1, greedy_search's one with scores). done(i, result): called as sentence i finishes, with what the
    list returns for it (from the searches' threads, one call at a time)."""
    check_search(beam_size, alpha, batch_size, max_len_b, stop, nbest)
    if not len(src_ids):
        return []
    order = np.argsort([len(s) for s in src_ids], kind="stable")
    threads = search_threads(model, len(src_ids)) if threads is None else max(1, min(int(threads), len(src_ids)))
    parts = [order[i::threads] for i in range(threads)]      # each: the same mix of lengths, still sorted

    lock = threading.Lock()

    def search(part, progress):
        src = pad_ids([src_ids[i] for i in part], model.cfg.pad_id)
        finished = None if done is None else lambda row, result: _locked(lock, done, int(part[row]), result)
        if beam_size == 1:
            return greedy_search(model, src, max_len_b=max_len_b, use_cache=use_cache, batch_size=batch_size,
                                 progress=progress, scores=bool(nbest), done=finished)
        return beam_search(model, src, beam_size, alpha, max_len_b=max_len_b, use_cache=use_cache,
                           batch_size=batch_size, progress=progress, stop=stop, nbest=nbest, done=finished)

    if threads == 1:
        results = [search(parts[0], progress)]
    else:
        results = _side_by_side(search, parts, progress)
    out = [None] * len(src_ids)
    for part, res in zip(parts, results):
        for r, i in enumerate(part):
            out[i] = res[r]
    return out


def _locked(lock, call, *args):
    with lock:
        call(*args)


class _Cancelled(Exception):
    pass


class _SharedProgress:
    """One progress bar fed by several threads; raises _Cancelled in a search once the caller
    has given up (an error in another thread, Ctrl-C), so that no thread runs on."""

    def __init__(self, progress):
        self.progress, self.lock, self.cancelled = progress, threading.Lock(), threading.Event()

    def update(self, n):
        if self.cancelled.is_set():
            raise _Cancelled()
        if self.progress is not None:
            with self.lock:
                self.progress.update(n)


def _side_by_side(search, parts, progress):
    """search(part, progress) for every part, each in its own thread with single-threaded BLAS. The caller's BLAS
    thread count is set back once every thread has ended: the OpenBLAS NumPy ships applies a thread's setting to the
    whole process, so threads that each put back what they found would race, and training after a validation went on
    with one BLAS thread or two, by chance (its sums then rounded differently from run to run)."""
    shared = _SharedProgress(progress)

    def alone(part):
        set_blas_threads(1)   # a pool thread's own, where OpenBLAS keeps one per thread; not put back: see above
        return search(part, shared)

    with blas_threads(1), concurrent.futures.ThreadPoolExecutor(len(parts), thread_name_prefix="minitf-decode") as pool:
        futures = [pool.submit(alone, part) for part in parts]
        try:   # the first error of any thread (a caller's done raising in it too) stops the others at their next update
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in futures:
                if f.done() and f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]
        except BaseException:
            shared.cancelled.set()
            raise


# ------------------------------------------------------------------------------ text in, text out
class Hypothesis(NamedTuple):
    """One translation of an n-best list: the detokenized text, the search's score (the sum of
    `token_logprobs` over the length penalty), and `token_logprobs`, the natural log-probability of
    each piece and of the end of sentence."""
    text: str
    score: float
    token_logprobs: list

    @property
    def positional(self):
        """The former name of token_logprobs."""
        return self.token_logprobs


def _check_texts(lines, what):
    """A TypeError naming the first of `lines` that is not a string (`what` it is: "line", "source", ...), a
    ValueError naming the first that is no text (a lone surrogate, such as bytes decoded with errors="surrogateescape"
    leave: it has no UTF-8, which the tokenizer reads)."""
    for i, line in enumerate(lines):
        if not isinstance(line, str):
            raise TypeError(f"{what} {i + 1} of {len(lines)} is {type(line).__name__}, not a string of text")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} {i + 1} of {len(lines)} holds U+{ord(line[e.start]):04X} at character "
                             f"{e.start + 1}, a lone surrogate (undecodable bytes?): not text") from None


def _as_list(lines, what):
    """(list of lines, whether one string was given) of a string or an iterable of them."""
    if isinstance(lines, str):
        return [lines], True
    if isinstance(lines, (bytes, bytearray)):
        raise TypeError(f"expected a string or a list of strings as the {what}s, got {type(lines).__name__}: decode "
                        f"it first (e.g. .decode('utf-8'))")
    if isinstance(lines, (collections.abc.Set, collections.abc.Mapping)):   # no order to give the results back in
        raise TypeError(f"expected a string or a list of strings as the {what}s, got a {type(lines).__name__}: its "
                        f"order is not the results' (give a list)")
    try:
        return list(lines), False
    except TypeError:
        raise TypeError(f"expected a string or a list of strings as the {what}s, got {type(lines).__name__}") from None


def translate_lines(model, tokenizer, lines, beam_size=4, alpha=None, batch_size=64, max_len_b=50, progress=True,
                    nbest=None, stop="fairseq", done=None):
    """Raw sentences -> detokenized translations (paper 6.1: beam 4, max length input + 50); alpha
    None: the checkpoint preset's (model.cfg.decode_alpha; the paper's 0.6, small 2.0, small with --arch rnn 1.5), as the
    command line. An empty line (one of spaces, or of characters the tokenizer drops, such as a zero-width space or a
    lone byte-order mark: no piece) comes back empty. nbest=n: each line's n best
    Hypothesis instead (an empty line: one, empty, score 0). stop: when beam search ends a sentence
    (decode.beam_search: "fairseq", "bound" or "ctranslate2"). done(i, result): called as line i is translated (the
    empty ones first, the others in the order they finish), with what the list returns for it."""
    alpha = model.cfg.decode_alpha if alpha is None else alpha
    _check_texts(lines, "line")
    todo = [i for i, line in enumerate(lines) if line.strip()]
    pieces = tokenizer.encode([lines[i] for i in todo])
    todo = [i for i, ids in zip(todo, pieces) if ids]   # a line of no piece is empty too: the model never sees it
    src_ids = [ids + [tokenizer.eos_id] for ids in pieces if ids]   # never cut: see Seq2Seq.check_ids

    def empty():
        return "" if nbest is None else [Hypothesis("", 0.0, [])]

    def finished(j, out):   # with done: each line decoded to text once, as it finishes
        result[todo[j]] = _texts(tokenizer, [out], nbest, alpha)[0]
        done(todo[j], result[todo[j]])

    result = [empty() for _ in lines]
    if done is not None:
        for i in sorted(set(range(len(lines))) - set(todo)):
            done(i, result[i])
    with progress_bar(len(src_ids), "translate", progress) as bar:
        out = translate_ids(model, src_ids, beam_size, alpha, batch_size, max_len_b, progress=bar, nbest=nbest,
                            stop=stop, done=None if done is None else finished)
    if done is None:
        for i, text in zip(todo, _texts(tokenizer, out, nbest, alpha)):
            result[i] = text
    return result


def _texts(tokenizer, out, nbest, alpha):
    """translate_ids' results (token lists, or with nbest lists of (tokens, logprobs)) -> texts, or lists of
    Hypothesis."""
    if nbest is None:
        return tokenizer.decode(out)
    return [[Hypothesis(text, sum(p) / length_penalty(len(p), alpha), p)
             for text, (_, p) in zip(tokenizer.decode([tokens for tokens, _ in hyps]), hyps)] for hyps in out]


# ------------------------------------------------------------------------------ scoring given translations
@decodes
def score_ids(model, src_ids, tgt_ids, batch_size=64, progress=None):
    """Forced decoding: the natural log-probability of each target piece and of the end of sentence, given the
    source (src_ids with their EOS, tgt_ids without), in eval mode, as beam search scores them: one list per pair,
    in input order, `batch_size` pairs at a time (the logits of a batch are [pairs, T, V]). A target piece outside an
    output vocabulary is scored as the unknown piece, as training and validation score it."""
    from .backend import to_numpy
    from .decode import _logsumexp
    from .functional import as_float32_if_half
    check_search(1, 0.0, batch_size, 0, "fairseq")
    if len(src_ids) != len(tgt_ids):
        raise ValueError(f"{len(src_ids)} sources but {len(tgt_ids)} targets: one target a source")
    cfg, xp = model.cfg, model.xp
    for what, lists in (("source", src_ids), ("target", tgt_ids)):
        for i, ids in enumerate(lists):
            if len(ids) and not 0 <= min(ids) <= max(ids) < cfg.vocab_size:
                raise ValueError(f"{what} {i + 1}: piece ids must lie in [0, {cfg.vocab_size}), got {min(ids)}..{max(ids)}")
    inside = None
    if cfg.output_vocab is not None:
        inside = np.zeros(cfg.vocab_size, dtype=bool)
        inside[cfg.output_ids()] = True
    order = np.argsort([len(s) + len(t) for s, t in zip(src_ids, tgt_ids)], kind="stable")   # little padding
    out = [None] * len(src_ids)
    for start in range(0, len(order), batch_size):
        part = order[start:start + batch_size]
        targets = [tgt_ids[i] for i in part]
        gold = pad_ids(targets, cfg.pad_id, suffix=cfg.eos_id)                       # [b, T]: the pieces, then EOS
        if inside is not None:
            gold = np.where(inside[gold], gold, cfg.unk_id)
        with maps_off():   # no backward: no attention weights kept
            logits = as_float32_if_half(model.forward(pad_ids([src_ids[i] for i in part], cfg.pad_id),
                                                      pad_ids(targets, cfg.pad_id, prefix=cfg.bos_id)))
        b, t, v = logits.shape
        flat = logits.reshape(b * t, v)
        logp = to_numpy(flat[xp.arange(b * t), xp.asarray(gold.ravel())] - _logsumexp(flat)).reshape(b, t)
        for row, i in enumerate(part):
            out[i] = logp[row, :len(tgt_ids[i]) + 1].astype(np.float64).tolist()
        if progress is not None:
            progress.update(len(part))
    return out


def score_lines(model, tokenizer, sources, targets, alpha=None, batch_size=64, progress=False):
    """Raw (source, translation) pairs -> Hypothesis(translation, score, token_logprobs) each: the translation's
    log-probability piece by piece (score_ids) and its score as beam search ranks a hypothesis (their sum over the
    length penalty with `alpha`, default the checkpoint preset's), so a translation of `translate` scores here as
    there, when its text splits into the pieces the search chose (it does not where the search chose pieces of bare
    spaces, `▁`: the text, rescored, is the same words in fewer pieces). An empty translation is scored too (its end of sentence); an empty source is an error (`translate` gives
    it an empty translation without asking the model)."""
    alpha = model.cfg.decode_alpha if alpha is None else alpha
    check_search(1, alpha, batch_size, 0, "fairseq")
    _check_texts(sources, "source")
    _check_texts(targets, "translation")
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} translations: one translation a source")
    src_ids = [ids + [tokenizer.eos_id] for ids in tokenizer.encode(list(sources))]
    empty = [i + 1 for i, ids in enumerate(src_ids) if len(ids) == 1]   # spaces, or characters the tokenizer drops
    if empty:
        raise ValueError(f"source {empty[0]} of {len(sources)} is empty (no piece): there is nothing to translate it "
                         f"from")
    tgt_ids = tokenizer.encode_target(list(targets))
    limit = model.cfg.max_len if model.cfg.positional == "learned" else None   # sinusoids have no limit
    if limit:   # a source with its EOS, a translation after the BOS: at most max_len positions each
        for what, lists, most in (("source", src_ids, limit), ("translation", tgt_ids, limit - 1)):
            for i, ids in enumerate(lists):
                if len(ids) > most:
                    raise ValueError(f"{what} {i + 1} has {len(ids)} pieces"
                                     f"{' with its end of sentence' if what == 'source' else ''}: the model's learned "
                                     f"positions take at most {most}")
    with progress_bar(len(src_ids), "score", progress) as bar:
        logps = score_ids(model, src_ids, tgt_ids, batch_size, progress=bar)
    return [Hypothesis(text, sum(p) / length_penalty(len(p), alpha), p) for text, p in zip(targets, logps)]


UNSPACED = ("zh", "ja")   # languages written without spaces between words (Korean has them: Moses splits it)


def base_language(lang):
    """The language of a code, lowercase, without its region: "DE", "de-AT", "de_DE" -> "de"; None -> None."""
    return lang.lower().replace("_", "-").split("-")[0] if lang else None


def sacrebleu_bleu(lang=None):
    """sacreBLEU's BLEU for the target language `lang`, as its command line's `-l` chooses the tokenizer: 13a, but
    Chinese's (zh) and MeCab's for Japanese and Korean (ja, ko; where MeCab's packages are not installed, characters:
    tok:char, which the signature says). Splitting on spaces had given Chinese a BLEU near 0."""
    from sacrebleu.metrics import BLEU
    try:
        return BLEU(trg_lang=base_language(lang) or "")
    except (RuntimeError, ImportError):   # ja, ko without their tokenizers' packages
        return BLEU(tokenize="char")


def metrics(hyps, refs, lang=None, paper=True):
    """sacreBLEU BLEU (sacrebleu_bleu: the target language's tokenizer) and chrF of detokenized hypotheses against
    one reference each, and with the target language `lang` (unless paper=False), the paper's tokenized BLEU beside
    them (`paper_bleu`)."""
    from sacrebleu.metrics import CHRF
    _same_count(hyps, refs)
    bleu, chrf = sacrebleu_bleu(lang), CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    out = {"bleu": round(b.score, 2), "chrf": round(c.score, 2), "bleu_signature": str(bleu.get_signature()),
           "chrf_signature": str(chrf.get_signature()), "bleu_detail": str(b), "n": len(hyps)}
    if lang is not None and paper:
        out["bleu_paper"], out["bleu_paper_method"] = paper_bleu(hyps, refs, lang)
    return out


def _same_count(hyps, refs):
    """ValueError unless there are as many hypotheses as references, and some: sacreBLEU's functions had scored the
    shorter list alone (100 for 2 hypotheses against 3 references) and failed inside on none."""
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses and {len(refs)} references: give one reference for each hypothesis")
    if not hyps:
        raise ValueError("no hypotheses and no references: there is nothing to score")


def paper_bleu_available():
    """Whether the paper's tokenized BLEU can be computed here (sacremoses is installed)."""
    import importlib.util
    return importlib.util.find_spec("sacremoses") is not None


def paper_bleu(hyps, refs, lang):
    """The paper's score (Table 2), as tensor2tensor's get_ende_bleu.sh and fairseq's
    compound_split_bleu.sh compute it: hypotheses and references Moses-tokenized (sacremoses,
    escaping like tokenizer.perl -l LANG), German compounds split (`a-b` -> `a ##AT##-##AT## b`),
    then multi-bleu.perl's BLEU of the tokens (case-sensitive, no smoothing).

    `lang` is taken without case or region ("DE", "de-AT": de). Returns (BLEU rounded to 2 places, a description);
    (None, why) without sacremoses, or for a language written without spaces (zh, ja: Moses does not split it).
    """
    _same_count(hyps, refs)
    lang = base_language(lang)
    if lang in UNSPACED:
        return None, (f"not computed: the Moses tokenizer does not split {lang} into words (sacreBLEU's BLEU above "
                      f"uses {lang}'s own tokenizer, or characters where its package is missing: its signature says)")
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        return None, "not computed: needs sacremoses (pip install 'minitf[paper]')"
    from sacrebleu.metrics import BLEU
    mt = MosesTokenizer(lang=lang)

    def tokenize(line):
        tokens = mt.tokenize(line, escape=True, return_str=True)
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokens) if lang == "de" else tokens

    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score([tokenize(h) for h in hyps], [[tokenize(r) for r in refs]]).score
    how = f"tokenized BLEU: Moses tokenizer ({lang}){', compound splitting' if lang == 'de' else ''}, multi-bleu"
    return round(score, 2), how


def load_for_inference(path, device="cpu"):
    """(model, tokenizer) of any model file `load` reads."""
    translator = load(path, device)
    return translator.model, translator.tokenizer


def load(path, device="cpu", dtype=None):
    """A checkpoint ready to translate: `minitf.load("runs/m30k/model.npz").translate(lines)`: a minitf checkpoint
    (.npz, or a .safetensors export) with its tokenizer, or a Marian model (an OPUS-MT folder: the .npz, its
    vocabulary, source.spm and target.spm; minitf.marian, docs/interop.md). `device`: "cpu" or "gpu". `dtype`: the
    model's ("float32", "float64", ...); None: float64 for a checkpoint of float64 weights, else float32. The model
    (`.model`) comes in eval mode: call its train() to fine-tune it with dropout."""
    from .modelfile import read_model
    stored = read_model(path)
    if stored.tokenizer is None:
        raise CheckpointError(f"checkpoint {path} has no tokenizer inside: it cannot translate text")
    if dtype is None:   # (a float64 checkpoint had come back float32 without a word)
        weights = next(iter(stored.params.values()), None)
        dtype = "float64" if weights is not None and weights.dtype == np.float64 else "float32"
    return Translator(stored.build_model(device, dtype), stored.tokenizer, stored.train_state.get("languages"))


class Translator:
    """A trained model and its tokenizer. `translate` and `nbest` decode with the command line's
    defaults: beam 4 (paper 6.1), the length penalty alpha of the checkpoint's preset (`alpha`:
    the paper's 0.6; small 2.0, small with --arch rnn 1.5), max length input + 50, 64 sentences at a time;
    `score` gives given translations the scores `nbest` gives its own."""

    def __init__(self, model, tokenizer, languages=None):
        self.model, self.tokenizer = model, tokenizer
        self.languages = languages   # [source, target] the model was trained on, when recorded

    @property
    def alpha(self):
        """The length penalty's alpha that translate, nbest and score use when given none: the checkpoint preset's."""
        return self.model.cfg.decode_alpha

    def translate(self, lines, beam=4, alpha=None, max_len_b=50, batch_size=64, progress=False, stop="fairseq",
                  done=None):
        """A list of sentences -> their translations (a single string -> a string). An empty
        line comes back empty. stop: when beam search ends a sentence ("fairseq": once `beam`
        hypotheses finished; "bound": once no live beam can beat the best finished one;
        "ctranslate2": CTranslate2's rule, decode.beam_search). done(i, translation): called
        as line i is translated, in the order the lines finish (one call at a time), so that a
        long job can keep what it has (`minitf translate --output` does)."""
        check_search(beam, self.alpha if alpha is None else alpha, batch_size, max_len_b, stop, beam_name="beam")
        lines, one = _as_list(lines, "line")
        out = translate_lines(self.model, self.tokenizer, lines, beam, alpha, batch_size, max_len_b, progress,
                              stop=stop, done=done)
        return out[0] if one else out

    def score(self, sources, translations, alpha=None, batch_size=64, progress=False):
        """Each (source, translation) pair's Hypothesis(translation, score, token_logprobs): how likely the model
        finds a given translation, piece by piece, scored as `nbest` scores its own (score_lines). Two lists of
        sentences -> a list; a source string and a translation string -> one Hypothesis."""
        one = isinstance(sources, str) and isinstance(translations, str)    # a pair of strings -> one Hypothesis
        if not one and (isinstance(sources, str) or isinstance(translations, str)):
            raise TypeError("score: give two strings (one pair) or two lists of strings (pairs line by line)")
        out = score_lines(self.model, self.tokenizer, _as_list(sources, "source")[0],
                          _as_list(translations, "translation")[0], alpha, batch_size, progress)
        return out[0] if one else out

    def nbest(self, lines, n=4, beam=4, alpha=None, max_len_b=50, batch_size=64, progress=False, stop="fairseq",
              done=None):
        """Each sentence's n best translations (n <= beam) as Hypothesis(text, score, token_logprobs),
        best first: a list of them per sentence (a single string -> its list). done(i, hypotheses):
        as translate's."""
        check_search(beam, self.alpha if alpha is None else alpha, batch_size, max_len_b, stop, beam_name="beam")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n={n!r}: expected a whole number (1 to the beam size, {beam})")
        if not 1 <= n <= beam:
            raise ValueError(f"n-best {n}: choose 1 to the beam size ({beam})")
        lines, one = _as_list(lines, "line")
        out = translate_lines(self.model, self.tokenizer, lines, beam, alpha, batch_size, max_len_b, progress,
                              nbest=n, stop=stop, done=done)
        return out[0] if one else out
