"""Layer: parameters and gradients in two dicts with the same keys, children by name.

Conventions (each layer a forward/backward pair, as in llm.c): `forward` returns the output
and keeps in `self.cache` exactly what `backward` needs; `backward(dout)` returns the input
gradient(s) and ACCUMULATES into `self.grads`; one instance per call site (for a layer that keeps a cache).
"""
from ..backend import xp_of


class Grads(dict):
    """grads[name]: zeros like params[name] on first use, so a layer built on its own
    (`Linear(4, 3, rng)`) runs its backward; a model (Seq2Seq.finish_init) replaces them with views
    of one flat buffer."""

    def __init__(self, params):
        super().__init__()
        self._params = params

    def __missing__(self, name):
        p = self._params[name]
        self[name] = xp_of(p).zeros_like(p)
        return self[name]


class Layer:
    def __init__(self):
        self.params = {}
        self.grads = Grads(self.params)
        self.children = {}
        self.cache = None
        self.training = True

    def take_cache(self):
        """What forward kept for backward, handed over once: a RuntimeError naming the layer where there is none (a
        backward without a forward, or a second one for one forward), not a failure deep inside the backward."""
        cache, self.cache = self.cache, None
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward: no forward to go back through (call forward first; "
                               f"one backward per forward)")
        return cache

    def add(self, name, layer):
        self.children[name] = layer
        return layer

    def named_parameters(self, prefix=""):
        """Yields (dotted name, layer, key) for every parameter, depth first, in a fixed order."""
        for key in self.params:
            yield prefix + key, self, key
        for name, child in self.children.items():
            yield from child.named_parameters(f"{prefix}{name}.")

    def layers(self):
        yield self
        for child in self.children.values():
            yield from child.layers()

    def train(self, mode=True):
        for layer in self.layers():
            layer.training = mode
        return self

    def eval(self):
        return self.train(False)


def flatten_parameters(root, xp, dtype):
    """Move every parameter and gradient of `root` into one flat buffer each.

    Each `layer.params[key]` becomes a view into `flat_params` (likewise the grads), so a
    whole-model operation (zero_grad, Adam, loss scaling, averaging) is one array operation.
    Returns (names, flat_params, flat_grads, slices) with slices[name] = (start, stop, shape).
    """
    entries = list(root.named_parameters())
    total = sum(int(layer.params[key].size) for _, layer, key in entries)
    flat_p = xp.zeros(total, dtype=dtype)
    flat_g = xp.zeros(total, dtype=dtype)
    names, slices, start = [], {}, 0
    for name, layer, key in entries:
        p = layer.params[key]
        stop = start + int(p.size)
        flat_p[start:stop] = xp.asarray(p, dtype=dtype).ravel()
        layer.params[key] = flat_p[start:stop].reshape(p.shape)
        layer.grads[key] = flat_g[start:stop].reshape(p.shape)
        names.append(name)
        slices[name] = (start, stop, tuple(p.shape))
        start = stop
    return names, flat_p, flat_g, slices
