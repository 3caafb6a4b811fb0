"""Access-age buckets: edges, never-accessed blocks, tiers x tenants."""

import numpy as np

from kvtier import ages


def test_buckets_edges_and_never_seen():
    now = 1000.0
    last = now - np.array([0.0, 0.99, 1.0, 4.9, 5.0, 29.0, 30.0, 119.0, 120.0, 599.0, 600.0, 1e6, np.inf])
    n = last.size
    out = ages.age_bytes(np.zeros(n, np.int8), np.zeros(n, np.int16), np.full(n, 10, np.uint64), last, now)
    assert out == {(0, 0): [20, 20, 20, 20, 20, 30]}


def test_rows_per_tier_and_tenant_sum_bytes():
    tier = np.array([0, 0, 1, -1, 0], np.int8)
    tenant = np.array([1, 2, 1, 1, 1], np.int16)
    nbytes = np.array([4, 8, 16, 32, 64], np.uint64)
    last = np.array([99.5, 99.5, 0.0, -np.inf, 97.0])
    out = ages.age_bytes(tier, tenant, nbytes, last, 100.0)
    assert out == {(0, 1): [4, 64, 0, 0, 0, 0], (0, 2): [8, 0, 0, 0, 0, 0], (1, 1): [0, 0, 0, 16, 0, 0],
                   (-1, 1): [0, 0, 0, 0, 0, 32]}
    assert ages.age_bytes(tier[:0], tenant[:0], nbytes[:0], last[:0], 100.0) == {}
    assert len(ages.AGE_LABELS) == len(ages.AGE_EDGES) + 1


def test_age_bytes_of_rows_in_pieces_is_age_bytes_of_those_rows_at_once():
    """op_ages works ROWS_AT_ONCE rows at a time (on a thread, so the loop
    gets the GIL between pieces): the sums of the pieces over the spans are
    the answer over those rows at once, keys absent from a piece included;
    and tenant ids spread too wide to count in one array give the same."""
    from kvtier import ages

    rng = np.random.default_rng(3)
    n = 3 * ages.ROWS_AT_ONCE + 123
    tier = rng.integers(-2, 4, n).astype(np.int8)
    tier[: ages.ROWS_AT_ONCE] = 0  # the first piece lacks most keys
    nbytes = rng.integers(1, 1 << 20, n)
    last = rng.uniform(-700, 100, n)
    last[::5] = -np.inf
    for tenant in (rng.integers(0, 3, n).astype(np.int16), (rng.integers(0, 3, n) * 16000).astype(np.int16)):
        cols = (tier, tenant, nbytes, last)
        spans = [(10, 2 * ages.ROWS_AT_ONCE + 7), (2 * ages.ROWS_AT_ONCE + 50, n)]
        keep = np.zeros(n, dtype=bool)
        for a, b in spans:
            keep[a:b] = True
        assert ages.age_bytes_of_rows(cols, spans, 100.0) == ages.age_bytes(*(c[keep] for c in cols), 100.0)
