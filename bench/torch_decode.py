"""The PyTorch baseline of bench/decode.py --vs-torch: batched, KV-cached greedy and beam
search over bench/torch_model.py's TorchTransformer (minitf's weights), written the way a
PyTorch user writes it (fairseq's SequenceGenerator: log_softmax over the vocabulary, topk
of the 2k best (beam, token) candidates, self-attention caches grown with torch.cat and
reordered with index_select, finished sentences dropped from the batch).

The search rules are minitf.decode's, so both must produce the same hypotheses:
  - max length per sentence: a * source length (non-pad, EOS included) + b; at that step
    every live beam is forced to end (EOS);
  - pad and BOS are never emitted, EOS not as the first token (no empty translation);
  - each step takes the 2k best candidates of a sentence in score order; an EOS candidate
    among the k best finishes (normalized by the GNMT length penalty ((5 + |Y|) / 6)^alpha,
    |Y| counting the EOS) while fewer than k have finished; the first k other finite
    candidates are the next beams (a beam short of candidates is padded with dead -inf ones);
  - a sentence stops when k hypotheses have finished, at its length limit, or when no live
    beam is left; the answer is its best finished hypothesis (the first one on a tie).
PyTorch is not a dependency of minitf: only bench/ imports this.
"""
import math
import sys
from pathlib import Path

if __name__ == "__main__":   # a module of bench/decode.py --vs-torch, not a script of its own (torch or not)
    sys.exit("bench/torch_decode.py is the PyTorch side of `python bench/decode.py --vs-torch`: run that (its --help)")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.torch_model import sinusoids  # noqa: E402


def length_penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


class TorchDecoder:
    """Encoder output and per-layer caches for `rows` (sentences x beams); step(tokens [rows]) -> log-probs
    [rows, V]."""

    def __init__(self, tm, src, repeat):
        self.tm, cfg = tm, tm.cfg
        self.h, self.dk = cfg.n_heads, cfg.d_k
        p = tm.p
        src = src.repeat_interleave(repeat, dim=0) if repeat > 1 else src
        self.blocked = (src == cfg.pad_id)[:, None, None, :]                 # [rows, 1, 1, S]
        x = tm._embed(src)
        for i in range(cfg.n_layers):
            n = f"encoder.layers.{i}"
            x = tm._norm(n + ".norm1", x + tm._attention(n + ".self_attn", x, x, self.blocked))
            x = tm._norm(n + ".norm2", x + tm._ffn(n + ".ffn", x))
        self.cross = [(self._heads(tm._linear(f"decoder.layers.{i}.cross_attn.k", x)),
                       self._heads(tm._linear(f"decoder.layers.{i}.cross_attn.v", x))) for i in range(cfg.n_decoder_layers)]
        self.self_kv = [None] * cfg.n_decoder_layers
        self.t = 0
        self.emb, self.scale = p["embedding.weight"], math.sqrt(cfg.d_model)
        self.pe = sinusoids(1024, cfg.d_model, x.dtype, x.device)

    def _heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.h, self.dk).transpose(1, 2)                  # [rows, H, S, K]

    def _attend(self, name, q, k, v, blocked):
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.dk)
        if blocked is not None:
            scores = scores.masked_fill(blocked, float("-inf"))
        ctx = torch.softmax(scores, dim=-1) @ v
        b = ctx.shape[0]
        return self.tm._linear(name + ".out", ctx.transpose(1, 2).reshape(b, 1, self.h * self.dk))

    def step(self, tokens):
        tm, t = self.tm, self.t
        if self.t >= self.pe.shape[0]:
            self.pe = sinusoids(2 * self.pe.shape[0], self.pe.shape[1], self.pe.dtype, self.pe.device)
        y = (self.emb[tokens] * self.scale + self.pe[t])[:, None]           # [rows, 1, D]
        for i in range(tm.cfg.n_decoder_layers):
            n = f"decoder.layers.{i}"
            k, v = self._heads(tm._linear(n + ".self_attn.k", y)), self._heads(tm._linear(n + ".self_attn.v", y))
            if self.self_kv[i] is not None:
                k = torch.cat([self.self_kv[i][0], k], dim=2)
                v = torch.cat([self.self_kv[i][1], v], dim=2)
            self.self_kv[i] = (k, v)
            q = self._heads(tm._linear(n + ".self_attn.q", y))
            y = tm._norm(n + ".norm1", y + self._attend(n + ".self_attn", q, k, v, None))
            ck, cv = self.cross[i]
            q = self._heads(tm._linear(n + ".cross_attn.q", y))
            y = tm._norm(n + ".norm2", y + self._attend(n + ".cross_attn", q, ck, cv, self.blocked))
            y = tm._norm(n + ".norm3", y + tm._ffn(n + ".ffn", y))
        self.t += 1
        return torch.log_softmax(y[:, 0] @ self.emb.t(), dim=-1)

    def reorder(self, rows, same_sources):
        self.self_kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.self_kv]
        if not same_sources:
            self.blocked = self.blocked.index_select(0, rows)
            self.cross = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cross]


def _max_lengths(src, cfg, a, b):
    return (a * (src != cfg.pad_id).sum(dim=1).numpy() + b).astype(int)


@torch.inference_mode()
def greedy_search(tm, src, max_len_a=1.0, max_len_b=50):
    cfg = tm.cfg
    max_lens = _max_lengths(src, cfg, max_len_a, max_len_b)
    dec = TorchDecoder(tm, src, 1)
    out = [[] for _ in range(src.shape[0])]
    alive = np.arange(src.shape[0])
    tokens = torch.full((src.shape[0],), cfg.bos_id, dtype=torch.long)
    for t in range(int(max_lens.max()) + 1):
        logp = dec.step(tokens)
        logp[:, [cfg.pad_id, cfg.bos_id]] = -math.inf
        if t == 0:
            logp[:, cfg.eos_id] = -math.inf
        best = logp.argmax(dim=1).numpy()
        keep = np.flatnonzero((best != cfg.eos_id) & (t < max_lens[alive]))
        for row in keep:
            out[alive[row]].append(int(best[row]))
        if not len(keep):
            break
        alive = alive[keep]
        dec.reorder(torch.from_numpy(keep), False)
        tokens = torch.from_numpy(best[keep])
    return out


@torch.inference_mode()
def beam_search(tm, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=50):
    """src [B, S] int64 tensor -> B token lists (no BOS/EOS), the rules of the module docstring."""
    cfg, k = tm.cfg, beam_size
    b = src.shape[0]
    max_lens = _max_lengths(src, cfg, max_len_a, max_len_b)
    dec = TorchDecoder(tm, src, k)
    alive = np.arange(b)
    scores = torch.full((b, k), -math.inf, dtype=tm.dtype)
    scores[:, 0] = 0.0
    hyps = np.zeros((b * k, 0), dtype=np.int64)
    n_done = np.zeros(b, dtype=int)
    best, best_score = [[] for _ in range(b)], np.full(b, -np.inf)
    tokens = torch.full((b * k,), cfg.bos_id, dtype=torch.long)
    for t in range(int(max_lens.max()) + 1):
        logp = dec.step(tokens)                                        # [n * k, V]
        v = logp.shape[1]
        logp[:, [cfg.pad_id, cfg.bos_id]] = -math.inf
        if t == 0:
            logp[:, cfg.eos_id] = -math.inf
        n = len(alive)
        cand = (scores[:, :, None] + logp.view(n, k, v)).view(n, k * v)
        top_v, top_i = torch.topk(cand, min(2 * k, k * v), dim=1)        # sorted, best first
        top_v, top_i = top_v.numpy(), top_i.numpy()
        beam, tok = top_i // v, top_i % v
        at_limit = t >= max_lens[alive]
        if at_limit.any():                                             # every live beam ends here
            ends = (scores + logp.view(n, k, v)[:, :, cfg.eos_id]).numpy()
            beam[at_limit], tok[at_limit] = np.arange(len(top_i[0])) % k, cfg.eos_id
            top_v[at_limit] = -np.inf
            top_v[at_limit, :k] = ends[at_limit]
        finite = np.isfinite(top_v)
        is_eos = tok == cfg.eos_id
        for i, r in zip(*np.nonzero(is_eos & finite & (np.arange(top_v.shape[1]) < k))):
            sent = alive[i]
            if n_done[sent] < k:
                n_done[sent] += 1
                s = top_v[i, r] / length_penalty(t + 1, alpha)
                if s > best_score[sent]:
                    best_score[sent], best[sent] = s, hyps[i * k + beam[i, r]].tolist()
        cont = ~is_eos & finite
        pick = np.argsort(~cont, axis=1, kind="stable")[:, :k]         # continuing candidates first
        live = np.take_along_axis(cont, pick, axis=1)
        still = np.flatnonzero((n_done[alive] < k) & ~at_limit & live[:, 0])
        if not len(still):
            break
        pick, live = pick[still], live[still]
        pick = np.where(live, pick, pick[:, :1])                      # dead slots copy the first beam
        new_beam = np.take_along_axis(beam[still], pick, axis=1)
        new_tok = np.take_along_axis(tok[still], pick, axis=1)
        rows = (still[:, None] * k + new_beam).reshape(-1)
        hyps = np.concatenate([hyps[rows], new_tok.reshape(-1, 1)], axis=1)
        scores = torch.from_numpy(np.where(live, np.take_along_axis(top_v[still], pick, axis=1), -np.inf)
                                  .astype(top_v.dtype))
        dec.reorder(torch.from_numpy(rows), same_sources=len(still) == n)
        alive = alive[still]
        tokens = torch.from_numpy(new_tok.reshape(-1))
    return best
