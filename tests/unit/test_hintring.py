"""The hint ring's two ends (kvtier.hintring) on one memfd, no daemon: what
the client publishes is what the daemon takes, across the wrap, a full ring
refuses instead of overwriting, and a head the client sets out of bounds is
counted and skipped."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier import hintring


@pytest.fixture
def ends():
    daemon = hintring.DaemonRing(64)
    client = hintring.ClientRing(os.dup(daemon.fd))
    yield daemon, client
    client.close()
    daemon.close()


def test_what_the_client_puts_the_daemon_takes_across_the_wrap(ends):
    daemon, client = ends
    assert client.capacity == 64
    for start in (0, 40, 80):  # the second and third puts cross the end of the entries
        ids = np.arange(start, start + 40, dtype=np.uint32)
        assert client.put(7, ids)
        got = daemon.take()
        assert got["region"].tolist() == [7] * 40 and got["block"].tolist() == ids.tolist()
        assert client.unconsumed() == 0
    assert daemon.take().size == 0


def test_a_full_ring_refuses_and_takes_again_once_drained(ends):
    daemon, client = ends
    assert client.put(1, np.arange(60, dtype=np.uint32))
    assert not client.put(1, np.arange(5, dtype=np.uint32))  # 65 > 64: nothing written
    assert client.full == 1 and client.unconsumed() == 60
    assert daemon.take().size == 60
    assert client.put(1, np.arange(5, dtype=np.uint32))
    assert daemon.take()["block"].tolist() == [0, 1, 2, 3, 4]


def test_the_daemon_copies_before_the_client_can_change_it(ends):
    daemon, client = ends
    client.put(3, np.array([5, 6], dtype=np.uint32))
    got = daemon.take()
    client.entries["block"][:2] = 99  # the client writes again after the drain
    assert got["block"].tolist() == [5, 6]


def test_a_head_out_of_bounds_is_counted_and_skipped(ends):
    daemon, client = ends
    client.head[0] = 65  # claims more entries than the ring holds
    assert daemon.take().size == 0 and daemon.bad_heads == 1
    client.head[0] = 2  # behind the daemon's tail (which is now 65)
    assert daemon.take().size == 0 and daemon.bad_heads == 2
    client.entries[2:4] = [(1, 10), (1, 11)]
    client.head[0] = 4
    assert daemon.take()["block"].tolist() == [10, 11]


def test_the_memfd_cannot_be_shrunk_under_the_daemon(ends):
    daemon, _ = ends
    with pytest.raises(PermissionError):
        os.ftruncate(daemon.fd, 0)


@pytest.mark.parametrize("asked, limit, got", [(0, 65536, 65536), (1000, 65536, 512), (1 << 20, 4096, 4096),
                                               (1, 65536, hintring.MIN_ENTRIES), (100000, 100000, 65536)])
def test_capacity_is_a_power_of_two_within_the_limit(asked, limit, got):
    assert hintring.capacity_for(asked, limit) == got


def test_what_the_daemon_never_took_can_be_read_back(ends):
    """A client whose daemon went away sends these on the socket instead."""
    daemon, client = ends
    client.put(2, np.arange(50, dtype=np.uint32))
    daemon.take()
    client.put(2, np.arange(50, 70, dtype=np.uint32))  # crosses the end of the entries
    left = client.unconsumed_entries()
    assert left["block"].tolist() == list(range(50, 70)) and (left["region"] == 2).all()
