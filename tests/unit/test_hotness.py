import math

import numpy as np
import pytest

from kvtier.blocks import BlockTable
from kvtier.errors import ConfigError, InvalidArgument
from kvtier.hotness import SOURCE_WEIGHTS, Temperature

BS = 2 << 20


def table(*counts):
    t = BlockTable()
    for r, c in enumerate(counts):
        t.add_region(r + 10, 100 + r, (r + 1) << 40, c * BS, BS)
    return t


def test_decay_matches_closed_form():
    t = table(4)
    h = Temperature(tau_s=10.0)
    h.decay(t, 0.0)
    h.add(t, np.array([0, 1]), np.array([8.0, 2.0], dtype=np.float32), 0.0)
    h.decay(t, 5.0)
    h.decay(t, 12.0)
    want = np.array([8.0, 2.0, 0, 0]) * math.exp(-12.0 / 10.0)
    np.testing.assert_allclose(t.temp, want, rtol=1e-6)


def test_decay_ignores_time_going_back():
    t = table(2)
    h = Temperature(5.0)
    h.decay(t, 10.0)
    h.add(t, np.array([0]), 1.0, 10.0)
    h.decay(t, 9.0)
    assert t.temp[0] == pytest.approx(1.0)
    assert h.last_decay == 10.0


def test_steady_rate_settles_at_rate_times_tau():
    # r accesses/s for long enough -> temp ~ r * tau (discrete: r*dt/(1-exp(-dt/tau)))
    t = table(1)
    h = Temperature(4.0)
    r, dt = 3.0, 0.5
    for k in range(200):
        h.decay(t, k * dt)
        h.add(t, np.array([0]), r * dt, k * dt)
    assert t.temp[0] == pytest.approx(r * dt / (1 - math.exp(-dt / 4.0)), rel=1e-4)


@pytest.mark.parametrize("nrows", [5, 5000])  # sparse and dense batches
def test_duplicates_add_up(nrows):
    t = table(64)
    h = Temperature(10.0)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 64, nrows)
    counts = rng.random(nrows).astype(np.float32)
    h.add(t, rows, counts, 3.0, weight=0.5)
    want = np.zeros(64)
    np.add.at(want, rows, counts.astype(np.float64) * 0.5)
    np.testing.assert_allclose(t.temp, want, rtol=1e-5)
    assert set(np.flatnonzero(t.last_access == 3.0)) == set(rows.tolist())
    assert np.all(np.isneginf(t.last_access[np.setdiff1d(np.arange(64), rows)]))


def test_last_access_never_goes_back():
    t = table(2)
    h = Temperature(10.0)
    h.add(t, np.array([0]), 1.0, 7.0)
    h.add(t, np.array([0, 0]), 1.0, 6.0)
    assert t.last_access[0] == 7.0
    assert t.temp[0] == pytest.approx(3.0)


def test_region_hints_map_to_rows_of_that_region():
    t = table(3, 5)
    h = Temperature(10.0)
    h.add_region_hints(t, 11, np.array([0, 4, 4]), np.float32(2.0), 1.0)
    s = t.slices[11]
    assert t.temp[s.start] == pytest.approx(2.0 * SOURCE_WEIGHTS["hint"])
    assert t.temp[s.start + 4] == pytest.approx(4.0)
    assert t.temp[: s.start].sum() == 0


def test_bad_hints_are_refused():
    t = table(3)
    h = Temperature(10.0)
    with pytest.raises(InvalidArgument):
        h.add_region_hints(t, 99, np.array([0]), 1.0, 0.0)
    with pytest.raises(InvalidArgument):
        h.add_region_hints(t, 10, np.array([3]), 1.0, 0.0)
    with pytest.raises(InvalidArgument):
        h.add(t, np.array([-1]), 1.0, 0.0)
    assert t.temp.sum() == 0


@pytest.mark.parametrize("tau", [0, -1, float("inf"), float("nan")])
def test_tau_validated(tau):
    with pytest.raises(ConfigError):
        Temperature(tau)
