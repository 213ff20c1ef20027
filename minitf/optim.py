"""Adam (Kingma & Ba 2015) with the paper's beta1 0.9, beta2 0.98, eps 1e-9 (5.3).

State is keyed by parameter name (`state['m'][name]`), with ONE step counter for the
whole model. The moments are stored in flat buffers parallel to the model's flat
parameter buffer, so the update is a handful of whole-model array operations; the
per-name entries are views into them.
"""
import math

from .errors import CheckpointError


class Adam:
    def __init__(self, model, lr=1e-3, betas=(0.9, 0.98), eps=1e-9):
        self.model = model
        self.lr = lr                      # a float, or a callable step -> lr (e.g. NoamSchedule)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.step_count = 0
        xp = model.xp
        self._m = xp.zeros_like(model.weights)          # float32 under mixed precision
        self._v = xp.zeros_like(model.weights)
        self._tmp = xp.empty_like(model.weights)        # scratch for the update
        self._g = xp.empty_like(model.weights)          # scratch for unscaled gradients
        self.state = {"m": {n: model._view(self._m, n) for n in model.names},
                      "v": {n: model._view(self._v, n) for n in model.names}}

    def current_lr(self, step=None):
        step = self.step_count if step is None else step
        return self.lr(step) if callable(self.lr) else self.lr

    def step(self, grad_scale=1.0):
        """One update from the model's accumulated gradients (divided by grad_scale first)."""
        self.step_count += 1
        t = self.step_count
        lr = self.current_lr(t)
        g = self.model.flat_grads
        xp = self.model.xp
        m, v, p, tmp = self._m, self._v, self.model.weights, self._tmp
        # g = grads / grad_scale (loss scaling, accumulation) in the master precision, not in place
        if g.dtype != p.dtype:
            self._g[...] = g
            g = self._g
            if grad_scale != 1.0:
                g *= 1.0 / grad_scale
        elif grad_scale != 1.0:
            g = xp.multiply(g, 1.0 / grad_scale, out=self._g)
        # every operation writes into a preallocated buffer: no temporaries of model size
        # m = b1 m + (1 - b1) g
        m *= self.beta1
        m += xp.multiply(g, 1.0 - self.beta1, out=tmp)
        # v = b2 v + (1 - b2) g^2
        v *= self.beta2
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - self.beta2
        v += tmp
        # p -= lr * m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
        bc1 = 1.0 - self.beta1 ** t
        bc2 = 1.0 - self.beta2 ** t
        xp.sqrt(v, out=tmp)
        tmp *= 1.0 / math.sqrt(bc2)
        tmp += self.eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / bc1
        p -= tmp
        self.model.sync_weights()
        return lr

    def state_dict(self):
        """{'step': int, 'm.<name>': array, 'v.<name>': array} (live views)."""
        out = {"step": self.step_count}
        for key in ("m", "v"):
            for name, arr in self.state[key].items():
                out[f"{key}.{name}"] = arr
        return out

    def load_state_dict(self, state):
        from .backend import to_device, to_numpy
        self.step_count = int(state["step"])
        for key in ("m", "v"):
            for name, arr in self.state[key].items():
                src = state.get(f"{key}.{name}")
                if src is None or tuple(src.shape) != arr.shape:
                    raise CheckpointError(f"optimizer state {key}.{name} is missing or has the wrong shape")
                arr[...] = to_device(to_numpy(src), self.model.xp)


class LossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al. 2018).

    Backward runs on loss * scale so small gradients survive float16; the optimizer divides
    by the scale. A step whose gradients overflowed (inf/NaN) is skipped and the scale
    halved; after `growth_interval` good steps in a row the scale doubles.
    """

    def __init__(self, init_scale=2.0 ** 15, growth_interval=1000, min_scale=1.0):
        self.scale, self.growth_interval, self.min_scale = float(init_scale), growth_interval, min_scale
        self.good_steps = 0

    def update(self, grads_finite):
        """Record one step's outcome; returns True if the optimizer should step."""
        if not grads_finite:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True
