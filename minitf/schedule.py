"""Learning-rate schedule of paper 5.3 (eq. 3), a pure function."""


def noam(step, d_model, warmup, factor=1.0):
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1.

    Rises linearly for `warmup` steps, peaks at step == warmup, then decays as step^-0.5.
    """
    step = max(int(step), 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class NoamSchedule:
    """Callable lr(step) for Adam: noam with fixed d_model, warmup and factor."""

    def __init__(self, d_model, warmup, factor=1.0):
        self.d_model, self.warmup, self.factor = d_model, warmup, factor

    def __call__(self, step):
        return noam(step, self.d_model, self.warmup, self.factor)
