"""Learning-rate schedule of paper 5.3 (eq. 3), a pure function, and an optional linear fade
to zero over the end of a run whose length is known (not in the paper: docs/deviations.md).
`learning_rate` is the rate of an update: training, `plot lr` and the docs compute it there."""


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


def fade(progress, fraction):
    """Multiplier of the learning rate at `progress` (0 at the start of the run, 1 at its end:
    the larger of steps / max_steps and seconds / time budget): 1 until the last `fraction` of
    the run, then falling linearly to 0 at its end. fraction 0 = no fade (the paper)."""
    if fraction <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / fraction))


def learning_rate(step, d_model, warmup, factor=1.0, fade_fraction=0.0, progress=0.0):
    """The rate of update `step` (from 1): noam(step, ...) * fade(progress, fade_fraction), progress
    being how far the run is before the update (0 to 1; fraction 0: the paper's schedule alone).
    train.update_rate computes it for Adam.step; viz.noam_curve draws it; reference.noam is tested
    against it."""
    return noam(step, d_model, warmup, factor) * fade(progress, fade_fraction)
