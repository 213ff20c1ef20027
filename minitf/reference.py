"""The Transformer of "Attention Is All You Need" and one training step, written plainly.

This file is for reading, top to bottom. It is the same model and the same step as the
engine (minitf.Transformer, minitf.Adam), written the way one would write it from the paper:
plain NumPy on [B, L, D] arrays (pad positions computed like the others, then masked), one
function per sublayer, each backward right after its forward and each backward line under
a comment quoting the forward line it differentiates, as in llm.c's train_gpt2.c. No packing,
no fused kernels, no flat buffers, no activation overwritten in place. It imports nothing
but NumPy; `python minitf/reference.py` trains it for a few steps on a toy batch.
tests/test_reference.py holds it equal to the engine in float64: loss, logits and every
gradient, dropout off and on, and Adam steps, on a fixed batch and over random configurations; tests/test_reference_gradcheck.py holds its
every backward to central differences on its own. The derivations: docs/derivations/.

Left out (the engine's options outside the paper; tests/test_reference_gradcheck.py checks
this list against the config's fields): attention and ReLU dropout (`attention_dropout`,
`relu_dropout`, docs/deviations.md item 10); an output layer over the target side's pieces
(`output_vocab`, `output_layer`: the small preset's, so the default CPU run is not this
step); pre-norm blocks (`norm_position`); the learning rate's fade (`lr_fade`); the recurrent
baseline (`arch`); the options of models imported from Marian (`activation` swish, `output_bias`;
docs/interop.md). Nor, outside the config, the engine's `--update-freq` accumulation (a loss
weighted by its batch's share of the update), float16 with loss scaling (`--fp16`) or bfloat16
(`--bf16`), the all-reduce of several processes' gradients (under mpiexec), or pad-free packing (the same numbers:
docs/walkthrough.md). init_params builds d_k = D / H; a d_k set apart (Table 3 row (B)) runs
here only with parameters the engine made.

Shapes: B batch, S source length, T target length (padding included; L for either),
D d_model, H heads, K d_k = d_v, F d_ff, V vocabulary, I and O a linear layer's input and output
widths, N target tokens with a loss (non-pad in tgt_out: the loss is their mean). A [B, L, D] array is [B*L, D] rows to a matrix product.

Parameters live in one dict {name: array} with the engine's names
(`encoder.layers.0.self_attn.q.weight`, ...). Every backward with parameters takes the upstream
gradient and the forward's cache, RETURNS the input gradient(s) (the embedding's, a leaf, none) and ADDS (+=)
into grads[name]:
a parameter used in several places (the tied embedding: source lookup, target lookup and
output projection; the learned positions: both stacks) simply collects the sum.

Dropout: the caller passes `mask_fn(site, shape)` -> mask (0 or 1/(1 - p), so the mask's expected value is 1).
The sites are numbered in the order the forward visits them: 0 the source embedding, then
two per encoder layer (attention, FFN), then the target embedding, then three per decoder
layer (self-attention, cross-attention, FFN). mask_fn=None: no dropout (evaluation).
"""
import numpy as np

NEG_INF = -1e9   # additive mask bias: exp(NEG_INF - max) underflows to exactly 0


# ---------------------------------------------------------------------------- parameters
def init_params(V, D, F, n_layers, rng, learned_max_len=None, n_decoder_layers=None):
    """{name: array}: the tied embedding [V, D], normal with std D^-1/2; every linear layer's weight
    [d_in, d_out] Xavier-uniform and bias zero; LayerNorm gain 1, bias 0. With
    learned_max_len, learned positions [max_len, D] (Table 3 row E) instead of sinusoids.
    n_layers encoder layers, and n_decoder_layers (default: as many) decoder layers."""
    p = {"embedding.weight": rng.normal(0.0, D ** -0.5, size=(V, D))}
    if learned_max_len:
        p["positional.weight"] = rng.normal(0.0, D ** -0.5, size=(learned_max_len, D))

    def linear(name, d_in, d_out):
        a = np.sqrt(6.0 / (d_in + d_out))
        p[name + ".weight"] = rng.uniform(-a, a, size=(d_in, d_out))
        p[name + ".bias"] = np.zeros(d_out)

    def attention(name):                       # H heads: columns i*K..(i+1)*K-1 of q, k, v (K = D / H)
        for proj in ("q", "k", "v", "out"):
            linear(f"{name}.{proj}", D, D)

    def layernorm(name):
        p[name + ".weight"], p[name + ".bias"] = np.ones(D), np.zeros(D)

    def ffn(name):
        linear(name + ".fc1", D, F)
        linear(name + ".fc2", F, D)

    for l in range(n_layers):
        attention(f"encoder.layers.{l}.self_attn")
        layernorm(f"encoder.layers.{l}.norm1")
        ffn(f"encoder.layers.{l}.ffn")
        layernorm(f"encoder.layers.{l}.norm2")
    for l in range(n_layers if n_decoder_layers is None else n_decoder_layers):
        attention(f"decoder.layers.{l}.self_attn")
        layernorm(f"decoder.layers.{l}.norm1")
        attention(f"decoder.layers.{l}.cross_attn")
        layernorm(f"decoder.layers.{l}.norm2")
        ffn(f"decoder.layers.{l}.ffn")
        layernorm(f"decoder.layers.{l}.norm3")
    return p


# ---------------------------------------------------------------------------- linear
def linear_forward(x, params, name):
    """y = x W + b: x [B, L, I], W [I, O], b [O] -> y [B, L, O]."""
    return x @ params[name + ".weight"] + params[name + ".bias"]


def linear_backward(dy, x, params, grads, name):
    """dy [B, L, O] -> dx [B, L, I]; dW += x^T dy and db += sum dy over all B*L rows."""
    w = params[name + ".weight"]
    i, o = w.shape
    # y = x @ W + b
    grads[name + ".weight"] += x.reshape(-1, i).T @ dy.reshape(-1, o)
    grads[name + ".bias"] += dy.reshape(-1, o).sum(axis=0)
    return dy @ w.T


# ---------------------------------------------------------------------------- layernorm
def layernorm_forward(x, params, name, eps):
    """Layer normalisation (Ba et al. 2016; the LayerNorm of 3.1's LayerNorm(x + Sublayer(x))): each position over
    its D features (biased variance, eps inside the root), then a gain and a bias per feature:
    x [B, L, D] -> y [B, L, D], cache (xhat, rstd)."""
    mu = x.mean(axis=-1, keepdims=True)                          # [B, L, 1]
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)           # [B, L, 1]
    rstd = 1.0 / np.sqrt(var + eps)                              # [B, L, 1]
    xhat = (x - mu) * rstd                                       # [B, L, D]
    y = xhat * params[name + ".weight"] + params[name + ".bias"]
    return y, (xhat, rstd)


def layernorm_backward(dy, cache, params, grads, name):
    """dy [B, L, D] -> dx [B, L, D]; adds into the gain's and the bias's gradients."""
    xhat, rstd = cache
    d = dy.shape[-1]
    # y = xhat * g + b
    grads[name + ".weight"] += (dy * xhat).reshape(-1, d).sum(axis=0)
    grads[name + ".bias"] += dy.reshape(-1, d).sum(axis=0)
    dxhat = dy * params[name + ".weight"]
    # xhat = (x - mu) * rstd, mu and rstd functions of x (docs/derivations/layernorm.md)
    return rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                   - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))


# ---------------------------------------------------------------------------- dropout
def dropout_forward(x, mask_fn, site):
    """Inverted dropout (5.4): y = x * mask, mask = mask_fn(site, x.shape); no mask_fn: y = x."""
    if mask_fn is None:
        return x, None
    mask = mask_fn(site, x.shape)
    return x * mask, mask


def dropout_backward(dy, mask):
    """dy -> dx: the forward's mask again (no mask: dropout was off)."""
    if mask is None:
        return dy
    # y = x * mask
    return dy * mask


# ---------------------------------------------------------------------------- multi-head attention
def split_heads(x, n_heads):
    """[B, L, H*K] -> [B, H, L, K]: head i is columns i*K..(i+1)*K-1."""
    b, l, hk = x.shape
    return x.reshape(b, l, n_heads, hk // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x):
    """[B, H, L, K] -> [B, L, H*K]: the paper's Concat(head_1, ..., head_H)."""
    b, h, l, k = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, l, h * k)


def softmax(s):
    """Over the last axis, max subtracted (no overflow; a NEG_INF entry gets exactly 0)."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_forward(x_q, x_kv, bias, params, name, n_heads):
    """The paper's MultiHead(Q, K, V) = Concat(head_1..head_H) W_out, head_i = Attention(Q W_i^Q, K W_i^K,
    V W_i^V) (its Q, K, V: queries, keys, values), here Attention = softmax(q k^T / sqrt(d_k) + bias) v
    with q, k, v the projected heads (3.2.1, 3.2.2).
    x_q [B, T, D] queries, x_kv [B, S, D] keys and values, bias [B, 1, T or 1, S]
    (0: may attend, NEG_INF: masked) -> y [B, T, D]: the decoder's cross-attention; in a
    self-attention both are [B, L, D] and the bias [B, 1, L or 1, L]."""
    q = split_heads(linear_forward(x_q, params, name + ".q"), n_heads)     # [B, H, T, K]
    k = split_heads(linear_forward(x_kv, params, name + ".k"), n_heads)    # [B, H, S, K]
    v = split_heads(linear_forward(x_kv, params, name + ".v"), n_heads)    # [B, H, S, K]
    c = 1.0 / np.sqrt(q.shape[-1])
    s = (c * q) @ k.swapaxes(-1, -2) + bias                                # [B, H, T, S]
    p = softmax(s)                                                         # [B, H, T, S]
    ctx = merge_heads(p @ v)                                               # [B, T, H*K]
    y = linear_forward(ctx, params, name + ".out")                         # [B, T, D]
    return y, (x_q, x_kv, q, k, v, p, ctx)


def attention_backward(dy, cache, params, grads, name):
    """dy [B, T, D] -> (dx_q [B, T, D], dx_kv [B, S, D]): one gradient per input; the caller
    adds them where x_q and x_kv are the same array (self-attention)."""
    x_q, x_kv, q, k, v, p, ctx = cache
    n_heads = q.shape[1]
    c = 1.0 / np.sqrt(q.shape[-1])
    # y = ctx @ W_out + b_out
    dctx = split_heads(linear_backward(dy, ctx, params, grads, name + ".out"), n_heads)   # [B, H, T, K]
    # ctx = merge_heads(p @ v)
    dp = dctx @ v.swapaxes(-1, -2)                                         # [B, H, T, S]
    dv = p.swapaxes(-1, -2) @ dctx                                         # [B, H, S, K]
    # p = softmax(s)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))                   # [B, H, T, S]
    # s = (c q) @ k^T + bias        (s = a b^T: da = ds b, db = ds^T a; the bias is a constant)
    dq = c * (ds @ k)                                                      # [B, H, T, K]
    dk = ds.swapaxes(-1, -2) @ (c * q)                                     # [B, H, S, K]
    # q = split_heads(x_q @ W_q + b_q), k and v likewise from x_kv
    dx_q = linear_backward(merge_heads(dq), x_q, params, grads, name + ".q")
    dx_kv = (linear_backward(merge_heads(dk), x_kv, params, grads, name + ".k")
             + linear_backward(merge_heads(dv), x_kv, params, grads, name + ".v"))
    return dx_q, dx_kv


# ---------------------------------------------------------------------------- feed-forward
def ffn_forward(x, params, name):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (3.3): x [B, L, D] -> [B, L, D], hidden [B, L, F]."""
    h = np.maximum(0.0, linear_forward(x, params, name + ".fc1"))          # [B, L, F]
    return linear_forward(h, params, name + ".fc2"), (x, h)


def ffn_backward(dy, cache, params, grads, name):
    """dy [B, L, D] -> dx [B, L, D]; adds into both linear layers' gradients."""
    x, h = cache
    # y = h @ W2 + b2
    dh = linear_backward(dy, h, params, grads, name + ".fc2")              # [B, L, F]
    # h = max(0, x @ W1 + b1)       (h > 0 exactly where the pre-activation is > 0)
    return linear_backward(dh * (h > 0), x, params, grads, name + ".fc1")


# ---------------------------------------------------------------------------- encoder and decoder layers
def encoder_layer_forward(x, src_bias, params, name, n_heads, eps, mask_fn, site):
    """Post-norm (3.1): h = LN1(x + Drop(SelfAttn(x))), y = LN2(h + Drop(FFN(h))).
    x [B, S, D] -> y [B, S, D]; dropout sites `site`, `site + 1`."""
    a, attn = attention_forward(x, x, src_bias, params, name + ".self_attn", n_heads)
    a, mask1 = dropout_forward(a, mask_fn, site)
    h, norm1 = layernorm_forward(x + a, params, name + ".norm1", eps)
    f, ffn = ffn_forward(h, params, name + ".ffn")
    f, mask2 = dropout_forward(f, mask_fn, site + 1)
    y, norm2 = layernorm_forward(h + f, params, name + ".norm2", eps)
    return y, (attn, mask1, norm1, ffn, mask2, norm2)


def encoder_layer_backward(dy, cache, params, grads, name):
    """dy [B, S, D] -> dx [B, S, D]; adds into the layer's parameters' gradients."""
    attn, mask1, norm1, ffn, mask2, norm2 = cache
    # y = LN2(h + Drop(FFN(h)))
    dz = layernorm_backward(dy, norm2, params, grads, name + ".norm2")
    dh = dz + ffn_backward(dropout_backward(dz, mask2), ffn, params, grads, name + ".ffn")
    # h = LN1(x + Drop(SelfAttn(x, x)))      (x is used three times: residual, queries, keys/values)
    dz = layernorm_backward(dh, norm1, params, grads, name + ".norm1")
    dx_q, dx_kv = attention_backward(dropout_backward(dz, mask1), attn, params, grads, name + ".self_attn")
    return dz + dx_q + dx_kv


def decoder_layer_forward(y, memory, src_bias, tgt_bias, params, name, n_heads, eps, mask_fn, site):
    """Post-norm (3.1): h1 = LN1(y + Drop(SelfAttn(y))) (masked, 3.2.3), h2 = LN2(h1 + Drop(CrossAttn(h1, memory))),
    o = LN3(h2 + Drop(FFN(h2))). y [B, T, D], memory [B, S, D] -> o [B, T, D]; dropout
    sites `site`, `site + 1`, `site + 2`."""
    a, self_attn = attention_forward(y, y, tgt_bias, params, name + ".self_attn", n_heads)
    a, mask1 = dropout_forward(a, mask_fn, site)
    h1, norm1 = layernorm_forward(y + a, params, name + ".norm1", eps)
    a, cross_attn = attention_forward(h1, memory, src_bias, params, name + ".cross_attn", n_heads)
    a, mask2 = dropout_forward(a, mask_fn, site + 1)
    h2, norm2 = layernorm_forward(h1 + a, params, name + ".norm2", eps)
    f, ffn = ffn_forward(h2, params, name + ".ffn")
    f, mask3 = dropout_forward(f, mask_fn, site + 2)
    o, norm3 = layernorm_forward(h2 + f, params, name + ".norm3", eps)
    return o, (self_attn, mask1, norm1, cross_attn, mask2, norm2, ffn, mask3, norm3)


def decoder_layer_backward(do, cache, params, grads, name):
    """do [B, T, D] -> (dy [B, T, D], dmemory [B, S, D])."""
    self_attn, mask1, norm1, cross_attn, mask2, norm2, ffn, mask3, norm3 = cache
    # o = LN3(h2 + Drop(FFN(h2)))
    dz = layernorm_backward(do, norm3, params, grads, name + ".norm3")
    dh2 = dz + ffn_backward(dropout_backward(dz, mask3), ffn, params, grads, name + ".ffn")
    # h2 = LN2(h1 + Drop(CrossAttn(h1, memory)))
    dz = layernorm_backward(dh2, norm2, params, grads, name + ".norm2")
    dx_q, dmemory = attention_backward(dropout_backward(dz, mask2), cross_attn, params, grads, name + ".cross_attn")
    dh1 = dz + dx_q
    # h1 = LN1(y + Drop(SelfAttn(y, y)))
    dz = layernorm_backward(dh1, norm1, params, grads, name + ".norm1")
    dx_q, dx_kv = attention_backward(dropout_backward(dz, mask1), self_attn, params, grads, name + ".self_attn")
    return dz + dx_q + dx_kv, dmemory


# ---------------------------------------------------------------------------- embeddings and masks
def sinusoids(length, d):
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(pos / 10000^(2i/D)) (3.5): [L, D]. Written
    position by position, as the formula reads (the engine builds the table with array operations: the two are
    compared through the whole model in tests/test_reference.py)."""
    pe = np.zeros((length, d))
    for pos in range(length):
        for i in range(0, d, 2):                 # i = 2i of the formula: the even feature of each pair
            angle = pos / 10000.0 ** (i / d)
            pe[pos, i] = np.sin(angle)
            if i + 1 < d:                        # an odd D has no cosine for its last sine
                pe[pos, i + 1] = np.cos(angle)
    return pe


def positions(params, length, d):
    """[L, D]: the learned table's first L rows if the model has one, else the sinusoids
    (defined for every position: no length limit)."""
    if "positional.weight" not in params:
        return sinusoids(length, d)
    table = params["positional.weight"]
    if length > table.shape[0]:
        raise ValueError(f"length {length} exceeds the learned positions' max_len {table.shape[0]}")
    return table[:length]


def embed(ids, params):
    """ids [B, L] -> E[ids] * sqrt(D) + PE[:L] [B, L, D] (3.4, 3.5); E the tied embedding, PE the positions."""
    e = params["embedding.weight"]
    return e[ids] * np.sqrt(e.shape[1]) + positions(params, ids.shape[1], e.shape[1])


def embed_backward(dx, ids, params, grads):
    """Adds the lookup's share of dE (and dPE for learned positions); ids get no gradient."""
    d = dx.shape[-1]
    # x = E[ids] * sqrt(D) + PE[:L]     (np.add.at: a token that occurs twice gets both rows)
    np.add.at(grads["embedding.weight"], ids, dx * np.sqrt(d))
    if "positional.weight" in params:
        grads["positional.weight"][: ids.shape[1]] += dx.sum(axis=0)


def padding_bias(ids, pad_id):
    """ids [B, L] -> [B, 1, 1, L]: NEG_INF on pad keys, 0 elsewhere (a pad position is attended by no query; a
    query whose keys are all pads would spread its weight evenly over them: every source holds a piece)."""
    return ((ids == pad_id) * NEG_INF)[:, None, None, :]


def causal_bias(length):
    """[T, T]: NEG_INF above the diagonal (query i sees keys j <= i): the decoder's self-attention only, "preventing
    leftward information flow" (3.2.3)."""
    return np.triu(np.full((length, length), NEG_INF), k=1)


# ---------------------------------------------------------------------------- the loss
def label_smoothed_loss(logits, gold, eps, pad_id):
    """Cross-entropy against q = (1 - eps) onehot(gold) + eps / V (5.4), averaged over the
    N non-pad gold tokens: logits [B, T, V], gold [B, T] -> loss, cache."""
    v = logits.shape[-1]
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))               # [B, T, V] log softmax
    q = (1.0 - eps) * np.eye(v)[gold] + eps / v                            # [B, T, V] sums to 1
    w = (gold != pad_id).astype(logits.dtype)                              # [B, T] 1: a token with a loss
    n = max(w.sum(), 1.0)                                                  # N (1 for an all-pad batch)
    loss = (w * -(q * logp).sum(axis=-1)).sum() / n
    return loss, (logp, q, w, n)


def label_smoothed_loss_backward(cache):
    """-> dloss/dlogits [B, T, V]: softmax minus the smoothed target, weighted by 1/N on the tokens with a loss."""
    logp, q, w, n = cache
    # loss = sum_bt w * (-sum_v q log softmax(logits)) / N       (sum_v q = 1)
    return (w / n)[..., None] * (np.exp(logp) - q)                         # [B, T, V]


# ---------------------------------------------------------------------------- the model
def n_layers(params, stack):
    """How many layers the stack ("encoder" or "decoder") has in `params` (each has one norm1)."""
    return sum(1 for name in params if name.startswith(f"{stack}.layers.") and name.endswith(".norm1.weight"))


def forward(params, src, tgt_in, tgt_out, n_heads, mask_fn=None, label_smoothing=0.1, pad_id=0, ln_eps=1e-5):
    """src [B, S], tgt_in [B, T] (BOS + target), tgt_out [B, T] (target + EOS) int ->
    (loss, logits [B, T, V], cache for backward)."""
    n_enc, n_dec = n_layers(params, "encoder"), n_layers(params, "decoder")
    src_bias = padding_bias(src, pad_id)                                               # [B, 1, 1, S]
    t = tgt_in.shape[1]
    tgt_bias = causal_bias(t)[None, None] + padding_bias(tgt_in, pad_id)              # [B, 1, T, T]
    # encoder: x = Drop(E[src] sqrt(D) + PE), then the layers; dropout sites 0, 1 .. 2 n_enc
    x, src_mask = dropout_forward(embed(src, params), mask_fn, 0)                      # [B, S, D]
    enc = []
    for l in range(n_enc):
        x, c = encoder_layer_forward(x, src_bias, params, f"encoder.layers.{l}", n_heads, ln_eps, mask_fn, 1 + 2 * l)
        enc.append(c)
    memory = x                                                                         # [B, S, D]
    # decoder: y = Drop(E[tgt_in] sqrt(D) + PE), then the layers; sites 1 + 2 n_enc, ...
    site = 1 + 2 * n_enc
    y, tgt_mask = dropout_forward(embed(tgt_in, params), mask_fn, site)                # [B, T, D]
    dec = []
    for l in range(n_dec):
        y, c = decoder_layer_forward(y, memory, src_bias, tgt_bias, params, f"decoder.layers.{l}", n_heads,
                                     ln_eps, mask_fn, site + 1 + 3 * l)
        dec.append(c)
    h = y                                                                              # [B, T, D]
    # the output projection, tied to the embedding (3.4), then the loss
    logits = h @ params["embedding.weight"].T                                          # [B, T, V]
    loss, loss_cache = label_smoothed_loss(logits, tgt_out, label_smoothing, pad_id)
    cache = {"src": src, "tgt_in": tgt_in, "src_mask": src_mask, "tgt_mask": tgt_mask, "enc": enc, "dec": dec,
             "h": h, "loss": loss_cache}
    return loss, logits, cache


def backward(params, cache):
    """-> grads {name: array}, d loss / d params, the same names and shapes as params."""
    grads = {name: np.zeros_like(p) for name, p in params.items()}
    e, h = params["embedding.weight"], cache["h"]
    v, d = e.shape
    # loss = label_smoothed_loss(logits, tgt_out)
    dlogits = label_smoothed_loss_backward(cache["loss"])                              # [B, T, V]
    # logits = h @ E^T                 (the output projection's share of dE)
    grads["embedding.weight"] += dlogits.reshape(-1, v).T @ h.reshape(-1, d)
    dy = dlogits @ e                                                                   # [B, T, D]
    # y = decoder layers (y, memory): every layer's cross-attention adds to dmemory
    dmemory = 0.0
    for l in reversed(range(len(cache["dec"]))):
        dy, dm = decoder_layer_backward(dy, cache["dec"][l], params, grads, f"decoder.layers.{l}")
        dmemory = dmemory + dm
    # y = Drop(E[tgt_in] sqrt(D) + PE)     (the target lookup's share of dE)
    embed_backward(dropout_backward(dy, cache["tgt_mask"]), cache["tgt_in"], params, grads)
    # memory = encoder layers (x)      (complete only now: the decoder ran first)
    dx = dmemory
    for l in reversed(range(len(cache["enc"]))):
        dx = encoder_layer_backward(dx, cache["enc"][l], params, grads, f"encoder.layers.{l}")
    # x = Drop(E[src] sqrt(D) + PE)        (the source lookup's share of dE)
    embed_backward(dropout_backward(dx, cache["src_mask"]), cache["src"], params, grads)
    return grads


# ---------------------------------------------------------------------------- Adam and the schedule
def noam(step, d_model, warmup, factor=1.0):
    """lrate = factor * D^-0.5 * min(step^-0.5, step * warmup^-1.5) (5.3, eq. 3), step from 1."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def adam_state(params):
    """Adam's state: the step count t and the moments m, v of every parameter (zeros)."""
    return {"t": 0, "m": {n: np.zeros_like(p) for n, p in params.items()},
            "v": {n: np.zeros_like(p) for n, p in params.items()}}


def adam_step(params, grads, state, lr, beta1=0.9, beta2=0.98, eps=1e-9, weight_decay=0.0):
    """One Adam update (Kingma & Ba 2015, with bias correction; the paper's betas and eps, 5.3), with
    AdamW's decoupled weight decay when weight_decay > 0 (not in the paper): returns the new params
    dict (the old arrays are left as they were)."""
    state["t"] += 1
    t = state["t"]
    new = {}
    for name, p in params.items():
        g = grads[name]
        state["m"][name] = beta1 * state["m"][name] + (1 - beta1) * g
        state["v"][name] = beta2 * state["v"][name] + (1 - beta2) * g * g
        m_hat = state["m"][name] / (1 - beta1 ** t)
        v_hat = state["v"][name] / (1 - beta2 ** t)
        new[name] = p * (1 - lr * weight_decay) - lr * m_hat / (np.sqrt(v_hat) + eps)
    return new


# ---------------------------------------------------------------------------- one training step
def train_step(params, state, src, tgt_in, tgt_out, n_heads, warmup, lr_factor=1.0, mask_fn=None, weight_decay=0.0,
               **loss_kw):
    """Forward, backward, Adam at the learning rate of eq. 3 for the coming step:
    returns (new params, loss). `loss_kw`: label_smoothing, pad_id, ln_eps of forward."""
    loss, _, cache = forward(params, src, tgt_in, tgt_out, n_heads, mask_fn, **loss_kw)
    grads = backward(params, cache)
    lr = noam(state["t"] + 1, params["embedding.weight"].shape[1], warmup, lr_factor)
    return adam_step(params, grads, state, lr, weight_decay=weight_decay), loss


if __name__ == "__main__":   # python minitf/reference.py: a toy batch, 60 steps, the loss falls
    rng = np.random.default_rng(0)
    params = init_params(V=12, D=16, F=32, n_layers=2, rng=rng)
    src = np.array([[5, 6, 7, 3], [8, 9, 3, 0]])                # pieces + EOS (3), pad 0
    tgt_in = np.array([[2, 7, 6, 5], [2, 9, 8, 0]])             # BOS (2) + the reversed pieces
    tgt_out = np.array([[7, 6, 5, 3], [9, 8, 3, 0]])            # the reversed pieces + EOS
    state, p = adam_state(params), 0.1

    def mask_fn(site, shape):                                   # dropout masks: 0 or 1 / (1 - p)
        return (rng.random(shape) >= p) / (1 - p)

    for step in range(1, 61):
        params, loss = train_step(params, state, src, tgt_in, tgt_out, n_heads=2, warmup=20, lr_factor=0.5,
                                  mask_fn=mask_fn)
        if step % 10 == 0:
            print(f"step {step:2d}  loss {loss:.3f}")
