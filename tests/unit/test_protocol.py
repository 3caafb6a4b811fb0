"""Wire codec: framing, every op's validation, packed arrays, golden bytes."""

import msgspec
import numpy as np
import pytest

from kvtier import protocol
from protocol_doc import doc_examples


def enc(d):
    return msgspec.msgpack.encode(d)


def test_golden_register_frame():
    # The example in docs/protocol.md, byte for byte: keys in this order.
    payload = enc({"op": "register", "id": 1, "start": 0x7F0000000000, "length": 1 << 30,
                   "block_size": 2 << 20, "name": "kv"})
    frame = protocol.frame(payload)
    assert frame.hex() == (
        "00000044"  # length 68
        "86"  # map of 6
        "a26f70" "a8" + b"register".hex() +
        "a26964" "01"
        "a57374617274" "cf00007f0000000000"
        "a66c656e677468" "ce40000000"
        "aa" + b"block_size".hex() + "ce00200000"
        "a46e616d65" "a26b76"
    )
    req = protocol.decode_request(payload)
    assert isinstance(req, protocol.Register)
    assert (req.id, req.start, req.length, req.block_size, req.name) == (1, 0x7F0000000000, 1 << 30, 2 << 20, "kv")
    assert (req.tenant, req.priority, req.constraints, req.pid) == ("", 0, [], None)


def test_golden_ok_response():
    assert protocol.ok(1, {"region": 7, "blocks": 512, "block_size": 2 << 20, "pid": 1234}).hex() == (
        "0000003a" "83" "a26964" "01" "a26f6b" "c3" "a6" + b"result".hex() + "84"
        "a6" + b"region".hex() + "07"
        "a6" + b"blocks".hex() + "cd0200"
        "aa" + b"block_size".hex() + "ce00200000"
        "a3706964" "cd04d2"
    )


def test_golden_error_response():
    err = protocol.ProtocolError(protocol.E_NOT_FOUND, "no region 9")
    assert protocol.error(5, err).hex() == (
        "00000033" "83" "a26964" "05" "a26f6b" "c2" "a5" + b"error".hex() + "82"
        "a4" + b"code".hex() + "a9" + b"not_found".hex() +
        "a7" + b"message".hex() + "ab" + b"no region 9".hex()
    )


@pytest.mark.parametrize("op, fields", [
    ("hello", {}),
    ("hello", {"versions": [1, 2], "client": "vllm"}),
    ("register", {"start": 4096, "length": 8192, "block_size": 4096, "tenant": "a", "priority": -5,
                  "constraints": ["keep_dram", "never_swap"], "pid": 42}),
    ("unregister", {"region": 1}),
    ("hint", {"region": 1, "blocks": b"\x01\x00\x00\x00"}),
    ("hint", {"region": 1, "blocks": b"\x01\x00\x00\x00", "counts": b"\x05\x00\x00\x00"}),
    ("phase", {"region": 1, "phase": "prefill_done"}),
    ("phase", {"region": 1, "phase": "free", "blocks": b""}),
    ("query", {"region": 3, "first": 2, "count": 9}),
    ("stats", {}), ("status", {}), ("tiers", {}), ("regions", {"pid": 7}),
    ("blocks", {"region": 1}),
    ("migrate", {"region": 1, "tier": 2}),
    ("pin", {"region": 1}), ("pin", {"region": 1, "tier": 0, "blocks": b""}),
    ("unpin", {"region": 1}),
    ("explain", {"region": 1, "block": 0}),
])
def test_every_op_round_trips(op, fields):
    req = protocol.decode_request(enc({"op": op, "id": 99, **fields}))
    assert type(req) is protocol.OPS[op] and req.id == 99
    for k, v in fields.items():
        assert getattr(req, k) == v
    again = protocol.FrameReader().feed(protocol.encode_request(req))
    assert protocol.decode_request(again[0]) == req


def test_ops_table_is_complete():
    assert set(protocol.OPS) == {"hello", "register", "allocate", "unregister", "hint", "phase", "query", "stats",
                                 "status", "tiers", "regions", "blocks", "migrate", "measure", "pin", "unpin",
                                 "explain", "ages", "prefetch", "release", "register_engine", "attach", "move_done",
                                 "hint_ring"}


def test_capabilities_name_every_op_and_the_features():
    # docs/protocol.md: hello's capabilities are the ops this daemon offers
    # and the features; a client checks an op there before using it.
    assert protocol.CAPABILITIES[:len(protocol.OPS)] == tuple(protocol.OPS)
    assert set(protocol.CAPABILITIES) == set(protocol.OPS) | {"pidfd-lifetime", "persist", "engine-moves"}


def test_the_fields_that_take_nil_are_the_ones_the_doc_lists():
    # docs/protocol.md section 2 names every field that accepts nil; any
    # other field refuses it (a C client sends nil nowhere else).
    import re
    from protocol_doc import PROTOCOL_MD

    text = " ".join(PROTOCOL_MD.read_text().split())
    sentence = re.search(r"Only these also accept nil, meaning the same: (.*?)\. Any other", text).group(1)
    listed = {(op.strip(), field) for field, ops in re.findall(r"`(\w+)` \(([^)]*)\)", sentence)
              for op in ops.split(",")}
    nilable = {(op, f.name) for op, t in protocol.OPS.items() for f in msgspec.structs.fields(t)
               if f.default is None}
    assert listed == nilable
    # and the decoder agrees, field by field (a missing required field is
    # reported after the fields sent, so a nil refused names its field)
    for op, t in protocol.OPS.items():
        for f in msgspec.structs.fields(t):
            try:
                protocol.decode_request(enc({"op": op, f.name: None}))
                refused = False
            except protocol.ProtocolError as e:
                refused = f"$.{f.name}`" in str(e)
            assert refused == ((op, f.name) not in nilable), (op, f.name)


@pytest.mark.parametrize("doc, where", [
    ({"op": "register", "id": 3, "start": -1, "length": 1, "block_size": 4096}, "$.start"),
    ({"op": "register", "id": 3, "start": 0, "length": 0, "block_size": 4096}, "$.length"),
    ({"op": "register", "id": 3, "start": 0, "length": 1, "block_size": 4096, "priority": 101}, "$.priority"),
    ({"op": "register", "id": 3, "start": 0, "length": 1, "block_size": 4096, "constraints": ["fast"]},
     "$.constraints[0]"),
    ({"op": "register", "id": 3, "start": 0, "length": 1, "block_size": 4096, "name": "x" * 129}, "$.name"),
    ({"op": "register", "id": 3, "length": 1, "block_size": 4096}, "start"),
    ({"op": "allocate", "id": 3, "start": 0, "length": 1, "block_size": 4096, "tier": ""}, "$.tier"),
    ({"op": "allocate", "id": 3, "start": 0, "length": 1, "block_size": 4096, "pinned": 1}, "$.pinned"),
    ({"op": "unregister", "id": 3, "region": 0}, "$.region"),
    ({"op": "hint", "id": 3, "region": 1, "blocks": [1, 2]}, "$.blocks"),
    ({"op": "phase", "id": 3, "region": 1, "phase": "decode"}, "$.phase"),
    ({"op": "frobnicate", "id": 3}, "$.op"),
    ({"id": 3}, "op"),
])
def test_invalid_requests_say_where_and_keep_the_id(doc, where):
    with pytest.raises(protocol.ProtocolError) as ei:
        protocol.decode_request(enc(doc))
    assert ei.value.code == protocol.E_INVALID_REQUEST
    assert where in str(ei.value)
    assert ei.value.req_id == 3
    assert not ei.value.fatal


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", enc([1, 2]), enc("op"), b"\x81"])
def test_garbage_is_an_invalid_request(payload):
    with pytest.raises(protocol.ProtocolError) as ei:
        protocol.decode_request(payload)
    assert ei.value.code == protocol.E_INVALID_REQUEST and ei.value.req_id == 0


def test_frame_reader_splits_and_reassembles():
    frames = [protocol.encode_request(protocol.Unregister(id=i, region=i + 1)) for i in range(5)]
    blob = b"".join(frames)
    r = protocol.FrameReader()
    got = []
    for i in range(0, len(blob), 3):  # dribbled 3 bytes at a time
        got += r.feed(blob[i:i + 3])
    assert [protocol.decode_request(g).id for g in got] == list(range(5))
    assert r.pending == 0
    assert len(protocol.FrameReader().feed(blob)) == 5


def test_oversized_frame_is_fatal_before_its_body_arrives():
    r = protocol.FrameReader(max_size=4096)
    with pytest.raises(protocol.ProtocolError) as ei:
        r.feed(protocol.HEADER.pack(4097))
    assert ei.value.code == protocol.E_TOO_LARGE and ei.value.fatal
    assert protocol.FrameReader(max_size=4096).feed(protocol.HEADER.pack(4096)) == []


def test_empty_frame_is_fatal():
    with pytest.raises(protocol.ProtocolError) as ei:
        protocol.FrameReader().feed(b"\0\0\0\0")
    assert ei.value.code == protocol.E_BAD_FRAME and ei.value.fatal


def test_packed_arrays_are_little_endian():
    b = protocol.pack_blocks([1, 256, 2**32 - 1])
    assert b == b"\x01\0\0\0" b"\0\x01\0\0" b"\xff\xff\xff\xff"
    assert protocol.unpack(b, protocol.BLOCKS_DTYPE, "blocks").tolist() == [1, 256, 2**32 - 1]
    assert protocol.unpack(None, protocol.BLOCKS_DTYPE, "blocks") is None
    with pytest.raises(protocol.ProtocolError, match="not a multiple of 4"):
        protocol.unpack(b"\0\0\0", protocol.BLOCKS_DTYPE, "blocks")


def test_response_decodes():
    r = protocol.decode_response(protocol.FrameReader().feed(protocol.ok(4, {"tiers": np.zeros(3, np.int8).tobytes()}))[0])
    assert r.ok and r.id == 4 and r.result == {"tiers": b"\0\0\0"} and r.error is None
    e = protocol.decode_response(protocol.FrameReader().feed(protocol.error(4, protocol.ProtocolError(protocol.E_RATE, "slow", retry_after_ms=3)))[0])
    assert not e.ok and e.error.code == protocol.E_RATE and e.error.retry_after_ms == 3


def test_error_codes_are_unique():
    assert len(set(protocol.ERROR_CODES)) == len(protocol.ERROR_CODES)


def test_kvtierctl_block_lists_pack_to_the_wire_format():
    import argparse

    from kvtier.ctl import parse_blocks

    assert protocol.unpack(parse_blocks("0-3,7, 9-9"), protocol.BLOCKS_DTYPE, "b").tolist() == [0, 1, 2, 3, 7, 9]
    assert parse_blocks(None) is None and parse_blocks("") == b""
    for bad in ("3-1", "x", "-2", "1-2-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_blocks(bad)


def test_client_finds_buffer_addresses_without_holding_exports():
    import mmap

    from kvtier.client import buffer_address

    arr = np.arange(1000, dtype=np.uint32)
    assert buffer_address(arr) == (arr.ctypes.data, 4000)
    ro = np.frombuffer(bytes(64), dtype=np.uint8)
    assert buffer_address(ro) == (ro.ctypes.data, 64)
    m = mmap.mmap(-1, 8192)
    addr, n = buffer_address(m)
    assert n == 8192 and addr % 4096 == 0
    m.close()  # would raise BufferError if an export were still held
    with pytest.raises(ValueError, match="C-contiguous"):
        buffer_address(arr.reshape(10, 100)[:, ::2])


def test_every_example_frame_in_protocol_md_is_what_the_code_sends():
    """docs/protocol.md section 8, every dump: the header counts the payload;
    a request decodes to the described message (a client may order keys as
    it likes: the doc puts id after op, kvtier's encoder last); a response is
    byte for byte what the daemon sends."""
    import numpy as np

    docs = doc_examples()
    register = protocol.Register(id=1, start=0x7F0000000000, length=1 << 30, block_size=2 << 20, name="kv")
    hint = protocol.Hint(id=3, region=7, blocks=protocol.pack_blocks([0, 5, 511]),
                         counts=np.array([1, 2, 1], dtype=protocol.COUNTS_DTYPE).tobytes())
    expected = [
        protocol.encode_request(register),
        protocol.ok(1, {"region": 7, "blocks": 512, "block_size": 2 << 20, "pid": 1234}),
        protocol.encode_request(hint),
        protocol.ok(3, {"accepted": 3}),
        protocol.encode_request(protocol.Regions(id=6, after=7, limit=2)),
        protocol.error(4, protocol.ProtocolError(protocol.E_NOT_FOUND, "no region 9")),
    ]
    assert len(docs) == len(expected), f"{len(docs)} dumps in the doc, {len(expected)} checked"
    for i, (doc, want) in enumerate(zip(docs, expected)):
        assert protocol.HEADER.unpack_from(doc)[0] == len(doc) - protocol.HEADER_SIZE, i
        assert len(doc) == len(want), i
        if i in (0, 2, 4):
            assert protocol.decode_request(doc[4:]) == protocol.decode_request(want[4:]), i
        else:
            assert doc.hex() == want.hex(), i


def test_the_limits_protocol_md_states_are_the_code_defaults():
    """Sections 1, 2 and 6.1 state the transport's limits as numbers; each
    is the default the code uses (config.py for [limits], server.py for the
    turns and the unread-answer high water), so the page cannot drift from
    a changed default."""
    import re

    from kvtier import config, server
    from protocol_doc import PROTOCOL_MD

    text = " ".join(PROTOCOL_MD.read_text().split())
    default = {o.key: o.default for o in config.OPTIONS}
    mib, kib = 1 << 20, 1 << 10

    def num(pattern: str) -> float:
        m = re.search(pattern, text)
        assert m, f"protocol.md no longer says {pattern!r}"
        return float(m.group(1).replace(",", ""))

    said = {
        "limits.max_message_bytes": num(r"default 16 MiB = (\d+)"),
        "limits.frame_timeout": num(r"`limits\.frame_timeout` \((\d+) s\)"),
        "limits.idle_timeout": num(r"`limits\.idle_timeout` \((\d+) s;"),
        "limits.max_pending_bytes_per_uid": num(r"`limits\.max_pending_bytes_per_uid` \((\d+) MiB\)") * mib,
        "limits.max_connections_per_uid": num(r"`limits\.max_connections_per_uid` \((\d+)\)"),
        "limits.max_connections": num(r"`max_connections` \((\d+)\) minus"),
        "limits.reserved_connections": num(r"`limits\.reserved_connections` \((\d+)\)"),
        "limits.requests_per_second": num(r"`limits\.requests_per_second` \(([\d,]+)/s sustained"),
        "limits.request_burst": num(r"`limits\.request_burst` = ([\d,]+)\)"),
    }
    assert said == {k: default[k] for k in said}
    assert protocol.DEFAULT_MAX_MESSAGE == default["limits.max_message_bytes"]
    assert num(r"turns of at most (\d+) frames") == server.FRAMES_PER_TURN
    assert num(r"frames, ([\d.]+) ms of work") / 1e3 == server.TURN_SECONDS
    assert num(r"ms of work or (\d+) MiB of answers") * mib == server.TURN_ANSWER_BYTES
    assert num(r"ends early \(checked every ([\d.]+) ms\)") / 1e3 == server.TURN_POLL_SECONDS
    assert num(r"is unread: (\d+) MiB shared by all connections of its uid") * mib == server.UNREAD_BYTES_PER_UID
    assert num(r"at most (\d+) MiB and at least \d+ KiB each") * mib == server.WRITE_HIGH_WATER
    assert num(r"at most \d+ MiB and at least (\d+) KiB each") * kib == server.MIN_WRITE_HIGH_WATER
