"""An independent PyTorch Transformer (Vaswani et al. 2017), written from the paper, that
loads minitf's named parameters. Used for cross-checks (float64, autograd gradients), as the eager-PyTorch
baseline of bench/train_step.py (and so of bench/gpu_ab.py, gpu_kernels.py and gpu_report.py), as
bench/same_training.py's torch runner, and as the model bench/torch_decode.py decodes (bench/decode.py --vs-torch).
PyTorch is NOT a dependency of minitf.

Parameters are kept as raw tensors under minitf's names with minitf's layout (every linear
is `x @ weight + bias`, weight [in, out]), so no transposes are needed when loading.
Model: shared embedding (source, target, output projection; inputs scaled by sqrt(D)),
sinusoidal or learned positions, post-norm layers LayerNorm(x + Dropout(sublayer(x))),
dropout on embedding sums and sublayer outputs (the strong path also applies attention_dropout
inside SDPA; ReLU dropout is not modelled), label-smoothed loss over non-pad tokens.
"""
import math
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def sinusoids(length, d_model, dtype, device):
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(same), pos from 0."""
    pos = torch.arange(length, dtype=torch.float64, device=device)[:, None]
    freq = torch.pow(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64, device=device) / d_model)
    pe = torch.zeros(length, d_model, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : d_model // 2]
    return pe.to(dtype)


class TorchTransformer:
    def __init__(self, params, cfg, autocast_fp16=False, strong=False):
        """params: {minitf name: leaf tensor with requires_grad}. strong: what a user choosing
        PyTorch for speed would write: attention through F.scaled_dot_product_attention (fused
        attention kernels) and, in `loss`, the output layer and softmax on the rows with a loss only."""
        self.p, self.cfg = params, cfg
        self.autocast_fp16, self.strong = autocast_fp16, strong
        self.training = True
        any_p = next(iter(params.values()))
        self.device, self.dtype = any_p.device, any_p.dtype

    # -- bookkeeping
    def parameters(self):
        return list(self.p.values())

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for t in self.p.values():
            t.grad = None

    def grad_dict(self):
        """{name: float64 numpy gradient} (zeros for parameters the loss did not touch)."""
        return {n: (t.grad if t.grad is not None else torch.zeros_like(t)).detach().cpu().double().numpy()
                for n, t in self.p.items()}

    # -- building blocks
    def _linear(self, name, x):
        return x @ self.p[name + ".weight"] + self.p[name + ".bias"]

    def _norm(self, name, x):
        return F.layer_norm(x, (x.shape[-1],), self.p[name + ".weight"], self.p[name + ".bias"],
                            self.cfg.layer_norm_eps)

    def _drop(self, x):
        return F.dropout(x, self.cfg.dropout, self.training) if self.cfg.dropout > 0 else x

    def _attention(self, name, x_q, x_kv, blocked):
        """Multi-head attention; blocked: bool, broadcastable to [B, H, T, S] in cross-attention, [B, H, L, L] in
        self-attention, True = may not
        attend."""
        h, dk = self.cfg.n_heads, self.cfg.d_k
        b, tq, tk = x_q.shape[0], x_q.shape[1], x_kv.shape[1]
        q = self._linear(name + ".q", x_q).view(b, tq, h, dk).transpose(1, 2)
        k = self._linear(name + ".k", x_kv).view(b, tk, h, dk).transpose(1, 2)
        v = self._linear(name + ".v", x_kv).view(b, tk, h, dk).transpose(1, 2)
        if self.strong:   # True in attn_mask = may attend
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked,
                                                 dropout_p=self.cfg.attention_dropout if self.training else 0.0)
            return self._linear(name + ".out", ctx.transpose(1, 2).reshape(b, tq, h * dk))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dk)
        weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
        heads = (weights @ v).transpose(1, 2).reshape(b, tq, h * dk)
        return self._linear(name + ".out", heads)

    def _ffn(self, name, x):
        return self._linear(name + ".fc2", torch.relu(self._linear(name + ".fc1", x)))

    def _embed(self, ids):
        d = self.cfg.d_model
        x = self.p["embedding.weight"][ids] * math.sqrt(d)
        n = ids.shape[1]
        if self.cfg.positional == "learned":
            pos = self.p["positional.weight"][:n]
        else:
            pos = sinusoids(n, d, x.dtype, x.device)
        return self._drop(x + pos)

    # -- model
    def forward(self, src, tgt_in, rows=None):
        """src [B, S], tgt_in [B, T] int64 tensors -> logits [B, T, V] (rows: an index of the
        flattened [B*T] positions: logits [len(rows), V] of those positions only)."""
        cfg = self.cfg
        half = {True: torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(self.autocast_fp16)
        ctx = torch.autocast(self.device.type, dtype=half) if half is not None else nullcontext()
        with ctx:
            src_pad = (src == cfg.pad_id)[:, None, None, :]                     # [B,1,1,S]
            t = tgt_in.shape[1]
            future = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)
            tgt_blocked = future[None, None] | (tgt_in == cfg.pad_id)[:, None, None, :]  # [B,1,T,T]

            x = self._embed(src)
            for i in range(cfg.n_layers):
                n = f"encoder.layers.{i}"
                x = self._norm(n + ".norm1", x + self._drop(self._attention(n + ".self_attn", x, x, src_pad)))
                x = self._norm(n + ".norm2", x + self._drop(self._ffn(n + ".ffn", x)))
            memory = x

            y = self._embed(tgt_in)
            for i in range(cfg.n_decoder_layers):
                n = f"decoder.layers.{i}"
                y = self._norm(n + ".norm1", y + self._drop(self._attention(n + ".self_attn", y, y, tgt_blocked)))
                y = self._norm(n + ".norm2", y + self._drop(self._attention(n + ".cross_attn", y, memory, src_pad)))
                y = self._norm(n + ".norm3", y + self._drop(self._ffn(n + ".ffn", y)))
            if rows is not None:
                y = y.reshape(-1, y.shape[-1])[rows]
            return y @ self.p["embedding.weight"].t()

    def loss(self, src, tgt_in, tgt_out):
        """Mean over non-pad tokens of (1-eps) * -log p[gold] + eps * mean_v(-log p[v])."""
        if self.strong:   # the rows with a loss only (the index found once per batch)
            key = (tgt_out.data_ptr(), tuple(tgt_out.shape))
            if getattr(self, "_rows_key", None) != key:
                self._rows_key, self._rows = key, torch.nonzero(tgt_out.reshape(-1) != self.cfg.pad_id)[:, 0]
            tgt_out = tgt_out.reshape(-1)[self._rows]
            logits = self.forward(src, tgt_in, self._rows)
        else:
            logits = self.forward(src, tgt_in)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        nll = -logp.gather(-1, tgt_out[..., None])[..., 0]
        smooth = -logp.mean(dim=-1)
        eps = self.cfg.label_smoothing
        per_token = (1.0 - eps) * nll + eps * smooth
        keep = (tgt_out != self.cfg.pad_id).to(per_token.dtype)
        return (per_token * keep).sum() / keep.sum().clamp(min=1.0)


def as_ids(a, device="cpu"):
    """An int array (NumPy) -> int64 torch tensor on `device`."""
    return torch.as_tensor(np.asarray(a), dtype=torch.int64, device=device)


def from_minitf_state(state_dict, cfg, dtype="float32", device="cpu", autocast_fp16=False, strong=False):
    """A TorchTransformer holding copies of minitf's parameters ({name: NumPy/CuPy array}).

    dtype: 'float32' or 'float64' (the master weights); autocast_fp16 (True or "float16", or
    "bfloat16") runs the forward under torch.autocast of that dtype (mixed precision, for speed
    benches); strong: TorchTransformer's.
    """
    if getattr(cfg, "output_vocab", None):
        raise SystemExit("the PyTorch model scores the paper's joint vocabulary; this minitf model has an output "
                         "vocabulary (--output-vocab target): compare a model trained with --output-vocab joint")
    if getattr(cfg, "norm_position", "post") != "post":
        raise SystemExit("the PyTorch model is the paper's post-norm Transformer; this minitf model is pre-norm "
                         "(--norm pre): compare a model trained with --norm post")
    tdtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    params = {}
    for name, arr in state_dict.items():
        host = arr.get() if hasattr(arr, "get") and not isinstance(arr, np.ndarray) else np.asarray(arr)
        params[name] = torch.tensor(host, dtype=tdtype, device=device).requires_grad_(True)
    return TorchTransformer(params, cfg, autocast_fp16=autocast_fp16, strong=strong)
