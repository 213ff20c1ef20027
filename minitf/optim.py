"""Adam (Kingma & Ba 2015) with the paper's beta1 0.9, beta2 0.98, eps 1e-9 (5.3), and optional
decoupled weight decay (AdamW, Loshchilov & Hutter 2019; not in the paper: 0 in base, big and tiny,
0.1 in the Transformer's small, 0 with --arch rnn).

State is keyed by parameter name (`state['m'][name]`), with ONE step counter for the
whole model. The moments are stored in flat buffers parallel to the model's flat
parameter buffer, so the update is a handful of whole-model array operations; the
per-name entries are views into them.
"""
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import kernels
from .backend import HostCopy, is_gpu, to_device, usable_cores
from .errors import CheckpointError

_POOL = []
_BLOCK = 1 << 15   # elements per cache-sized block of a CPU update (Adam._update_blocks)


def _pool():
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=usable_cores(), thread_name_prefix="minitf-adam"))
    return _POOL[0]


def _chunks(xp, n, min_chunk=1 << 20):
    """Slices splitting a CPU update of n elements over the cores (one slice on a GPU or
    for small models: elementwise NumPy runs on one core otherwise)."""
    k = 1 if is_gpu(xp) else max(1, min(usable_cores(), n // min_chunk))
    edges = [n * i // k for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def _check_settings(lr, betas, eps, weight_decay):
    """A ValueError (TypeError for what is no number) naming the first of Adam's settings out of its range."""
    def number(name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"Adam: {name}={value!r}: expected a number")
        return float(value)
    if not callable(lr) and not number("lr", lr) >= 0:
        raise ValueError(f"Adam: lr={lr!r}: expected 0 or more, or a function of the step (e.g. NoamSchedule)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"Adam: betas={betas!r}: expected two numbers (beta1, beta2)")
    for name, beta in zip(("betas[0]", "betas[1]"), betas):
        if not 0 <= number(name, beta) < 1:
            raise ValueError(f"Adam: {name}={beta!r}: expected 0 or more and below 1")
    if not number("eps", eps) > 0:
        raise ValueError(f"Adam: eps={eps!r}: expected more than 0")
    if not number("weight_decay", weight_decay) >= 0:
        raise ValueError(f"Adam: weight_decay={weight_decay!r}: expected 0 or more")


class Adam:
    """Adam (paper 5.3: betas 0.9, 0.98, eps 1e-9) over a model's flat parameter buffer, with decoupled weight decay
    (AdamW) when weight_decay > 0. lr: a number, or a function of the step (1, 2, ...) such as
    `minitf.NoamSchedule(d_model, warmup)`, the paper's schedule. `step()` applies the gradients the model holds (then
    `model.zero_grad()` before the next forward); `state_dict()` / `load_state_dict()` keep the step and both moments,
    as checkpoints do."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0):
        _check_settings(lr, betas, eps, weight_decay)
        self.model = model
        self.lr = lr                      # a float, or a callable step -> lr (e.g. NoamSchedule)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay  # AdamW's lambda: each update p -= lr * lambda * p
        self.step_count = 0
        xp = model.xp
        self._m = xp.zeros_like(model.weights)          # float32 under mixed precision
        self._v = xp.zeros_like(model.weights)
        self._tmp = xp.empty_like(model.weights)        # scratch for the update
        self._g = xp.empty_like(model.weights)          # scratch for unscaled gradients
        self.state = {"m": {n: model.view(self._m, n) for n in model.names},
                      "v": {n: model.view(self._v, n) for n in model.names}}

    def current_lr(self, step=None):
        """The learning rate of `step` (default: the last step taken): lr itself, or lr(step) for a schedule."""
        step = self.step_count if step is None else step
        return self.lr(step) if callable(self.lr) else self.lr

    def fused(self):
        """Whether the update is one kernel (kernels.adam_update): on a GPU whose fused kernels are on
        and compiled (kernels.enabled), unless MINITF_FUSED_ADAM=0."""
        return kernels.fused(self._m, "adam")

    def step(self, grad_divisor=1.0, lr_scale=1.0, lr=None, check=None):
        """One update from the model's accumulated gradients, divided by grad_divisor first
        (the float16 loss scale the backward multiplied in; 1 without it: float32, float64, bfloat16), with
        the schedule's learning rate times lr_scale, or `lr` when given (the update's rate,
        schedule.learning_rate, as training passes it). Returns the rate used.

        check: an UpdateCheck whose outcome of this update is on the device (the fused kernel only):
        the kernel makes the update only if the outcome says so, dividing by the loss scale the
        outcome holds (grad_divisor is not used). The step is counted now; when the outcome, read
        later, says the update was skipped, the caller takes the count back (`step_count -= 1`)
        before the next step."""
        self.step_count += 1
        t = self.step_count
        lr = self.current_lr(t) * lr_scale if lr is None else lr
        coef = (1.0 / grad_divisor, lr, 1.0 - self.beta1 ** t, 1.0 - self.beta2 ** t)
        fused = self.fused()
        if check is not None and not fused:
            raise ValueError("Adam.step(check=...) needs the fused update (a GPU with the fused kernels, MINITF_FUSED_ADAM not 0)")
        if fused:   # one kernel over the flat buffers (+ the 16-bit copy)
            self._fused_update(coef, None if check is None else check.ctl)
            return lr
        bufs = (self.model.flat_grads, self._m, self._v, self.model.weights, self._tmp, self._g)
        chunks = _chunks(self.model.xp, bufs[0].size)
        block = None if is_gpu(self.model.xp) else _BLOCK
        if len(chunks) == 1:
            self._update_blocks(bufs, coef, block)
        else:  # NumPy releases the GIL in its loops: the chunks run on all cores
            list(_pool().map(lambda c: self._update_blocks([b[c] for b in bufs], coef, block), chunks))
        self.model.sync_weights()
        return lr

    def _fused_update(self, coef, ctl=None):
        """_update's passes and sync_weights as one kernel (kernels.adam_update): the same
        operations per element, in the master weights' precision (ctl: UpdateCheck.ctl)."""
        inv_scale, lr, bc1, bc2 = coef
        m = self.model
        copy = m.flat_params if m.master_params is not None else None
        kernels.adam_update(m.flat_grads, self._m, self._v, m.weights, copy,
                            (inv_scale, self.beta1, self.beta2, 1.0 - lr * self.weight_decay, 1.0 / math.sqrt(bc2),
                             self.eps, lr / bc1), ctl=ctl)

    def _update_blocks(self, bufs, coef, block):
        """The update of one slice, `block` elements at a time on a CPU: its dozen elementwise
        passes then run over a few hundred KB that stay in the core's cache instead of streaming
        the whole model through memory each time (40% less time on a 7.6M-parameter model,
        docs/performance.md). The same arithmetic per element: the result does not change."""
        n = bufs[0].size
        if block is None or n <= block:
            return self._update(bufs, coef)
        for a in range(0, n, block):
            self._update([b[a:a + block] for b in bufs], coef)

    def _update(self, bufs, coef):
        g, m, v, p, tmp, gbuf = bufs
        inv_scale, lr, bc1, bc2 = coef
        xp = self.model.xp
        # g = grads / grad_divisor (undo the loss scaling) in the master precision, not in place
        if g.dtype != p.dtype:
            gbuf[...] = g
            g = gbuf
            if inv_scale != 1.0:
                g *= inv_scale
        elif inv_scale != 1.0:
            g = xp.multiply(g, inv_scale, out=gbuf)
        # every operation writes into a preallocated buffer: no temporaries of model size
        # m = b1 m + (1 - b1) g
        m *= self.beta1
        m += xp.multiply(g, 1.0 - self.beta1, out=tmp)
        # v = b2 v + (1 - b2) g^2
        v *= self.beta2
        xp.multiply(g, g, out=tmp)
        tmp *= 1.0 - self.beta2
        v += tmp
        # p -= lr * lambda * p (AdamW: the decay acts on the weights, not through the moments)
        if self.weight_decay:
            p *= 1.0 - lr * self.weight_decay
        # p -= lr * m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
        xp.sqrt(v, out=tmp)
        tmp *= 1.0 / math.sqrt(bc2)
        tmp += self.eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / bc1
        p -= tmp

    def state_dict(self):
        """{'step': int, 'm.<name>': array, 'v.<name>': array} (live views)."""
        out = {"step": self.step_count}
        for key in ("m", "v"):
            for name, arr in self.state[key].items():
                out[f"{key}.{name}"] = arr
        return out

    def load_state_dict(self, state):
        """The step and both moments of `state_dict()` (or of a checkpoint's optimizer state), into this Adam's
        buffers on its model's device."""
        from .backend import to_numpy
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


class UpdateCheck:
    """An update's outcome decided on the device, so that a GPU step never waits for the GPU
    (docs/performance.md, "The step without a sync"). The host's rules (train._skipped: a
    non-finite loss or gradient skips the update; under --fp16 an overflow halves the loss scale,
    `growth_interval` good updates double it) run in one kernel, kernels.update_check, which
    writes `ctl`; Adam.step(check=) reads it there, and the loss backward reads the scale there
    (`loss_scale`). The host reads the outcome (`check` returns a backend.HostCopy) an update
    later, while the next update computes, and replays the same rules on its LossScaler, so the
    two agree without a copy back. ctl [8], the accumulation dtype: the loss scale, the good
    updates since it last changed, 1 / the scale the update used, ok, the loss and NLL sums,
    grads finite, loss finite (OUTCOME names them)."""
    OUTCOME = ("scale", "good", "inv_scale", "ok", "loss_sum", "nll_sum", "grads_finite", "loss_finite")

    @staticmethod
    def applies(opt):
        """Whether an update of `opt`'s model ends on the device: on a GPU with the fused Adam,
        unless the environment sets MINITF_HOST_CHECK=1 (the host reads each outcome at once, as on
        the CPU: for comparisons, bench/gpu_ab.py)."""
        return is_gpu(opt.model.xp) and opt.fused() and not kernels.switched_on("MINITF_HOST_CHECK")

    def __init__(self, model, scaler=None):
        xp = model.xp
        self.model, self.scaler = model, scaler
        self.ctl = xp.zeros(len(self.OUTCOME), dtype=kernels.accum_dtype(model.dtype))
        self.counter = xp.zeros(2, dtype=np.uint32)
        self.copies = [HostCopy(xp, self.ctl.size, self.ctl.dtype) for _ in range(2)]   # this update's, the last's
        self._turn = 0
        self.load()

    def load(self):
        """The device's loss scale and good-update count from the host's LossScaler (at the start,
        and after a resume restored it): one host->device copy."""
        s = self.scaler
        host = np.array([s.scale if s else 1.0, s.good_steps % s.growth_interval if s else 0.0], dtype=self.ctl.dtype)
        self.ctl[:2] = to_device(host, self.model.xp)

    @property
    def loss_scale(self):
        """The loss scale on the device ([1], a view of ctl) for the loss backward; None without one."""
        return self.ctl[:1] if self.scaler is not None else None

    def check(self, loss_sum, nll_sum, world):
        """Queues the outcome of the update whose gradients are in the model's flat buffer (summed
        over the ranks): its loss and NLL sums (device scalars), summed over the ranks too, then
        kernels.update_check. Returns the HostCopy to read it from (dict(zip(OUTCOME, copy.result())))."""
        xp = self.model.xp
        loss_sum, nll_sum = (xp.asarray(s, dtype=self.ctl.dtype) for s in (loss_sum, nll_sum))
        if world.size > 1:   # every rank decides the same
            totals = world.allreduce_sum(xp.stack([loss_sum, nll_sum]))
            loss_sum, nll_sum = totals[0], totals[1]
        kernels.update_check(self.model.flat_grads, loss_sum, nll_sum, self.ctl, self.counter, self.scaler)
        copy = self.copies[self._turn]
        self._turn ^= 1
        copy.start(self.ctl)
        return copy
