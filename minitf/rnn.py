"""RNNSearch: the recurrent encoder-decoder with attention that the Transformer replaced
(paper section 1 and 2; Bahdanau et al. 2015, Luong et al. 2015), on the same engine.

    encoder:  x = dropout(embedding[src] * sqrt(D))                  [B, S, D]
              memory = BiLSTM_n(...BiLSTM_1(x))                      [B, S, R]   (R = rnn_hidden)
    decoder, one target position t at a time (Luong 2015, 3.3 "input feeding"):
              x_t = [dropout(embedding[y_t] * sqrt(D)) ; h~_{t-1}]   [B, 2D]     (h~_{-1} = 0)
              h_t = LSTM_n(...LSTM_1(x_t))                           [B, R]
              context_t = attention(h_t, memory)                     [B, R]      (layers/rnn_attention.py)
              h~_t = tanh([context_t ; h_t] @ w_c + b_c)             [B, D]
    logits_t = dropout(h~_t) @ embedding^T                           [B, V]      (tied, as paper 3.4)

Feeding h~_{t-1} back into step t tells the decoder what it attended to before; it also
makes every step wait for the previous one, which is exactly what the Transformer's
decoder does not need in training (all T positions at once). The decoder starts from the
zero state (attention, not the initial state, carries the source). The same loss head,
training loop, checkpoints, averaging and beam search as the Transformer (seq2seq.py).
Pages: docs/rnn_vs_transformer.md, docs/derivations/lstm.md, docs/derivations/rnn_attention.md.
"""
import numpy as np

from .backend import half_dtype, to_numpy
from .errors import ConfigError
from .decode import check_step_rows
from .layers import BiLSTM, Dropout, Linear, LSTM, RecurrentAttention, TokenEmbedding
from .layers.embedding import decoding_logits
from .layers.recurrent import cell_backward, cell_forward
from .loss import log_softmax
from .masks import padding_bias
from .seq2seq import BACKWARD_NEEDS, Seq2Seq


class RNNSearch(Seq2Seq):
    ARCH = "rnn"

    def __init__(self, cfg, device="cpu", dtype="float32", seed=0):
        super().__init__(cfg, device, dtype, seed)
        if half_dtype(self.dtype):
            raise ConfigError("mixed precision (--fp16, --bf16) is for the Transformer; train --arch rnn in float32")
        rng = self.new_rng(seed)
        d, hd, n = cfg.d_model, cfg.rnn_hidden, cfg.n_layers
        self.embedding = self.add("embedding", TokenEmbedding(cfg.vocab_size, d, rng))
        self.encoder = [self.add(f"encoder.{i}", BiLSTM(d if i == 0 else hd, hd // 2, rng)) for i in range(n)]
        self.decoder = [self.add(f"decoder.{i}", LSTM(2 * d if i == 0 else hd, hd, rng)) for i in range(n)]
        self.attention = self.add("attention", RecurrentAttention(cfg.attention, hd, hd, rng))
        self.combine = self.add("combine", Linear(2 * hd, d, rng))     # h~ = tanh([context; h] @ w_c + b_c)
        self.src_dropout = self.add("src_dropout", Dropout(cfg.dropout))
        self.tgt_dropout = self.add("tgt_dropout", Dropout(cfg.dropout))
        self.out_dropout = self.add("out_dropout", Dropout(cfg.dropout))
        self.finish_init()

    # ------------------------------------------------------------------ forward
    def encode(self, src, sites=None):
        """src [B, S] -> (memory [B, S, R], bias [B, S] (NEG_INF on padding), src ids for backward)."""
        x, src_ids = self.embedding.lookup(src)
        x = self.src_dropout.forward(x, sites)
        mask = src != self.cfg.pad_id
        for layer in self.encoder:
            x = layer.forward(x, mask)
        return x, padding_bias(src, self.cfg.pad_id, self.dtype)[:, 0, 0], src_ids

    def decoder_hidden(self, src, tgt_in, sites=None):
        """src [B, S], tgt_in [B, T] -> h~ [B, T, D] (before the output dropout); keeps what backward needs."""
        xp, d, hd, n = self.xp, self.cfg.d_model, self.cfg.rnn_hidden, self.cfg.n_layers
        memory, bias, src_ids = self.encode(self.check_ids("src", src), sites)
        keys = self.attention.keys(memory)
        y, tgt_ids = self.embedding.lookup(self.check_ids("tgt_in", tgt_in))
        y = self.tgt_dropout.forward(y, sites)                                # [B, T, D]
        b, t, _ = y.shape
        first = self.decoder[0]
        w_y, w_feed = first.params["w_x"][:d], first.params["w_x"][d:]        # x_t = [y_t ; h~_{t-1}]
        yw = xp.ascontiguousarray((y.reshape(b * t, d) @ w_y + first.params["b"]).reshape(b, t, -1).transpose(1, 0, 2))
        hs = [xp.zeros((t + 1, b, hd), dtype=self.dtype) for _ in range(n)]    # hs[l][s + 1] = h_s of layer l
        feeds = xp.zeros((t + 1, b, d), dtype=self.dtype)                       # feeds[s + 1] = h~_s
        z = xp.empty((t, b, 2 * hd), dtype=self.dtype)                          # z[s] = [context_s ; h_s]
        c = [xp.zeros((b, hd), dtype=self.dtype) for _ in range(n)]
        cells, attends = [[None] * t for _ in range(n)], [None] * t
        for s in range(t):
            a = yw[s] + feeds[s] @ w_feed + hs[0][s] @ first.params["w_h"]
            for i, layer in enumerate(self.decoder):
                if i:
                    a = hs[i - 1][s + 1] @ layer.params["w_x"] + layer.params["b"] + hs[i][s] @ layer.params["w_h"]
                hs[i][s + 1], c[i], cells[i][s] = cell_forward(a, hs[i][s], c[i])
            q = hs[-1][s + 1]
            ctx, _, attends[s] = self.attention.attend(q[:, None], keys, memory, bias)
            z[s, :, :hd], z[s, :, hd:] = ctx[:, 0], q
            feeds[s + 1] = xp.tanh(self.combine.apply(z[s]))
        self._cache = dict(src_ids=src_ids, tgt_ids=tgt_ids, y=y, hs=hs, feeds=feeds, z=z, cells=cells,
                           attends=attends, keys=keys, memory=memory)
        self._head = None
        return xp.ascontiguousarray(feeds[1:].transpose(1, 0, 2))

    def forward(self, src, tgt_in):
        """src [B, S], tgt_in [B, T] int -> logits [B, T, V] (no dropout in eval mode; -inf outside an
        output vocabulary)."""
        sites = self._dropout_sites()
        return self.embedding.project_all(self.out_dropout.forward(self.decoder_hidden(src, tgt_in, sites), sites))

    def forward_loss(self, src, tgt_in, tgt_out, packed=True):
        """Label-smoothed loss averaged over the non-pad tokens of tgt_out [B, T], as the
        Transformer's. `packed` is accepted for the same signature and changes nothing: a
        recurrence runs over the padded [B, T] (padding at the end of a row gets no loss)."""
        tgt_in, tgt_out = self._check_targets(tgt_in, tgt_out)
        sites = self._dropout_sites()    # one DropoutSites per forward: src, tgt, then output dropout
        h = self.out_dropout.forward(self.decoder_hidden(src, tgt_in, sites), sites)
        return self.loss_head(h.reshape(-1, h.shape[-1]), tgt_out.reshape(-1))

    # ------------------------------------------------------------------ backward through time
    def backward(self, loss_weight=1.0, loss_scale=None):
        """ACCUMULATES d(loss_weight * loss)/d(param) of the last forward_loss into the grads
        (times loss_scale[0] when given: Transformer.backward says how)."""
        if self._cache is None:
            raise RuntimeError(BACKWARD_NEEDS)
        c, self._cache = self._cache, None
        xp, d, hd = self.xp, self.cfg.d_model, self.cfg.rnn_hidden
        b, t, _ = c["y"].shape
        dout = self.out_dropout.backward(self.loss_head_backward(loss_weight, b * t, loss_scale).reshape(b, t, d))
        dfeed_out = dout.transpose(1, 0, 2)                                    # [T, B, D]
        feeds, z, hs, w_c = c["feeds"], c["z"], c["hs"], self.combine.params["weight"]
        dpre_all = xp.empty((t, b, d), dtype=self.dtype)
        da_all = [xp.empty((t, b, 4 * hd), dtype=self.dtype) for _ in self.decoder]
        dh = [xp.zeros((b, hd), dtype=self.dtype) for _ in self.decoder]       # d h_s of each layer, from step s + 1
        dc = [xp.zeros((b, hd), dtype=self.dtype) for _ in self.decoder]
        dkeys, dmemory = xp.zeros_like(c["keys"]), xp.zeros_like(c["memory"])
        dfeed = xp.zeros((b, d), dtype=self.dtype)                              # d h~_s from step s + 1's input
        w_feed = self.decoder[0].params["w_x"][d:]
        for s in range(t - 1, -1, -1):
            # feeds[s + 1] = tanh(z[s] @ w_c + b_c)
            dpre = (dfeed_out[s] + dfeed) * (1 - feeds[s + 1] * feeds[s + 1])
            dpre_all[s] = dpre
            dz = dpre @ w_c.T
            # z[s] = [context ; q], context = attend(q, keys, memory)
            dq = self.attention.attend_backward(dz[:, None, :hd], c["attends"][s], dkeys, dmemory)[:, 0]
            dh[-1] += dz[:, hd:] + dq
            for i in range(len(self.decoder) - 1, -1, -1):
                layer = self.decoder[i]
                da, _, dc[i] = cell_backward(dh[i], dc[i], c["cells"][i][s])
                da_all[i][s] = da
                # a = x_s @ w_x + b + h_{s-1} @ w_h, x_s = h_s of the layer below (i > 0)
                dh[i] = da @ layer.params["w_h"].T
                if i:
                    dh[i - 1] += da @ layer.params["w_x"].T
            # layer 0: x_s = [y_s ; feeds[s]]
            dfeed = da_all[0][s] @ w_feed.T
        # the parameter gradients: one matmul each over all steps
        self.combine.grads["weight"] += z.reshape(t * b, -1).T @ dpre_all.reshape(t * b, -1)
        self.combine.grads["bias"] += dpre_all.reshape(t * b, -1).sum(axis=0)
        y_t = c["y"].transpose(1, 0, 2).reshape(t * b, d)
        for i, layer in enumerate(self.decoder):
            # each layer's input: [y_s ; feeds[s]] for layer 0, the layer below's h_s above it
            x2 = (xp.concatenate([y_t, feeds[:-1].reshape(t * b, d)], axis=1) if i == 0
                  else hs[i - 1][1:].reshape(t * b, -1))
            layer.accumulate_grads(x2, hs[i][:-1].reshape(t * b, -1), da_all[i].reshape(t * b, -1))
        da0 = da_all[0].reshape(t * b, -1)
        # y = tgt_dropout(embedding[tgt_in] * sqrt(D))
        dy = (da0 @ self.decoder[0].params["w_x"][:d].T).reshape(t, b, d).transpose(1, 0, 2)
        self.embedding.lookup_backward(self.tgt_dropout.backward(dy), c["tgt_ids"])
        # keys = attention.keys(memory)
        dmemory += self.attention.keys_backward(dkeys)
        for layer in reversed(self.encoder):
            dmemory = layer.backward(dmemory)
        self.embedding.lookup_backward(self.src_dropout.backward(dmemory), c["src_ids"])

    def incremental_decoder(self, src, max_steps, use_cache=True, beam=1):
        """The decoder state beam search steps through: the recurrent state replaces the KV cache."""
        return RecurrentDecoder(self, src, beam)


class _Sentences:
    """Sentences admitted together: n of them, `width` rows each (1 until the first reorder,
    then the beam), their memory [n, S, R], keys (the attention's: [n, S, A] additive, [n, S, Q]
    general, the memory itself for dot) and bias [n, S]."""

    def __init__(self, n, memory, keys, bias):
        self.n, self.width, self.memory, self.keys, self.bias = n, 1, memory, keys, bias


class RecurrentDecoder:
    """The interface of incremental.IncrementalDecoder for RNNSearch: rows are sentences x `beam`,
    sentence-major; each row's state is (h, c) per layer and the fed-back h~. The state IS the
    cache of everything before (there is nothing to recompute, so there is no uncached mode).
    As there, a sentence enters with one row and its first `reorder` gives it `beam`."""

    def __init__(self, model, src, beam=1):
        self.model, self.beam = model, beam
        model.eval()
        self.w_out = model.embedding.output_weight()
        self.out_bias = model.embedding.output_bias()     # -inf outside an output vocabulary (None: none)
        self.groups, self.h, self.c, self.feed = [], None, None, None
        self.admit(src)

    def admit(self, src, max_steps=None):
        """Start decoding the sentences src [m, S] (after those held), from the zero state (max_steps: unused, the
        recurrent state has no positions to make room for)."""
        m, xp = self.model, self.model.xp
        memory, bias, _ = m.encode(src)
        self.groups.append(_Sentences(src.shape[0], memory, m.attention.keys(memory), bias))
        rows = src.shape[0]                     # one row a sentence until its first reorder
        zeros = [xp.zeros((rows, m.cfg.rnn_hidden), dtype=m.dtype) for _ in m.decoder]
        feed = xp.zeros((rows, m.cfg.d_model), dtype=m.dtype)
        if self.h is None:
            self.h, self.c, self.feed = zeros, [z.copy() for z in zeros], feed
        else:
            self.h = [xp.concatenate([a, z]) for a, z in zip(self.h, zeros)]
            self.c = [xp.concatenate([a, z]) for a, z in zip(self.c, zeros)]
            self.feed = xp.concatenate([self.feed, feed])

    def step(self, tokens):
        """tokens [rows] -> log-probabilities [rows, V] of each row's next token."""
        return log_softmax(self.logits(tokens))

    def logits(self, tokens):
        """tokens [rows] (each row's newest token) -> logits [rows, V] for its next position."""
        m, xp = self.model, self.model.xp
        check_step_rows(tokens, sum(g.n * g.width for g in self.groups))
        y = m.embedding.lookup(tokens[:, None])[0][:, 0]                          # [rows, D]
        x = xp.concatenate([y, self.feed], axis=1)                                  # x_t = [y_t ; h~_{t-1}]
        for i, layer in enumerate(m.decoder):
            self.h[i], self.c[i] = layer.step(x, self.h[i], self.c[i])
            x = self.h[i]
        ctx, start = [], 0
        for g in self.groups:   # each sentence's beams are the queries of one attention
            rows = g.n * g.width
            q = x[start: start + rows].reshape(g.n, g.width, -1)
            ctx.append(m.attention.attend(q, g.keys, g.memory, g.bias)[0].reshape(rows, -1))
            start += rows
        self.feed = xp.tanh(m.combine.apply(xp.concatenate([xp.concatenate(ctx), x], axis=1)))
        return decoding_logits(self.feed, self.w_out, self.out_bias)              # = embedding.project_all

    def reorder(self, rows):
        """Keep rows `rows` (groups of `beam` rows from one sentence each, in sentence order; a
        sentence that had one row gets its `beam`)."""
        xp, k = self.model.xp, self.beam
        rows = np.asarray(to_numpy(rows))
        index = xp.asarray(rows)
        self.h = [a[index] for a in self.h]
        self.c = [a[index] for a in self.c]
        self.feed = self.feed[index]
        start, kept = 0, []
        for g in self.groups:
            stop = start + g.n * g.width
            sentences = xp.asarray((rows[(rows >= start) & (rows < stop)] - start)[::k] // g.width)
            start = stop
            g.n, g.width = len(sentences), k
            if g.n:
                g.memory, g.keys, g.bias = g.memory[sentences], g.keys[sentences], g.bias[sentences]
                kept.append(g)
        self.groups = kept
