"""Transformer (paper 3, Figure 1): embeddings -> encoder stack -> decoder stack -> logits.

Owns weight tying (3.4: one matrix for source embedding, target embedding and the
pre-softmax projection) and the pad-free packing of training batches; what it shares with
the recurrent model (the flat parameter and gradient buffers, the dropout sites, the
loss head) is seq2seq.Seq2Seq, the attention masks are masks.py.
"""
import numpy as np

from . import kernels
from .backend import to_device, to_numpy
from .errors import ConfigError
from .blocks import Decoder, Encoder
from .incremental import IncrementalDecoder
from .layers import Dropout, LearnedPositional, SinusoidalPositional, TokenEmbedding
from .masks import causal_bias, padding_bias
from .packing import make_rows, pack, unpack
from .seq2seq import BACKWARD_NEEDS, Seq2Seq


class Transformer(Seq2Seq):
    """The paper's encoder-decoder (3.1-3.5) of a `Config`: `forward_loss(src, tgt_in, tgt_out)` then `backward()`
    accumulate every parameter's gradient; `forward(src, tgt_in)` gives the logits; `translate`-style decoding goes
    through `minitf.translate` (`minitf.load` for a trained checkpoint). device: "cpu" (NumPy) or "gpu" (CuPy); dtype:
    the parameters' and activations' ("float32", "float64", "float16"; "bfloat16" on a GPU); seed: the initial
    weights and the dropout masks (functional.DropoutSites). A new model is in training mode (dropout on):
    `model.eval()` turns it off."""
    ARCH = "transformer"

    def __init__(self, cfg, device="cpu", dtype="float32", seed=0):
        super().__init__(cfg, device, dtype, seed)
        rng = self.new_rng(seed)
        d = cfg.d_model
        self.embedding = self.add("embedding", TokenEmbedding(cfg.vocab_size, d, rng, cfg.output_bias))
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
    def encode(self, src, sites=None, rows=None, plan=None, src_bias=None):
        """src [B, S] -> (memory [B, S, D], src_bias [B, 1, 1, S], src ids cached for backward).

        With `rows` (packing.Rows of the non-pad source positions) memory is [N_s, D]. `plan`
        (training on a GPU, kernels.embedding_plan): the embedding runs as one kernel. `src_bias`:
        the padding bias, when the caller made it (from host ids)."""
        if src_bias is None:
            src_bias = padding_bias(src, self.cfg.pad_id, self.dtype)
        x = self._embed(src, rows, self.src_dropout, sites, plan)
        return self.encoder.forward(x, src_bias, sites, rows), src_bias, src

    def _embed(self, ids, rows, dropout, sites, plan):
        """dropout(pack(rows, embedding[ids] * sqrt(D) + PE)) (3.4, 3.5, 5.4): [N_s, D] or [N_t, D] with rows."""
        if plan is None:
            x_emb, _ = self.embedding.lookup(ids)
            return dropout.forward(pack(rows, self.positional.forward(x_emb)), sites, rows=rows)
        # one pass on the GPU (kernels.embed_rows): the same rows, the same dropout mask
        w = self.embedding.params["weight"]
        length = ids.shape[1]
        key = sites.next_site()[1] if dropout.active(sites) else None
        out, mask = kernels.embed_rows(w, ids, rows, length, self.positional.table_like(w, length),
                                       self.embedding.scale, key, dropout.p)
        dropout.hold(mask)
        return out if rows is not None else out.reshape(ids.shape + (-1,))

    def _embedding_plans(self, src, tgt_in, src_rows, tgt_rows):
        """(src plan, tgt plan) of kernels.embedding_plan from the HOST ids, when the embedding runs
        fused (a GPU, sinusoidal positions); else (None, None)."""
        w = self.embedding.params["weight"]
        if not (kernels.fused(w, "embed") and isinstance(self.positional, SinusoidalPositional)):
            return None, None
        return tuple(kernels.embedding_plan(ids, None if rows is None else rows.host_index, self.xp)
                     for ids, rows in ((src, src_rows), (tgt_in, tgt_rows)))

    def decoder_hidden(self, src, tgt_in, keep_tgt=None):
        """src [B, S], tgt_in [B, T] int -> decoder output h [B, T, D]. Keeps what backward needs.

        Packed (training): with keep_tgt [B, T] bool, every layer runs on the non-pad source
        positions and the kept target positions only (packing.py) and h is [N_t, D]."""
        src_rows = tgt_rows = None
        plans, whole = (None, None), False
        if len(src) != len(tgt_in):   # one source would broadcast over every target, without a word
            raise ConfigError(f"src has {len(src)} sentences but tgt_in {len(tgt_in)}: one source a target")
        src = self.check_ids("src", src, host=keep_tgt is not None)
        if keep_tgt is not None:   # on the host: no GPU sync (packing.Rows)
            host_in = self.check_ids("tgt_in", tgt_in, host=True)
            # attention on packed rows (kernels.attention_rows; never with attention dropout) takes a side without
            # padding as packed rows too
            whole = (kernels.attention_rows_ok(self.embedding.params["weight"], self.cfg.d_k)
                     and not (self.training and self.cfg.attention_dropout))
            real = src != self.cfg.pad_id
            held = real.any(axis=1)
            if not held.all():   # its cross-attention would read no memory: packed and padded differ
                raise ConfigError(f"src row {int(np.argmin(held))} is all padding (id {self.cfg.pad_id}): "
                                  f"give every sentence at least one source piece (the data pipeline ends each "
                                  f"with </s>)")
            src_rows = make_rows(real, self.xp, whole=whole)
            # the kept target positions are the keys the decoder's attention sees where they are tgt_in's non-pads
            # (asked only where the attention on packed rows may read the rows' spans)
            keys = whole and np.array_equal(to_numpy(keep_tgt), host_in != self.cfg.pad_id)
            tgt_rows = make_rows(keep_tgt, self.xp, keys=keys, whole=whole)
            plans = self._embedding_plans(src, host_in, src_rows, tgt_rows)
        # the padding biases from the ids where they are (the host, in training: one copy each, no kernels); the
        # decoder's self-attention on packed rows masks by the rows' spans (kernels.attention_rows): no bias for it
        src_bias = padding_bias(src, self.cfg.pad_id, self.dtype, self.xp)
        tgt_bias = None if whole and tgt_rows is not None and tgt_rows.spans is not None else (
            causal_bias(tgt_in.shape[1], self.xp, self.dtype)[None, None]
            + padding_bias(tgt_in, self.cfg.pad_id, self.dtype, self.xp))
        # tgt_in onto the device: checked above where packed (host_in), else here
        src, tgt_in = to_device(src, self.xp), (to_device(host_in, self.xp) if keep_tgt is not None
                                                else self.check_ids("tgt_in", tgt_in))
        sites = self._dropout_sites()
        memory, src_bias, src_ids = self.encode(src, sites, src_rows, plans[0], src_bias)
        y = self._embed(tgt_in, tgt_rows, self.tgt_dropout, sites, plans[1])
        h = self.decoder.forward(y, memory, src_bias, tgt_bias, sites, tgt_rows, src_rows)
        self._cache = {"src_ids": src_ids, "tgt_ids": tgt_in, "src_rows": src_rows, "tgt_rows": tgt_rows,
                       "plans": plans, "h_shape": h.shape}
        self._head = None   # a forward without a loss: no backward of an earlier loss
        return h

    def forward(self, src, tgt_in):
        """src [B, S], tgt_in [B, T] int -> logits [B, T, V] = h @ embedding^T (3.4); -inf outside
        an output vocabulary. In training mode (a new model's) dropout applies and each call draws the next
        forward's masks, as forward_loss does: call eval() first for inference (decoding does)."""
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
        `self.last_stats` holds {'loss', 'nll_sum', 'n_tokens', 'loss_sum'}: the loss, the NLL sum
        and the loss times the token count (device scalars on a GPU), n_tokens the host's count on
        the CPU and the fused GPU path (the loss head drops the pad rows on the host first).
        """
        tgt_in, tgt_out = self._check_targets(tgt_in, tgt_out)
        keep = (tgt_in != self.cfg.pad_id) | (tgt_out != self.cfg.pad_id) if packed else None
        h = self.decoder_hidden(src, tgt_in, keep_tgt=keep)   # [N_t, D] packed, [B, T, D] plain
        h = h.reshape(-1, h.shape[-1])     # [N_t, D] ([B*T, D] plain or for a batch without padding)
        tgt_rows = self._cache["tgt_rows"]
        gold = tgt_out.reshape(-1) if tgt_rows is None else tgt_out.reshape(-1)[tgt_rows.host_index]   # [N_t]
        return self.loss_head(h, gold)

    # ------------------------------------------------------------------ backward
    def backward(self, loss_weight=1.0, loss_scale=None):
        """ACCUMULATES d(loss_weight * loss)/d(param) of the last forward_loss into the grads.

        loss_weight weighs this batch's loss in a sum: n / total for one of several
        accumulated micro-batches, times the float16 loss scale (optim.LossScaler); or that
        scale is loss_scale, a [1] device array (optim.UpdateCheck.loss_scale: the GPU path's)."""
        if self._cache is None:
            raise RuntimeError(BACKWARD_NEEDS)
        c, self._cache = self._cache, None
        dh = self.loss_head_backward(loss_weight, int(np.prod(c["h_shape"][:-1])), loss_scale)
        dy, dmemory = self.decoder.backward(dh.reshape(c["h_shape"]))
        # y = tgt_dropout(pack(embedding[tgt_in] * sqrt(D) + PE))
        self._embed_backward(dy, c["tgt_ids"], c["tgt_rows"], self.tgt_dropout, c["plans"][1])
        # memory = encoder(src_dropout(pack(embedding[src] * sqrt(D) + PE)))
        self._embed_backward(self.encoder.backward(dmemory), c["src_ids"], c["src_rows"], self.src_dropout,
                             c["plans"][0])

    def _embed_backward(self, dx, ids, rows, dropout, plan):
        # x = dropout(pack(rows, embedding[ids] * sqrt(D) + PE))
        if plan is not None:      # one kernel: mask, per-id sums in a fixed order, scale
            kernels.embedding_backward(dx.reshape(-1, dx.shape[-1]), dropout.take_mask(), plan,
                                       self.embedding.grads["weight"], self.embedding.scale)
            return
        self.embedding.lookup_backward(self.positional.backward(unpack(rows, dropout.backward(dx))), ids)

    def incremental_decoder(self, src, max_steps, use_cache=True, beam=1):
        """The decoder state beam search steps through (incremental.py: KV caches)."""
        return IncrementalDecoder(self, src, max_steps, use_cache, beam)
