"""Central-difference gradient checking in float64 (shared by the gradcheck tests)."""
import numpy as np

TOL = 1e-6   # relative error bound; a wrong transpose or a missing term gives O(1)
H = 1e-5     # central-difference step
ZERO = 1e-9  # both gradients below this norm: identically zero up to round-off


def rel_err(a, b):
    """||a - b|| / max(||a||, ||b||, 1e-30): a whole-tensor relative error."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b), 1e-30))


def numeric_grad(f, x, h=H):
    """d f() / d x by central differences, perturbing x in place (x float64)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        fp = f()
        flat[i] = old - h
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * h)
    return g


# parameters whose true gradient is 0: the key projection's bias (softmax ignores a shift of a query's every score;
# docs/deviations.md). Any other parameter or input whose gradient comes out 0 both ways fails: one the forward
# never reads (a bias left out of forward and backward alike) agrees with central differences at 0.
ZERO_GRADIENT = ("k.bias",)
OFF_INIT = 0.1   # the parameters are moved this far (standard deviation) from their initial values before a check


def check(name, analytic, f, x):
    """Assert the analytic gradient of f w.r.t. x matches central differences. Returns the relative error, or None
    where both are 0 (which the callers allow only for ZERO_GRADIENT's parameters)."""
    numeric = numeric_grad(f, x)
    if max(np.linalg.norm(analytic), np.linalg.norm(numeric)) < ZERO:
        return None
    err = rel_err(analytic, numeric)
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL} (|analytic|={np.linalg.norm(analytic):.3e})"
    return err


def check_layer(layer, inputs, forward, backward, rng, skip_inputs=()):
    """Gradcheck every parameter and every float input of a layer, its parameters moved off their initial values
    first (OFF_INIT).

    forward(*inputs) -> output array (caches for backward); backward(dout) -> input grads
    (a tuple aligned with the float inputs). The scalar checked is sum(output * R).
    """
    from minitf.layers import flatten_parameters
    flatten_parameters(layer, np, np.float64)
    for _, l, key in layer.named_parameters():   # off the initial zero biases and unit gains: a wrong term must show
        l.params[key] += OFF_INIT * rng.standard_normal(l.params[key].shape)
    out = forward(*inputs)
    r = rng.standard_normal(out.shape)

    def loss():
        return float((forward(*inputs) * r).sum())

    before = {}   # gradients already there: a backward must ADD to them (one that assigns loses other terms)
    for pname, l, key in layer.named_parameters():
        l.grads[key][...] = rng.standard_normal(l.grads[key].shape)
        before[pname] = l.grads[key].copy()
    forward(*inputs)
    dins = backward(r)
    if not isinstance(dins, tuple):
        dins = (dins,)
    errs = {}
    for pname, l, key in list(layer.named_parameters()):
        errs[pname] = check(pname, l.grads[key] - before[pname], loss, l.params[key])
    float_inputs = [i for i, x in enumerate(inputs) if isinstance(x, np.ndarray) and x.dtype == np.float64
                    and i not in skip_inputs]
    assert len(float_inputs) == len(dins), (len(float_inputs), len(dins))
    for i, din in zip(float_inputs, dins):
        errs[f"input{i}"] = check(f"input {i}", din, loss, inputs[i])
    _only_known_zeros(errs)
    return errs


def _only_known_zeros(errs):
    zero = [name for name, err in errs.items() if err is None and not name.endswith(ZERO_GRADIENT)]
    assert not zero, f"gradient 0 both ways (the forward does not read it?): {', '.join(zero)}"


def check_model(model, src, tgt_in, tgt_out, packed=True):
    """Gradcheck every parameter of a whole model's forward_loss (the same dropout masks on
    every call; `packed`: forward_loss's layout), its parameters moved off their initial values first; returns the
    number of parameters checked. The gradient buffers hold random values before the backward, which must add to
    them."""
    def loss():
        model.forward_count = 0
        return model.forward_loss(src, tgt_in, tgt_out, packed=packed)

    model.flat_params[...] += OFF_INIT * np.random.default_rng(11).standard_normal(model.flat_params.shape)
    model.zero_grad()
    model.flat_grads[...] = np.random.default_rng(7).standard_normal(model.flat_grads.shape)
    before = {n: g.copy() for n, g in model.grad_dict().items()}
    loss()
    model.backward()
    grads = {n: g - before[n] for n, g in model.grad_dict().items()}
    params = model.state_dict()
    _only_known_zeros({name: check(name, grads[name], loss, params[name]) for name in model.names})
    return len(params)
