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
    keys = np.stack([tier[:n].astype(np.int64), tenant[:n].astype(np.int64)], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    nb = len(AGE_LABELS)
    sums = np.bincount(inv.ravel() * nb + bucket, weights=nbytes[:n].astype(np.float64),
                       minlength=len(uniq) * nb).reshape(len(uniq), nb)
    return {(int(t), int(tn)): [int(x) for x in row] for (t, tn), row in zip(uniq, sums)}
