"""Transformer (paper 3, Figure 1): embeddings -> encoder stack -> decoder stack -> logits.

Owns weight tying (3.4: one matrix for source embedding, target embedding and the
pre-softmax projection), the masks, the dropout random stream, and the flat parameter
and gradient buffers every layer's arrays are views of.
"""
import numpy as np

from .backend import get_xp, is_gpu, keep_freed_memory, make_rng, to_device, to_numpy
from .blocks import Decoder, Encoder
from .errors import CheckpointError, ConfigError
from .layers import Dropout, Layer, LearnedPositional, SinusoidalPositional, TokenEmbedding, flatten_parameters
from .loss import label_smoothed_nll, label_smoothed_nll_backward
from .packing import make_rows, pack, unpack

NEG_INF = -1e9  # additive mask value; exp(NEG_INF - max) underflows to exactly 0
NEG_INF_HALF = -3e4  # float16 cannot hold -1e9; exp(-3e4) is still exactly 0 in float32


def _neg_inf(dtype):
    return NEG_INF_HALF if np.dtype(dtype) == np.float16 else NEG_INF


def padding_bias(ids, pad_id, dtype):
    """ids [B, L] -> [B, 1, 1, L] additive bias: NEG_INF on pad keys, 0 elsewhere."""
    return ((ids == pad_id).astype(dtype) * _neg_inf(dtype))[:, None, None, :]


def causal_bias(length, xp, dtype):
    """[L, L] additive bias: NEG_INF above the diagonal (position i sees only j <= i)."""
    return xp.triu(xp.full((length, length), _neg_inf(dtype), dtype=dtype), k=1)


class Transformer(Layer):
    def __init__(self, cfg, device="cpu", dtype="float32", seed=0):
        super().__init__()
        if dtype not in ("float32", "float64", "float16"):
            raise ConfigError(f"dtype must be 'float32', 'float64' or 'float16' (mixed precision), got {dtype!r}")
        self.cfg, self.device, self.seed = cfg, device, int(seed)
        self.xp = get_xp(device)
        if not is_gpu(self.xp):
            keep_freed_memory()
        self.dtype = np.dtype(dtype)
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
        # float16 = mixed precision (Micikevicius et al. 2018): float32 master weights (and Adam
        # state) updated by the optimizer, float16 copies for every activation and matmul
        self.master_params = None
        if self.dtype == np.float16:
            self.master_params = flatten_parameters(self, self.xp, np.float32)[1]
        self.names, self.flat_params, self.flat_grads, self.slices = flatten_parameters(self, self.xp, self.dtype)
        self.forward_count = 0  # dropout stream position: forward i uses make_rng(seed, i)
        self._cache = None

    # ------------------------------------------------------------------ forward
    def _check_ids(self, name, ids, host=False):
        ids = to_numpy(ids) if host else to_device(ids, self.xp)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ConfigError(f"{name} must be a 2-D integer array [batch, length], got {ids.dtype} {ids.shape}")
        if self.cfg.positional == "learned" and ids.shape[1] > self.cfg.max_len:
            raise ConfigError(f"{name} has length {ids.shape[1]} but learned positions cover max_len "
                              f"{self.cfg.max_len}: shorten it (sinusoidal positions have no limit)")
        return ids

    def _dropout_rng(self):
        if not self.training or self.cfg.dropout == 0.0:
            return None
        rng = make_rng(self.xp, self.seed * 1_000_003 + self.forward_count)
        self.forward_count += 1
        return rng

    def encode(self, src, rng=None, rows=None):
        """src [B, S] -> (memory [B, S, D], src_bias [B, 1, 1, S], src ids cached for backward).

        With `rows` (packing.Rows of the non-pad source positions) memory is [Ns, D]."""
        src_bias = padding_bias(src, self.cfg.pad_id, self.dtype)
        x_emb, src_ids = self.embedding.lookup(src)
        x = self.src_dropout.forward(pack(rows, self.positional.forward(x_emb)), rng)
        return self.encoder.forward(x, src_bias, rng, rows), src_bias, src_ids

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
        rng = self._dropout_rng()
        memory, src_bias, src_ids = self.encode(src, rng, src_rows)
        t = tgt_in.shape[1]
        tgt_bias = causal_bias(t, self.xp, self.dtype)[None, None] + padding_bias(tgt_in, self.cfg.pad_id, self.dtype)
        y_emb, tgt_ids = self.embedding.lookup(tgt_in)
        y = self.tgt_dropout.forward(pack(tgt_rows, self.positional.forward(y_emb)), rng)
        h = self.decoder.forward(y, memory, src_bias, tgt_bias, rng, tgt_rows, src_rows)
        self._cache = {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_rows": src_rows, "tgt_rows": tgt_rows,
                       "h_shape": h.shape}
        return h

    def forward(self, src, tgt_in):
        """src [B, S], tgt_in [B, T] int -> logits [B, T, V] = h @ embedding^T (3.4)."""
        logits, _ = self.embedding.project(self.decoder_hidden(src, tgt_in))
        return logits

    def forward_loss(self, src, tgt_in, tgt_out, packed=True):
        """Label-smoothed loss averaged over non-pad tokens of tgt_out [B, T].

        Pad-free (packing.py, the default): the layers run on the non-pad positions only (the
        target positions kept are those non-pad in tgt_in or tgt_out), and only the rows of h
        with a loss (tgt_out non-pad) are projected to the vocabulary. `packed=False` is the
        plain path the derivation pages describe: every layer on [B, L, D], pads included
        (slower; for reading and tests). Loss and gradients are the same either way.
        Returns a float on CPU; on GPU a 0-d CuPy array (no host sync; float() it to read).
        `self.last_stats` holds {'loss', 'nll_sum', 'n_tokens'} as device scalars.
        """
        # the row bookkeeping runs on host copies of the ids (no GPU sync)
        tgt_in, tgt_out = self._check_ids("tgt_in", tgt_in, host=True), self._check_ids("tgt_out", tgt_out, host=True)
        if tgt_out.shape != tgt_in.shape:
            raise ConfigError(f"tgt_out shape {tgt_out.shape} != tgt_in shape {tgt_in.shape}")
        pad = self.cfg.pad_id
        keep = (tgt_in != pad) | (tgt_out != pad) if packed else None
        h = self.decoder_hidden(src, tgt_in, keep_tgt=keep)   # [Nt, D] packed, [B, T, D] plain
        h = h.reshape(-1, h.shape[-1])     # [Nt, D] ([B*T, D] plain or for a batch without padding)
        tgt_rows = self._cache["tgt_rows"]
        gold = tgt_out.reshape(-1) if tgt_rows is None else tgt_out.reshape(-1)[tgt_rows.host_index]   # [Nt]
        loss_rows = None                                             # the rows of h with a loss ([N])
        if (gold == pad).any():
            host_rows = np.flatnonzero(gold != pad)
            loss_rows = to_device(host_rows, self.xp)
            h, gold = h[loss_rows], gold[host_rows]
        gold = to_device(gold, self.xp)
        logits, _ = self.embedding.project(h)                                               # [N, V]
        loss, nll_sum, n, cache = label_smoothed_nll(logits, gold, self.cfg.label_smoothing, pad)
        self._cache.update(loss=cache, loss_rows=loss_rows, h_rows=h)
        self.last_stats = {"loss": loss, "nll_sum": nll_sum, "n_tokens": n}
        return float(loss) if self.xp is np else loss

    # ------------------------------------------------------------------ backward
    def backward(self, loss_weight=1.0):
        """ACCUMULATES d(loss_weight * loss)/d(param) of the last forward_loss into the grads.

        loss_weight weighs this batch's loss in a sum: n / total for one of several
        accumulated micro-batches, times the float16 loss scale (optim.LossScaler)."""
        if self._cache is None or "loss" not in self._cache:
            raise RuntimeError("backward() needs a forward_loss() first (and only one backward per forward)")
        c, self._cache = self._cache, None
        dlogits = label_smoothed_nll_backward(c["loss"], loss_weight)
        # logits = h[loss_rows] @ embedding^T
        dh = self.embedding.project_backward(dlogits, c["h_rows"])
        if c["loss_rows"] is not None:
            dh_all = self.xp.zeros((int(np.prod(c["h_shape"][:-1])), dh.shape[-1]), dtype=self.dtype)
            dh_all[c["loss_rows"]] = dh
            dh = dh_all
        dy, dmemory = self.decoder.backward(dh.reshape(c["h_shape"]))
        # y = tgt_dropout(pack(embedding[tgt_in] * sqrt(D) + PE))
        dy = self.positional.backward(unpack(c["tgt_rows"], self.tgt_dropout.backward(dy)))
        self.embedding.lookup_backward(dy, c["tgt_ids"])
        # memory = encoder(src_dropout(pack(embedding[src] * sqrt(D) + PE)))
        dx = self.positional.backward(unpack(c["src_rows"], self.src_dropout.backward(self.encoder.backward(dmemory))))
        self.embedding.lookup_backward(dx, c["src_ids"])

    def zero_grad(self):
        self.flat_grads.fill(0)

    # ------------------------------------------------------------------ parameters
    @property
    def weights(self):
        """The flat buffer the optimizer updates: the float32 master copy under mixed
        precision, else the parameters themselves."""
        return self.flat_params if self.master_params is None else self.master_params

    def sync_weights(self):
        """Mixed precision: refresh the float16 compute copy from the float32 master weights."""
        if self.master_params is not None:
            self.flat_params[...] = self.master_params

    def state_dict(self):
        """{name: array} — live views of the parameters (float32 masters under mixed precision)."""
        return {name: self._view(self.weights, name) for name in self.names}

    def grad_dict(self):
        return {name: self._view(self.flat_grads, name) for name in self.names}

    def _view(self, flat, name):
        start, stop, shape = self.slices[name]
        return flat[start:stop].reshape(shape)

    def load_state_dict(self, params):
        """Copy arrays (NumPy or CuPy) into the parameters; names and shapes must match exactly."""
        missing = [n for n in self.names if n not in params]
        unexpected = [n for n in params if n not in self.slices]
        if missing or unexpected:
            raise CheckpointError(f"state dict does not fit the model: missing {missing[:5]}"
                                  f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
        for name in self.names:
            shape = self.slices[name][2]
            if tuple(params[name].shape) != shape:
                raise CheckpointError(f"parameter {name}: checkpoint shape {tuple(params[name].shape)} != model shape {shape}")
        for name in self.names:
            self._view(self.weights, name)[...] = to_device(to_numpy(params[name]), self.xp)
        self.sync_weights()

    def num_parameters(self):
        return int(self.flat_params.size)
