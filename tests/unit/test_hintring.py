"""The hint ring's two ends (kvtier.hintring) on one memfd, no daemon: what
the client publishes is what the daemon takes, across the wrap, a full ring
refuses instead of overwriting, and a head the client sets out of bounds is
counted and skipped."""

from __future__ import annotations

import ctypes
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


def packed(*ids: int) -> bytes:
    return np.array(ids, dtype="<u4").tobytes()


def test_what_the_client_puts_the_daemon_takes_across_the_wrap(ends):
    daemon, client = ends
    assert client.capacity == 64
    for start in (0, 40, 80):  # the second and third puts cross the end of the words
        ids = list(range(start, start + 39))
        assert client.put(hintring.region_word(7), packed(*ids))  # a region word and 39 indices
        regions, blocks = daemon.take()
        assert regions.tolist() == [7] * 39 and blocks.tolist() == ids
        assert client.unconsumed() == 0
    assert daemon.take()[0].size == 0


def test_the_region_word_holds_until_the_next_one_across_drains(ends):
    daemon, client = ends
    client.put(hintring.region_word(3), packed(1, 2))
    client.put(hintring.region_word(5), packed(9))
    assert [a.tolist() for a in daemon.take()] == [[3, 3, 5], [1, 2, 9]]
    client.words[client.written & client.mask] = 4  # a block word with no region word before it
    client.written += 1
    client.head[0] = client.written
    assert [a.tolist() for a in daemon.take()] == [[5], [4]]  # region 5 still in force


def test_block_words_before_any_region_word_have_no_region(ends):
    daemon, client = ends
    client.words[0] = 1
    client.head[0] = 1
    assert [a.tolist() for a in daemon.take()] == [[0], [1]]  # region 0: none (the daemon counts bad_region)


def test_a_full_ring_refuses_and_takes_again_once_drained(ends):
    daemon, client = ends
    word = hintring.region_word(1)
    assert client.put(word, packed(*range(59)))  # 60 words
    assert not client.put(word, packed(*range(4)))  # 65 > 64: nothing written
    assert client.full == 1 and client.unconsumed() == 60
    assert daemon.take()[1].size == 59
    assert client.put(word, packed(*range(4)))
    assert daemon.take()[1].tolist() == [0, 1, 2, 3]


def test_the_daemon_copies_before_the_client_can_change_it(ends):
    daemon, client = ends
    client.put(hintring.region_word(3), packed(5, 6))
    regions, blocks = daemon.take()
    client.array[:3] = 99  # the client writes again after the drain
    assert blocks.tolist() == [5, 6] and regions.tolist() == [3, 3]


def test_a_head_out_of_bounds_is_counted_and_skipped(ends):
    daemon, client = ends
    client.head[0] = 65  # claims more words than the ring holds
    assert daemon.take()[0].size == 0 and daemon.bad_heads == 1
    client.head[0] = 2  # behind the daemon's tail (which is now 65)
    assert daemon.take()[0].size == 0 and daemon.bad_heads == 2
    client.array[2:5] = [hintring.region_word(1), 10, 11]
    client.head[0] = 5
    assert [a.tolist() for a in daemon.take()] == [[1, 1], [10, 11]]


def test_the_memfd_cannot_be_shrunk_under_the_daemon(ends):
    daemon, _ = ends
    with pytest.raises(PermissionError):
        os.ftruncate(daemon.fd, 0)


def test_what_the_daemon_never_took_can_be_read_back(ends):
    """A client whose daemon went away sends these on the socket instead."""
    daemon, client = ends
    client.put(hintring.region_word(2), packed(*range(50)))
    daemon.take()
    client.put(hintring.region_word(2), packed(*range(50, 60)))  # crosses the end of the words
    client.put(hintring.region_word(4), packed(1))
    regions, blocks = client.unconsumed_entries()
    assert blocks.tolist() == list(range(50, 60)) + [1] and regions.tolist() == [2] * 10 + [4]


def rss_kib(mapping) -> int:
    """Resident KiB of one of this process's mappings (its smaps entry)."""
    view = ctypes.c_char.from_buffer(mapping)
    start = f"{ctypes.addressof(view):x}-"
    del view  # the mmap cannot be closed while a buffer of it is exported
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(start))
    return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:"))


def test_the_client_faults_its_words_in_when_it_maps_the_ring():
    """So no hint call takes a page fault on its way through the ring (in
    the TCG guest a batch into an untouched page cost 4x one that was not):
    the words are resident in the client's mapping before the first put,
    not in the daemon's (it only wrote the header)."""
    daemon = hintring.DaemonRing(1 << 12)
    client = hintring.ClientRing(os.dup(daemon.fd))
    try:
        assert rss_kib(client.map) * 1024 >= hintring.WORD_SIZE * client.capacity
        assert rss_kib(daemon.map) * 1024 < hintring.WORD_SIZE * client.capacity
    finally:
        client.close()
        daemon.close()


@pytest.mark.parametrize("asked, limit, got", [(0, 65536, 65536), (1000, 65536, 512), (1 << 20, 4096, 4096),
                                               (1, 65536, hintring.MIN_ENTRIES), (100000, 100000, 65536)])
def test_capacity_is_a_power_of_two_within_the_limit(asked, limit, got):
    assert hintring.capacity_for(asked, limit) == got


def test_runs_are_what_decode_reads_from_the_same_words(ends):
    """take_runs against decode, the one-pass reference both sides share:
    random words with region words anywhere (in a row, first, last, none)
    over many drains, the region in force carried from one to the next."""
    daemon, client = ends
    rng = np.random.default_rng(5)
    current = 0
    for _ in range(300):
        k = int(rng.integers(1, client.capacity + 1))
        words = rng.integers(0, 50, k).astype(np.uint32)
        region = rng.random(k) < rng.choice([0.0, 0.1, 0.5, 1.0])
        words[region] |= np.uint32(hintring.REGION_BIT)
        for w in words.tolist():
            client.words[client.written & client.mask] = w
            client.written += 1
        client.head[0] = client.written
        want_regions, is_region = hintring.decode(words, current)
        current = int(want_regions[-1])
        regions, lengths, blocks = daemon.take_runs()
        assert lengths.min(initial=1) > 0 and int(lengths.sum()) == blocks.size
        assert np.repeat(regions, lengths).tolist() == want_regions[~is_region].tolist()
        assert blocks.tolist() == words[~is_region].tolist()
