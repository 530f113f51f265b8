"""The largest batch size (or sequence length) that fits: a search over simulations.

Memory grows almost linearly with the batch and with the sequence length (plus a quadratic term where
attention scores are materialized), so each step aims at the value where the curve through the probes
nearest the boundary (a line through two, a parabola through three) meets the card's usable memory, then
checks its neighbour; bisection takes over when the aim leaves the bracket or was already probed. The
curve also passes near ``floor``, the memory the step needs at 0 (what does not grow with the batch or the
sequence: weights, gradients, optimizer state, the allocator's slack): given it, the first aim is the line
from it through the first probe, and later ones a parabola through it and two probes, instead of a blind
jump eight times as far. Every probe is a (cached) simulation; the answer is always a probed value that
fits with the next one up probed and not fitting (or the limit); ``floor`` only aims.

:func:`steps` is a generator (it yields the value to probe and receives its row), so that
:func:`run_together` can advance several searches at once and simulate their probes side by side.
"""

from __future__ import annotations

import math

GROWTH = 8
ROUNDING = 16 << 20  # peaks closer than this differ by the allocator's segment rounding as much as by the curve


def steps(start: int, limit: int, max_probes: int = 16, floor: int | None = None):
    """Yields values to probe; is sent each value's row (``.fits``, ``.peak``, ``.usable``, ``.fullest``);
    returns the largest ``x`` in ``[1, limit]`` that fits (fitting is assumed monotone), or None.
    ``floor``: the peak's part that does not grow with ``x`` (a point at 0 for the aim, never an answer)."""
    probes: dict[int, int] = {} if floor is None else {0: floor}
    lo, hi = 0, limit + 1  # lo fits (0: nothing known), hi does not (limit + 1: nothing known)
    x = max(1, min(start, limit))
    usable = None
    for _ in range(max_probes):
        row = yield x
        probes[x] = row.peak
        usable = row.usable[row.fullest]
        if row.fits:
            lo = x
        else:
            hi = x
        if hi - lo <= 1:
            break
        x = _next(probes, lo, hi, limit, usable)
    return lo or None


def _next(probes: dict, lo: int, hi: int, limit: int, usable: int) -> int:
    guess = _aim(probes, lo, hi, usable)
    if guess is not None:
        guess = min(guess, limit)
        # the boundary is between guess and guess + 1: probe whichever of the two is not known yet
        for candidate in (guess, guess + 1):
            if lo < candidate < hi and candidate not in probes:
                return candidate
    if hi > limit:  # nothing above fails yet: a long jump (nearby probes differ by little more than rounding)
        return min(GROWTH * lo, limit)
    return max((lo + hi) // 2, 1)


def _aim(probes: dict, lo: int, hi: int, usable: int) -> int | None:
    """Where the curve through the (up to three) probes nearest the boundary reaches ``usable``."""
    if len(probes) < 2:
        return None
    ends = [x for x in (lo, hi) if x in probes]  # the bracket's probed ends, and the probes nearest them
    others = [x for x in probes if x not in ends]
    if len(ends) == 2:
        # a probe whose peak is within a few allocator segments of an end's measures the rounding, not the
        # curve's bend: a parabola through it aims anywhere (the line through the ends is better)
        others = [x for x in others if min(abs(probes[x] - probes[end]) for end in ends) >= ROUNDING]
    near = (ends + sorted(others, key=lambda x: min(abs(x - end) for end in ends)))[:3]
    root = _quadratic_root(sorted(near), [probes[x] for x in sorted(near)], usable) if len(near) == 3 else None
    if root is None:
        x1, x2 = sorted(near[:2])
        y1, y2 = probes[x1], probes[x2]
        if y2 <= y1:
            return None
        root = x2 + (usable - y2) * (x2 - x1) / (y2 - y1)
    if not math.isfinite(root):
        return None
    return int(math.floor(root))


def _quadratic_root(xs, ys, target) -> float | None:
    """The root of the parabola through three points at ``target``, on its rising branch; None if it has none."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    try:
        a = ((y2 - y1) / (x2 - x1) - (y1 - y0) / (x1 - x0)) / (x2 - x0)
    except ZeroDivisionError:
        return None
    b = (y1 - y0) / (x1 - x0) - a * (x0 + x1)
    c = y0 - a * x0 * x0 - b * x0 - target
    if abs(a) < 1e-12:
        return None if b <= 0 else -c / b
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + s * math.sqrt(disc)) / (2 * a) for s in (1, -1)]
    rising = [r for r in roots if 2 * a * r + b > 0]
    return min(rising) if rising else None


def largest(row_at, start: int, limit: int, max_probes: int = 16, floor: int | None = None) -> int | None:
    """The largest ``x`` in ``[1, limit]`` whose ``row_at(x).fits``; None if none (one search, probe by probe)."""
    return run_together({"x": (steps(start, limit, max_probes, floor), row_at)})["x"]


def run_together(searches: dict, before=None) -> dict:
    """Advance several searches in lockstep: ``searches`` maps a name to ``(steps generator, row_at)``;
    ``before(list of (name, x))`` is called with each round's probes first (to simulate them together).
    Returns ``{name: result}``."""
    results: dict = {}
    pending: dict = {}
    for name, (gen, _) in searches.items():
        pending[name] = next(gen)
    while pending:
        if before is not None:
            before(list(pending.items()))
        advanced = {}
        for name, x in pending.items():
            gen, row_at = searches[name]
            try:
                advanced[name] = gen.send(row_at(x))
            except StopIteration as stop:
                results[name] = stop.value
        pending = advanced
    return results
