from types import SimpleNamespace

import pytest

from gpudoctor.plan.search import largest


def rows(peak_of, usable):
    probes = []

    def row_at(x):
        probes.append(x)
        peak = peak_of(x)
        return SimpleNamespace(peak=peak, usable=[usable], fullest=0, fits=peak <= usable)

    return row_at, probes


@pytest.mark.parametrize("start", [1, 4, 100, 500])
def test_finds_the_boundary_of_a_linear_peak(start):
    row_at, probes = rows(lambda b: 1000 + 37 * b, 10_000)  # fits up to b = 243
    assert largest(row_at, start, limit=4096) == 243
    assert 243 in probes and 244 in probes
    assert len(probes) <= 8


def test_superlinear_peak_still_exact():
    row_at, probes = rows(lambda s: 500 + s * s // 10, 1_000_000)  # fits up to s = 3161
    assert largest(row_at, 512, limit=32768) == 3161


def test_nothing_fits_and_limit():
    assert largest(rows(lambda b: 10 * b, 5)[0], 4, limit=64) is None
    assert largest(rows(lambda b: b, 10**9)[0], 4, limit=64) == 64


def _quadratic(s):
    # activations linear in the sequence plus attention scores quadratic in it, rounded to 2 MiB segments
    mib = 1 << 20
    return -(-(3000 * mib + 900_000 * s + 40 * s * s) // (2 * mib)) * 2 * mib


@pytest.mark.parametrize("start", [1, 64, 512, 4000])
def test_quadratic_peak_takes_few_probes(start):
    row_at, probes = rows(_quadratic, 7 << 30)
    expected = max(s for s in range(1, 32769) if _quadratic(s) <= 7 << 30)
    assert largest(row_at, start, limit=32768) == expected
    assert len(probes) <= 8, probes


@pytest.mark.parametrize("start", [1, 4, 100, 500])
def test_a_known_floor_aims_the_first_step(start):
    row_at, probes = rows(lambda b: 1000 + 37 * b, 10_000)
    assert largest(row_at, start, limit=4096, floor=1000) == 243
    assert len(probes) <= 3, probes  # the start, then 243 and 244
    blind_row_at, blind = rows(lambda b: 1000 + 37 * b, 10_000)
    largest(blind_row_at, start, limit=4096)
    assert len(probes) <= len(blind)


@pytest.mark.parametrize("start", [64, 512, 4000])
def test_a_known_floor_saves_probes_on_a_quadratic_peak(start):
    expected = max(s for s in range(1, 32769) if _quadratic(s) <= 7 << 30)
    row_at, probes = rows(_quadratic, 7 << 30)
    assert largest(row_at, start, limit=32768, floor=3000 << 20) == expected
    blind_row_at, blind = rows(_quadratic, 7 << 30)
    largest(blind_row_at, start, limit=32768)
    assert len(probes) <= 6 and len(probes) <= len(blind), (probes, blind)


def test_a_wrong_floor_still_finds_the_exact_boundary():
    for floor in (0, 5000, 20_000):  # too low, too high, over the card: it only aims
        row_at, probes = rows(lambda b: 1000 + 37 * b, 10_000)
        assert largest(row_at, 4, limit=4096, floor=floor) == 243


def test_steps_of_two_searches_run_together():
    from gpudoctor.plan.search import run_together, steps

    a_rows, a_probes = rows(lambda b: 100 * b, 1000)
    b_rows, b_probes = rows(lambda s: 5 * s, 1000)
    rounds = []
    out = run_together({"batch": (steps(4, 4096), a_rows), "seq": (steps(64, 4096), b_rows)}, before=rounds.append)
    assert out == {"batch": 10, "seq": 200}
    assert rounds[0] == [("batch", 4), ("seq", 64)]
