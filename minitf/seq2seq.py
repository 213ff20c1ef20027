"""What every translation model of minitf shares (the Transformer, model.py; the recurrent
RNNSearch, rnn.py): the flat parameter and gradient buffers every layer's arrays are views of,
the input checks, the dropout sites, and the loss head (logits = h @ embedding^T over
the rows with a target token, label-smoothed cross-entropy, paper 3.4 and 5.4).

A model subclass builds its layers (with `self.embedding` the tied TokenEmbedding), calls
`self.finish_init()`, and provides `forward_loss`, `backward` and `incremental_decoder` (the
object beam search steps through: decode.py); `forward_backward` (training's) is both, here.
Training, checkpoints, averaging and decoding drive only this surface.
"""
import threading

import numpy as np

from .backend import (DTYPES, check_gpu_dtype, dtype_named, get_xp, half_dtype, is_gpu, keep_freed_memory, to_device,
                      to_numpy, xp_of)
from .config import Config
from .functional import DropoutSites
from .kernels import accum_dtype
from .errors import CheckpointError, ConfigError
from .layers import Layer, flatten_parameters
from .loss import label_smoothed_nll, label_smoothed_nll_backward


# a backward's cache is the last forward's: a decoding or scoring forward between (translate, score) drops it
BACKWARD_NEEDS = ("backward() needs a forward_loss() first (one backward per forward; a translation or scoring "
                  "call in between takes the layers' caches: call backward() before it, or forward_loss() again)")


class Seq2Seq(Layer):
    ARCH = None   # the Config's arch of the model class (architectures.ARCHS)

    def __init__(self, cfg, device="cpu", dtype="float32", seed=0):
        super().__init__()
        if not isinstance(cfg, Config):
            raise ConfigError(f"{type(self).__name__}(cfg): expected a minitf.Config, got {type(cfg).__name__} "
                              f"(Config(**fields), Config.from_dict(d) or Config.preset(name, vocab_size=V) makes one)")
        if self.ARCH is not None and cfg.arch != self.ARCH:   # (its checkpoint would record the other architecture)
            raise ConfigError(f"{type(self).__name__} is the model of arch {self.ARCH!r}, and this Config's arch is "
                              f"{cfg.arch!r}: minitf.architectures.build_model(cfg) builds the model a Config names")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be 'float32', 'float64', or 'float16' or 'bfloat16' (mixed precision), "
                              f"got {dtype!r}")
        self.cfg, self.device, self.seed = cfg, device, int(seed)
        self.xp = get_xp(device)
        if not is_gpu(self.xp):
            keep_freed_memory()
        self.dtype = dtype_named(dtype)
        if is_gpu(self.xp):
            check_gpu_dtype(self.dtype)
        elif self.dtype.name == "bfloat16":
            raise ConfigError("bfloat16 (--bf16) is for device='gpu': NumPy has no bfloat16 arithmetic of its own "
                              "(ml_dtypes' loops widen products to float32); on the CPU use float32, or float16")
        self.forward_count = 0  # training forward i draws its dropout masks from DropoutSites(seed, i)
        self._cache = None   # what backward needs of the last forward (the model's own)
        self._head = None    # what loss_head_backward needs of the last loss_head
        self._loss_grad = None   # forward_backward's (loss_weight, loss_scale) while its forward runs
        self.decode_lock = threading.RLock()   # one decoding or scoring at a time (decode.decoding)

    def new_rng(self, seed):
        """The generator the layers draw their initial weights from; a model built by
        architectures.parameter_shapes gets one that draws nothing (its arrays are broadcast zeros)."""
        return _ShapesOnly() if getattr(self, "_shapes_only", False) else np.random.default_rng(seed)

    def finish_init(self):
        """After the layers are built: move every parameter into the flat buffers."""
        if getattr(self, "_shapes_only", False):   # architectures.parameter_shapes: the layer tree is all it needs
            return
        # float16 or bfloat16 = mixed precision (Micikevicius et al. 2018): float32 master weights
        # (and Adam state) updated by the optimizer, 16-bit copies for every activation and matmul
        self.master_params = None
        if half_dtype(self.dtype):
            self.master_params = flatten_parameters(self, self.xp, np.float32)[1]
        self.names, self.flat_params, self.flat_grads, self.slices = flatten_parameters(self, self.xp, self.dtype)
        self.embedding.use_output_vocabulary(self.cfg.output_ids(), self.cfg.unk_id, self.xp)

    # ------------------------------------------------------------------ inputs, dropout
    def check_ids(self, name, ids, host=False):
        """ids as a 2-D integer array on the host (host=True) or the model's device; a one-line
        ConfigError naming `name` when they are not, are longer than learned positions cover, or (ids on the host:
        checked without a device sync) hold a piece id outside the vocabulary, where a negative one would index the
        embedding from its end."""
        given = to_numpy(ids) if host or isinstance(ids, (list, tuple)) else ids
        if given.ndim != 2 or given.dtype.kind not in "iu":
            raise ConfigError(f"{name} must be a 2-D integer array [batch, length], got {given.dtype} {given.shape}")
        if given.shape[1] == 0:   # (a reduction over no position had failed inside NumPy)
            raise ConfigError(f"{name} {given.shape}: no position in it (a sentence is its pieces and EOS, at least "
                              f"one id)")
        if isinstance(given, np.ndarray) and given.size:    # on the host: no device sync
            low, high = int(given.min()), int(given.max())
            if low < 0 or high >= self.cfg.vocab_size:
                raise ConfigError(f"{name} holds the piece id {low if low < 0 else high}: ids must lie in "
                                  f"[0, {self.cfg.vocab_size}), the vocabulary")
        ids = given if host else to_device(given, self.xp)
        if self.cfg.positional == "learned" and ids.shape[1] > self.cfg.max_len:
            raise ConfigError(f"{name} has length {ids.shape[1]} but learned positions cover max_len "
                              f"{self.cfg.max_len}: shorten it (sinusoidal positions have no limit)")
        return ids

    def _check_targets(self, tgt_in, tgt_out):
        """Host copies of tgt_in, tgt_out [B, T] (the row bookkeeping runs on the host: no GPU sync)."""
        tgt_in, tgt_out = self.check_ids("tgt_in", tgt_in, host=True), self.check_ids("tgt_out", tgt_out, host=True)
        if tgt_out.shape != tgt_in.shape:
            raise ConfigError(f"tgt_out shape {tgt_out.shape} != tgt_in shape {tgt_in.shape}")
        if not (tgt_out != self.cfg.pad_id).any():
            raise ConfigError(f"tgt_out {tgt_out.shape} is all padding (id {self.cfg.pad_id}): no target token to "
                              f"take a loss over")
        return tgt_in, tgt_out

    def _dropout_sites(self):
        """The dropout masks of this forward (None in eval mode or without dropout). Nothing is
        set up: a mask is a function of (seed, forward index, site, position)."""
        if not self.training or not (self.cfg.dropout or self.cfg.attention_dropout or self.cfg.relu_dropout):
            return None
        sites = DropoutSites(self.seed, self.forward_count)
        self.forward_count += 1
        return sites

    # ------------------------------------------------------------------ the loss head
    def loss_head(self, h, gold):
        """h [rows, D] decoder outputs, gold [rows] host ids (pad: no loss) -> loss averaged over the
        non-pad tokens. Only the rows with a loss are projected to the vocabulary (logits
        [N, V], or [N, V_o] over an output vocabulary, which the gold ids become columns of).
        Returns a float on CPU; on GPU a 0-d array (no host sync). Sets last_stats."""
        pad, loss_rows = self.cfg.pad_id, None                       # the rows of h with a loss ([N])
        if (gold == pad).any():
            host_rows = np.flatnonzero(gold != pad)
            loss_rows = to_device(host_rows, self.xp)
            h, gold = h[loss_rows], gold[host_rows]
        logits, _ = self.embedding.project(h)                                               # [N, V_o]
        gold = to_device(self.embedding.columns(gold), self.xp)      # the pad rows are gone: no pad id below
        loss, nll_sum, n, cache = label_smoothed_nll(logits, gold, self.cfg.label_smoothing, None,
                                                     grad=self._loss_grad)
        self._head = {"loss": cache, "loss_rows": loss_rows, "h_rows": h}
        # the loss summed over the tokens, as training adds it up: made by the fused loss's totals launch
        # (kernels.loss_totals), else loss * n (a float on the CPU)
        loss_sum = getattr(cache, "loss_sum", None)
        self.last_stats = {"loss": loss, "nll_sum": nll_sum, "n_tokens": n,
                           "loss_sum": (float(loss) * float(n) if self.xp is np else loss * n) if loss_sum is None else loss_sum}
        return float(loss) if self.xp is np else loss

    def forward_backward(self, src, tgt_in, tgt_out, loss_weight=1.0, loss_scale=None):
        """forward_loss(src, tgt_in, tgt_out), then backward(loss_weight, loss_scale): the loss, its
        gradients ACCUMULATED. The same numbers as the two calls; on the fused GPU path (unless
        MINITF_FUSED_LOSS=0) the loss's gradient is written during its forward, by the kernel that reads
        the logits where the 16-byte loads apply (label_smoothed_nll's grad). Training's update calls this."""
        self._check_loss_scale(loss_scale)
        self._loss_grad = (loss_weight, loss_scale)
        try:
            loss = self.forward_loss(src, tgt_in, tgt_out)
        finally:
            self._loss_grad = None
        self.backward(loss_weight, loss_scale)
        return loss

    def _check_loss_scale(self, loss_scale):
        """A loss_scale is a [1] array of the model's array module in the dtype the loss's gradient is computed in
        (float32 for 16-bit models: optim.UpdateCheck's): the GPU kernels read its bits as that dtype."""
        if loss_scale is None:
            return
        want = np.dtype(accum_dtype(self.dtype))
        if xp_of(loss_scale) is not self.xp or getattr(loss_scale, "shape", None) != (1,) \
                or loss_scale.dtype != want:
            raise TypeError(f"loss_scale must be a [1] {want.name} array on the model's device ({self.device}) for a "
                            f"{self.dtype.name} model; got {type(loss_scale).__name__} "
                            f"{getattr(loss_scale, 'dtype', '')} {list(getattr(loss_scale, 'shape', ()))}")

    def loss_head_backward(self, loss_weight, n_rows, loss_scale=None):
        """-> dh [n_rows, D] (zero on rows without a loss); accumulates the projection's d embedding.
        loss_scale: a [1] device array the gradient is also multiplied by (model.backward)."""
        if self._head is None:
            raise RuntimeError(BACKWARD_NEEDS)
        self._check_loss_scale(loss_scale)
        c, self._head = self._head, None
        dlogits = label_smoothed_nll_backward(c["loss"], loss_weight, loss_scale)
        # logits = h[loss_rows] @ embedding[output ids]^T
        dh = self.embedding.project_backward(dlogits, c["h_rows"])
        if c["loss_rows"] is not None:
            dh_all = self.xp.zeros((n_rows, dh.shape[-1]), dtype=self.dtype)
            dh_all[c["loss_rows"]] = dh
            dh = dh_all
        return dh

    def zero_grad(self):
        self.flat_grads.fill(0)

    # ------------------------------------------------------------------ parameters
    @property
    def weights(self):
        """The flat buffer the optimizer updates: the float32 master copy under mixed
        precision, else the parameters themselves."""
        return self.flat_params if self.master_params is None else self.master_params

    def sync_weights(self):
        """Mixed precision: refresh the 16-bit compute copy from the float32 master weights."""
        if self.master_params is not None:
            self.flat_params[...] = self.master_params

    def state_dict(self):
        """{name: array} — live views of the parameters (float32 masters under mixed precision)."""
        return {name: self.view(self.weights, name) for name in self.names}

    def grad_dict(self):
        return {name: self.view(self.flat_grads, name) for name in self.names}

    def view(self, flat, name):
        """The parameter `name`'s part of a flat buffer (weights, gradients, Adam's moments), as a view."""
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
            self.view(self.weights, name)[...] = to_device(to_numpy(params[name]), self.xp)
        self.sync_weights()

    def num_parameters(self):
        return int(self.flat_params.size)


class _ShapesOnly:
    """A stand-in for numpy's Generator whose draws are read-only broadcast zeros of the asked
    shape: no memory, so a model's parameter shapes cost nothing to learn (architectures.parameter_shapes)."""

    def uniform(self, low=0.0, high=1.0, size=None):
        return np.broadcast_to(np.float64(0.0), () if size is None else size)

    normal = uniform
