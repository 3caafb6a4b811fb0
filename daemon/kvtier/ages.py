"""Access-age demographics: bytes of KV blocks by time since their last
access, per tier and tenant — the table operators size DRAM with ("how much
of what sits in DRAM was not read for ten minutes?").

``last_access`` is the BlockTable column every hotness source and hint
updates (hotness.Temperature.add), on the registry's monotonic clock; a block
never seen accessed is ``-inf`` and counts as "older". Pure and vectorised:
one searchsorted and one bincount over the table, whatever its size;
kvtierctl ages and the ``kvtier_access_age_bytes`` metric both use it.
"""

from __future__ import annotations

import numpy as np

# Upper edges (seconds) of the age buckets; the last bucket is open.
AGE_EDGES = (1.0, 5.0, 30.0, 120.0, 600.0)
AGE_LABELS = ("<1s", "1-5s", "5-30s", "30s-2m", "2-10m", ">10m")
# (tier, tenant) keys x buckets up to this many are counted in one array.
KEYS_COUNTED = 1 << 20
# age_bytes_of_rows works this many rows at a time: each numpy call then
# holds the GIL ~1 ms, so run on a thread it lets the event loop in between.
ROWS_AT_ONCE = 1 << 16


def age_bytes(tier: np.ndarray, tenant: np.ndarray, nbytes: np.ndarray, last_access: np.ndarray,
              now: float) -> dict[tuple[int, int], list[int]]:
    """(tier index, tenant id) -> bytes per AGE_LABELS bucket. Tier is as
    in the table (TIER_UNKNOWN / TIER_MIXED included)."""
    n = min(tier.size, tenant.size, nbytes.size, last_access.size)
    if n == 0:
        return {}
    age = now - last_access[:n]
    # side="right": an age equal to an edge belongs to the older bucket (1.0 s is not "<1s").
    bucket = np.searchsorted(np.asarray(AGE_EDGES), age, side="right")
    # One int key per (tier, tenant), from their ranges: an np.unique over
    # the (n, 2) pairs sorted rows of a structured view (0.88 s of the loop
    # at 1 Mi blocks, kvtierctl ages); the key's few values are counted
    # with bincount, or sorted in 1-D where the ranges are wide.
    t = tier[:n].astype(np.int64)
    tn = tenant[:n].astype(np.int64)
    t0, tn0 = int(t.min()), int(tn.min())
    span = int(tn.max()) - tn0 + 1
    key = (t - t0) * span + (tn - tn0)
    nb = len(AGE_LABELS)
    nkeys = (int(t.max()) - t0 + 1) * span
    if nkeys * nb <= KEYS_COUNTED:
        present = np.flatnonzero(np.bincount(key, minlength=nkeys))
        inv = np.full(nkeys, -1, dtype=np.int64)
        inv[present] = np.arange(present.size)
        inv = inv[key]
        uniq = present
    else:
        uniq, inv = np.unique(key, return_inverse=True)
    sums = np.bincount(inv.ravel() * nb + bucket, weights=nbytes[:n].astype(np.float64),
                       minlength=len(uniq) * nb).reshape(len(uniq), nb)
    return {(int(k // span) + t0, int(k % span) + tn0): [int(x) for x in row] for k, row in zip(uniq.tolist(), sums)}


def age_bytes_of_rows(columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                      spans: list[tuple[int, int]], now: float) -> dict[tuple[int, int], list[int]]:
    """age_bytes over rows [start, stop) of each span of the columns (tier,
    tenant, nbytes, last_access), ROWS_AT_ONCE rows at a time, the parts
    summed: the same answer as over those rows at once."""
    total: dict[tuple[int, int], list[int]] = {}
    for start, stop in spans:
        for i in range(start, stop, ROWS_AT_ONCE):
            j = min(stop, i + ROWS_AT_ONCE)
            for key, row in age_bytes(*(c[i:j] for c in columns), now).items():
                have = total.get(key)
                total[key] = row if have is None else [a + b for a, b in zip(have, row)]
    return total
