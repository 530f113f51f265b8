"""The largest batch size (or sequence length) that fits: a search over simulations.

Memory grows almost linearly with the batch, so each step aims at the value where the line through the
last two probes meets the card's usable memory, then checks its neighbour; bisection takes over when the
aim misses. Every probe is a (cached) simulation; the answer is always a probed value that fits, with
the next one up probed and not fitting (or the limit).
"""

from __future__ import annotations

import math


def largest(row_at, start: int, limit: int, max_probes: int = 24) -> int | None:
    """The largest ``x`` in ``[1, limit]`` whose ``row_at(x).fits``, assuming fitting is monotone; None if none."""
    probes: dict[int, object] = {}
    lo, hi = 0, limit + 1  # lo fits (0: nothing known), hi does not (limit + 1: nothing known)
    x = max(1, min(start, limit))
    aimed = False
    for _ in range(max_probes):
        row = probes[x] = row_at(x)
        if row.fits:
            lo = x
        else:
            hi = x
        if hi - lo <= 1:
            break
        if aimed:  # confirm the aimed value with its neighbour
            x, aimed = (x + 1 if lo == x else x - 1), False
            continue
        guess = _aim(probes)
        if guess is not None and lo < guess < hi:
            x, aimed = guess, True
        elif hi > limit:
            x = min(2 * lo, limit)
        else:
            x = max((lo + hi) // 2, 1)
    return lo or None


def _aim(probes: dict) -> int | None:
    if len(probes) < 2:
        return None
    (x1, r1), (x2, r2) = list(probes.items())[-2:]  # the two latest probes
    p1, p2 = r1.peak, r2.peak
    usable = r2.usable[r2.fullest]
    if x1 == x2 or p1 == p2:
        return None
    slope = (p2 - p1) / (x2 - x1)
    if slope <= 0:
        return None
    return int(math.floor(x2 + (usable - p2) / slope))
