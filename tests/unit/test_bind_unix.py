"""kvtierd's listening socket (kvtier.server.bind_unix), with real unix
sockets: the path names a socket only once it accepts connections, a stale
socket is replaced, anything else at the path is refused and kept."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from kvtier import server


def bind_and_connect(path, mode: int = 0o666) -> list[str]:
    """bind_unix, a client's connect, and what the directory then holds."""
    s = server.bind_unix(str(path), mode, "")
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect(str(path))
        finally:
            c.close()
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        return sorted(p.name for p in path.parent.iterdir())
    finally:
        s.close()


def test_the_path_appears_only_when_listening(tmp_path, monkeypatch):
    # Between bind() and listen() a client that found the file was refused
    # (ECONNREFUSED, seen in the guest). Look at the path at that moment:
    # group_gid runs between the two.
    path = tmp_path / "kvtierd.sock"
    seen = []
    real = server.group_gid

    def look(group):
        seen.append(path.exists())
        return real(group)

    monkeypatch.setattr(server, "group_gid", look)
    assert bind_and_connect(path, 0o660) == ["kvtierd.sock"]
    assert seen == [False]


def test_a_stale_socket_and_a_stale_temporary_are_replaced(tmp_path):
    path = tmp_path / "kvtierd.sock"
    for p in (path, tmp_path / "kvtierd.sock.new"):
        old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old.bind(str(p))
        old.close()  # the file stays: a daemon that died
    assert bind_and_connect(path) == ["kvtierd.sock"]


def test_a_file_that_is_not_a_socket_is_kept(tmp_path):
    path = tmp_path / "kvtierd.sock"
    path.write_text("not mine")
    with pytest.raises(OSError, match="not a socket"):
        server.bind_unix(str(path), 0o666, "")
    assert path.read_text() == "not mine"


def test_a_path_too_long_for_the_suffix_is_bound_in_place(tmp_path):
    d = tmp_path / ("d" * max(1, 104 - len(str(tmp_path)) - len("/x.sock")))
    path = d / "x.sock"
    assert 103 <= len(str(path)) <= 107
    assert bind_and_connect(path) == ["x.sock"]
