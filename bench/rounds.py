"""Alternating timed rounds: how the benchmarks time variants of one thing in one process (each round runs every
variant in turn, so a machine that slows down or speeds up does so for all of them alike)."""
import time


def alternate(variants, rounds, calls, warmup=0, sync=None):
    """{name: [seconds a call, one per kept round]} for variants {name: (setup, fn)}: in each of warmup + rounds
    rounds every variant in turn calls `fn` `calls` times inside `setup()` (a context manager: the variant's switches,
    its launcher), between two calls of `sync` (where given: the device's queue drained before and after); the first
    `warmup` rounds are not kept."""
    times = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, (setup, fn) in variants.items():
            with setup():
                if sync:
                    sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                if sync:
                    sync()
                elapsed = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(elapsed / calls)
    return times
