"""Transformer (paper 3, Figure 1): embeddings -> encoder stack -> decoder stack -> logits.

Owns weight tying (3.4: one matrix for source embedding, target embedding and the
pre-softmax projection) and the pad-free packing of training batches; what it shares with
the recurrent model (the flat parameter and gradient buffers, the dropout random stream, the
loss head) is seq2seq.Seq2Seq, the attention masks are masks.py.
"""
import numpy as np

from .backend import to_device
from .blocks import Decoder, Encoder
from .incremental import IncrementalDecoder
from .layers import Dropout, LearnedPositional, SinusoidalPositional, TokenEmbedding
from .masks import causal_bias, padding_bias
from .packing import make_rows, pack, unpack
from .seq2seq import Seq2Seq


class Transformer(Seq2Seq):
    def __init__(self, cfg, device="cpu", dtype="float32", seed=0):
        super().__init__(cfg, device, dtype, seed)
        rng = np.random.default_rng(seed)
        d = cfg.d_model
        self.embedding = self.add("embedding", TokenEmbedding(cfg.vocab_size, d, rng))
        if cfg.positional == "learned":
            self.positional = self.add("positional", LearnedPositional(cfg.max_len, d, rng))
        else:
            self.positional = SinusoidalPositional(cfg.max_len, d)
        self.encoder = self.add("encoder", Encoder(cfg, rng))
        self.decoder = self.add("decoder", Decoder(cfg, rng))
        self.src_dropout = self.add("src_dropout", Dropout(cfg.dropout))
        self.tgt_dropout = self.add("tgt_dropout", Dropout(cfg.dropout))
        self.finish_init()

    # ------------------------------------------------------------------ forward
    def encode(self, src, stream=None, rows=None):
        """src [B, S] -> (memory [B, S, D], src_bias [B, 1, 1, S], src ids cached for backward).

        With `rows` (packing.Rows of the non-pad source positions) memory is [Ns, D]."""
        src_bias = padding_bias(src, self.cfg.pad_id, self.dtype)
        x_emb, src_ids = self.embedding.lookup(src)
        x = self.src_dropout.forward(pack(rows, self.positional.forward(x_emb)), stream, rows=rows)
        return self.encoder.forward(x, src_bias, stream, rows), src_bias, src_ids

    def decoder_hidden(self, src, tgt_in, keep_tgt=None):
        """src [B, S], tgt_in [B, T] int -> decoder output h [B, T, D]. Keeps what backward needs.

        Packed (training): with keep_tgt [B, T] bool, every layer runs on the non-pad source
        positions and the kept target positions only (packing.py) and h is [Nt, D]."""
        src_rows = tgt_rows = None
        src = self._check_ids("src", src, host=keep_tgt is not None)
        if keep_tgt is not None:   # on the host: no GPU sync (packing.Rows)
            src_rows = make_rows(src != self.cfg.pad_id, self.xp)
            tgt_rows = make_rows(keep_tgt, self.xp)
        src, tgt_in = to_device(src, self.xp), self._check_ids("tgt_in", tgt_in)
        stream = self._dropout_stream()
        memory, src_bias, src_ids = self.encode(src, stream, src_rows)
        t = tgt_in.shape[1]
        tgt_bias = causal_bias(t, self.xp, self.dtype)[None, None] + padding_bias(tgt_in, self.cfg.pad_id, self.dtype)
        y_emb, tgt_ids = self.embedding.lookup(tgt_in)
        y = self.tgt_dropout.forward(pack(tgt_rows, self.positional.forward(y_emb)), stream, rows=tgt_rows)
        h = self.decoder.forward(y, memory, src_bias, tgt_bias, stream, tgt_rows, src_rows)
        self._cache = {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_rows": src_rows, "tgt_rows": tgt_rows,
                       "h_shape": h.shape}
        self._head = None   # a forward without a loss: no backward of an earlier loss
        return h

    def forward(self, src, tgt_in):
        """src [B, S], tgt_in [B, T] int -> logits [B, T, V] = h @ embedding^T (3.4); -inf outside
        an output vocabulary."""
        return self.embedding.project_all(self.decoder_hidden(src, tgt_in))

    def forward_loss(self, src, tgt_in, tgt_out, packed=True):
        """Label-smoothed loss averaged over non-pad tokens of tgt_out [B, T].

        Pad-free (packing.py, the default): the layers run on the non-pad positions only (the
        target positions kept are those non-pad in tgt_in or tgt_out). `packed=False`: every
        layer on [B, L, D], pads included (slower; for tests). Either way only the rows of h
        with a loss (tgt_out non-pad) are projected to the vocabulary (Seq2Seq.loss_head).
        Loss and gradients are the same either way, with dropout too: a mask is a function of
        the position in the padded batch (functional.dropout_bits), so both layouts drop the
        same units (tests/test_engine.py). The whole step written plainly is reference.py.
        Returns a float on CPU; on GPU a 0-d CuPy array (no host sync; float() it to read).
        `self.last_stats` holds {'loss', 'nll_sum', 'n_tokens'} as device scalars.
        """
        tgt_in, tgt_out = self._check_targets(tgt_in, tgt_out)
        keep = (tgt_in != self.cfg.pad_id) | (tgt_out != self.cfg.pad_id) if packed else None
        h = self.decoder_hidden(src, tgt_in, keep_tgt=keep)   # [Nt, D] packed, [B, T, D] plain
        h = h.reshape(-1, h.shape[-1])     # [Nt, D] ([B*T, D] plain or for a batch without padding)
        tgt_rows = self._cache["tgt_rows"]
        gold = tgt_out.reshape(-1) if tgt_rows is None else tgt_out.reshape(-1)[tgt_rows.host_index]   # [Nt]
        return self.loss_head(h, gold)

    # ------------------------------------------------------------------ backward
    def backward(self, loss_weight=1.0):
        """ACCUMULATES d(loss_weight * loss)/d(param) of the last forward_loss into the grads.

        loss_weight weighs this batch's loss in a sum: n / total for one of several
        accumulated micro-batches, times the float16 loss scale (optim.LossScaler)."""
        if self._cache is None:
            raise RuntimeError("backward() needs a forward_loss() first (and only one backward per forward)")
        c, self._cache = self._cache, None
        dh = self.loss_head_backward(loss_weight, int(np.prod(c["h_shape"][:-1])))
        dy, dmemory = self.decoder.backward(dh.reshape(c["h_shape"]))
        # y = tgt_dropout(pack(embedding[tgt_in] * sqrt(D) + PE))
        dy = self.positional.backward(unpack(c["tgt_rows"], self.tgt_dropout.backward(dy)))
        self.embedding.lookup_backward(dy, c["tgt_ids"])
        # memory = encoder(src_dropout(pack(embedding[src] * sqrt(D) + PE)))
        dx = self.positional.backward(unpack(c["src_rows"], self.src_dropout.backward(self.encoder.backward(dmemory))))
        self.embedding.lookup_backward(dx, c["src_ids"])

    def incremental_decoder(self, src, max_steps, use_cache=True, beam=1):
        """The decoder state beam search steps through (incremental.py: KV caches)."""
        return IncrementalDecoder(self, src, max_steps, use_cache, beam)
