"""The kvtier control protocol, defined once and independent of transport.

Framing: every message is a 4-byte big-endian unsigned length followed by
that many bytes of one MessagePack map. Requests carry ``op`` (the message
type) and ``id`` (echoed in the response so a client may pipeline); each op's
fields are a msgspec Struct below, so validation (types, ranges, lengths) is
done by msgspec in C rather than by hand. Responses are
``{"id", "ok": true, "result": {...}}`` or
``{"id", "ok": false, "error": {"code", "message", "errno"}}``.

Bulk per-block data (hint block indices and counts, query results) travels as
MessagePack ``bin`` holding packed little-endian arrays (uint32 indices,
uint32 counts, int8 tiers, float32 temperatures): one memcpy on each side
instead of a msgpack integer per block. docs/protocol.md is the normative
description for writers of clients in other languages.

Unknown map keys are ignored so that a newer client may send optional fields
an older daemon does not know; a new required behaviour bumps
``PROTOCOL_VERSION`` and is negotiated in ``hello``.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal, Union

import msgspec
import numpy as np
from msgspec import Meta

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
# The client may send at most this much before the daemon's configured limit
# is known (hello reports the real one).
DEFAULT_MAX_MESSAGE = 16 * 1024 * 1024
# Where kvtierd listens unless configured otherwise (daemon.socket).
DEFAULT_SOCKET = "/run/kvtierd/kvtierd.sock"

# Wire dtypes of packed arrays (explicit little-endian: the wire format does
# not depend on the host).
BLOCKS_DTYPE = np.dtype("<u4")
COUNTS_DTYPE = np.dtype("<u4")
TIERS_DTYPE = np.dtype("i1")
TEMPS_DTYPE = np.dtype("<f4")
FLAGS_DTYPE = np.dtype("u1")
TIMES_DTYPE = np.dtype("<f8")
# tiers, temps, flags, stuck (a FLAGS_DTYPE byte each), last_access_age
BLOCK_ANSWER_BYTES = TIERS_DTYPE.itemsize + TEMPS_DTYPE.itemsize + 2 * FLAGS_DTYPE.itemsize + TIMES_DTYPE.itemsize
# query/blocks answers are pages of at most this many bytes of packed arrays
# (and within max_message_bytes); ANSWER_OVERHEAD is kept for the map around
# them (keys, tier names: at most 64 tiers of short names). One frame is the
# least a connection's turn does, so this bounds what another client waits
# behind: a 256 KiB page is built, encoded and written in under a
# millisecond here (a 1 MiB page took 3-4 ms, page faults of its copies
# included).
MAX_ANSWER_BYTES = 256 * 1024
ANSWER_OVERHEAD = 4096

# User-space addresses are below 2**57 (5-level paging); msgspec bounds are int64.
U64 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Pos64 = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
RegionId = Annotated[int, Meta(ge=1, le=(1 << 31) - 1)]
BlockIndex = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
ReqId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Pid = Annotated[int, Meta(ge=1, le=(1 << 22))]
Tier = Annotated[int, Meta(ge=0, le=63)]
Priority = Annotated[int, Meta(ge=-100, le=100)]
Name = Annotated[str, Meta(max_length=128)]
TenantName = Annotated[str, Meta(max_length=64)]
Constraint = Literal["keep_dram", "never_swap"]
PhaseName = Literal["prefill_done", "active", "free", "discard"]
# "auto", a tier name or a tier index (as a string): where allocate places memory.
TierSpec = Annotated[str, Meta(min_length=1, max_length=64)]
# Packed arrays: the msgpack bin's own length is bounded by the frame limit.
Packed = bytes


class Request(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    id: ReqId = 0


class Hello(Request, tag="hello"):
    versions: Annotated[list[Annotated[int, Meta(ge=0, le=65535)]], Meta(max_length=16)] = msgspec.field(
        default_factory=lambda: [PROTOCOL_VERSION]
    )
    client: Annotated[str, Meta(max_length=128)] = ""


class _Range(Request):
    """What register and allocate both describe: a range cut into blocks."""

    start: U64
    length: Pos64
    block_size: Pos64
    name: Name = ""
    tenant: TenantName = ""
    priority: Priority = 0
    constraints: Annotated[list[Constraint], Meta(max_length=8)] = []


class Register(_Range, tag="register"):
    # Register memory of another process: one of the caller's own uid, or
    # any if the caller is root / admin_group.
    pid: Pid | None = None


class Allocate(_Range, tag="allocate"):
    """Register memory the caller has mapped but not touched yet, and learn
    the NUMA node to bind it to before its first touch (the daemon cannot
    mbind another process's memory; the client library applies it)."""

    tier: TierSpec = "auto"
    # The engine will pin the pages (CUDA host registration, RDMA, io_uring
    # fixed buffers): never moved, counted, never placed on ZONE_MOVABLE.
    pinned: bool = False


class Unregister(Request, tag="unregister"):
    region: RegionId


class Hint(Request, tag="hint"):
    region: RegionId
    blocks: Packed  # <u4 block indices
    counts: Packed | None = None  # <u4, same length as blocks; absent = 1 each


class Phase(Request, tag="phase"):
    region: RegionId
    phase: PhaseName
    blocks: Packed | None = None  # <u4 block indices; absent = whole region


class Query(Request, tag="query"):
    region: RegionId
    first: BlockIndex = 0
    count: BlockIndex | None = None


class Stats(Request, tag="stats"):
    pass


class Status(Request, tag="status"):
    pass


class Tiers(Request, tag="tiers"):
    pass


# A regions answer is a page of at most REGIONS_PAGE_MAX regions (the
# caller's `limit`, REGIONS_PAGE_DEFAULT if it sets none), within
# MAX_ANSWER_BYTES, and ends after the region that takes it past
# REGIONS_PAGE_BLOCKS blocks (each region's summary reads its blocks).
REGIONS_PAGE_DEFAULT = 256
REGIONS_PAGE_MAX = 4096
REGIONS_PAGE_BLOCKS = 1 << 20


class Regions(Request, tag="regions"):
    pid: Pid | None = None
    after: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)] = 0  # ids above this one, ascending
    limit: Annotated[int, Meta(ge=1, le=REGIONS_PAGE_MAX)] | None = None


class Blocks(Request, tag="blocks"):
    region: RegionId
    first: BlockIndex = 0
    count: BlockIndex | None = None


class Migrate(Request, tag="migrate"):
    region: RegionId
    tier: Tier
    blocks: Packed | None = None
    wait: bool = False  # answer once the move is done, with what moved and what did not


class Measure(Request, tag="measure"):
    region: RegionId
    blocks: Packed | None = None


class Pin(Request, tag="pin"):
    region: RegionId
    tier: Tier | None = None  # None: pin where the block is now
    blocks: Packed | None = None


class Unpin(Request, tag="unpin"):
    region: RegionId
    blocks: Packed | None = None


class Explain(Request, tag="explain"):
    region: RegionId
    block: BlockIndex


class RegisterEngine(Request, tag="register_engine"):
    """A logical region whose blocks live in pools the engine owns (pinned,
    in several tiers) and that the engine moves itself: the daemon runs the
    policy and sends the owner ``move`` events on this connection instead of
    calling move_pages."""

    blocks: Annotated[int, Meta(ge=1, le=(1 << 32) - 1)]
    block_size: Pos64
    tiers: Packed  # i1, one per block: the tier each block is in now
    name: Name = ""
    tenant: TenantName = ""
    priority: Priority = 0
    constraints: Annotated[list[Constraint], Meta(max_length=8)] = []


class Attach(Request, tag="attach"):
    """Make this connection the one that executes an engine region's moves
    (after a reconnect), optionally reporting where its blocks are now."""

    region: RegionId
    tiers: Packed | None = None


class MoveDone(Request, tag="move_done"):
    """The engine's answer to a ``move`` event: which blocks it moved."""

    move: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    ok: Packed  # u1 per block of the move, in its order: 1 = moved
    error: Annotated[str, Meta(max_length=1024)] = ""


class Prefetch(Request, tag="prefetch"):
    """These blocks are about to be read (a preempted or returning session):
    bring them to tier 0 now."""

    region: RegionId
    blocks: Packed | None = None  # <u4 block indices; absent = whole region


class Release(Request, tag="release"):
    """The session is paused: these blocks may go one tier down now."""

    region: RegionId
    blocks: Packed | None = None


class Ages(Request, tag="ages"):
    pass


class HintRing(Request, tag="hint_ring"):
    """A shared-memory hint ring for this connection (kvtier.hintring;
    docs/protocol.md): the first call's answer carries the ring's memfd
    (SCM_RIGHTS); a later call drains the ring and reports its counters."""

    entries: Annotated[int, Meta(ge=0, le=1 << 30)] = 0  # 0: the daemon's limit


AnyRequest = Union[
    Hello, Register, Allocate, Unregister, Hint, Phase, Query, Stats, Status, Tiers, Regions,
    Blocks, Migrate, Measure, Pin, Unpin, Explain, Ages, Prefetch, Release, RegisterEngine, Attach, MoveDone,
    HintRing,
]
REQUEST_TYPES: tuple[type[Request], ...] = AnyRequest.__args__  # type: ignore[attr-defined]
OPS = {t.__struct_config__.tag: t for t in REQUEST_TYPES}
# Features no op name shows: regions follow their process by pidfd
# (pidfd-lifetime), registrations survive a daemon restart (persist),
# engine-mode regions get `move` events (engine-moves).
FEATURES = ("pidfd-lifetime", "persist", "engine-moves")
# hello's `capabilities`: every op this daemon accepts, then FEATURES. It was
# a hand-kept list that lacked unregister, unpin, ages and the engine ops: a
# client testing for an op it needs would have refused a daemon that has it.
CAPABILITIES = (*OPS, *FEATURES)


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    errno: int = 0
    retry_after_ms: int = 0


class Response(msgspec.Struct, omit_defaults=True):
    id: int
    ok: bool
    result: Any = None
    error: ErrorBody | None = None
    # Set on a frame the daemon sends unasked (id 0): "move" asks an
    # engine-mode region's owner to move blocks (result: the move).
    event: str | None = None


class _IdOnly(msgspec.Struct):
    """Salvages the request id from a map that failed validation."""

    id: Any = 0


# Error codes (stable strings; docs/protocol.md lists them).
E_BAD_FRAME = "bad_frame"
E_TOO_LARGE = "message_too_large"
E_INVALID_REQUEST = "invalid_request"
E_UNSUPPORTED_VERSION = "unsupported_version"
E_INVALID_ARGUMENT = "invalid_argument"
E_RANGE_NOT_MAPPED = "range_not_mapped"
E_PERMISSION = "permission_denied"
E_NOT_FOUND = "not_found"
E_OVERLAP = "overlap"
E_LIMIT = "limit_exceeded"
E_RATE = "rate_limited"
E_PROCESS_GONE = "process_gone"
E_FEATURE = "feature_unavailable"
E_OS = "os_error"
E_UNAVAILABLE = "unavailable"
E_INTERNAL = "internal_error"
ERROR_CODES = (
    E_BAD_FRAME, E_TOO_LARGE, E_INVALID_REQUEST, E_UNSUPPORTED_VERSION, E_INVALID_ARGUMENT,
    E_RANGE_NOT_MAPPED, E_PERMISSION, E_NOT_FOUND, E_OVERLAP, E_LIMIT, E_RATE,
    E_PROCESS_GONE, E_FEATURE, E_OS, E_UNAVAILABLE, E_INTERNAL,
)


class ProtocolError(Exception):
    """A request the daemon refuses; becomes an error response.

    ``fatal`` errors (bad framing) also close the connection, because the
    byte stream can no longer be trusted to be at a frame boundary.
    """

    def __init__(self, code: str, message: str, *, errno: int = 0, fatal: bool = False,
                 retry_after_ms: int = 0, req_id: int = 0):
        super().__init__(message)
        self.code = code
        self.errno = errno
        self.fatal = fatal
        self.retry_after_ms = retry_after_ms
        self.req_id = req_id

    def body(self) -> ErrorBody:
        return ErrorBody(self.code, str(self), self.errno, self.retry_after_ms)


_req_decoder = msgspec.msgpack.Decoder(AnyRequest)
_id_decoder = msgspec.msgpack.Decoder(_IdOnly)
_resp_decoder = msgspec.msgpack.Decoder(Response)
_encoder = msgspec.msgpack.Encoder()


def decode_request(payload: bytes | memoryview) -> Request:
    """One frame's payload to a validated Request, or ProtocolError carrying
    whatever request id could be salvaged."""
    try:
        return _req_decoder.decode(payload)
    except msgspec.ValidationError as e:
        raise ProtocolError(E_INVALID_REQUEST, str(e), req_id=_salvage_id(payload)) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(E_INVALID_REQUEST, f"malformed msgpack: {e}") from None
    except RecursionError:
        # msgspec recurses per nesting level, also inside ignored unknown
        # keys; a few KiB of 0x91 bytes reach Python's recursion limit.
        raise ProtocolError(E_INVALID_REQUEST, "malformed msgpack: nested too deeply") from None


def _salvage_id(payload: bytes | memoryview) -> int:
    try:
        rid = _id_decoder.decode(payload).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 0
    # bool is an int subclass: an id of `false` must not be echoed as one.
    return rid if type(rid) is int and 0 <= rid < (1 << 63) else 0


def encode_value(value: Any) -> bytes:
    """MessagePack of one value, as it is inside a frame (for msgspec.Raw)."""
    return _encoder.encode(value)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def encode_request(req: Request) -> bytes:
    return frame(_encoder.encode(req))


def encode_response(resp: Response) -> bytes:
    return frame(_encoder.encode(resp))


def ok(req_id: int, result: Any = None) -> bytes:
    return encode_response(Response(req_id, True, result if result is not None else {}))


def event(name: str, body: Any) -> bytes:
    return encode_response(Response(0, True, body, None, name))


def error(req_id: int, err: ProtocolError) -> bytes:
    return encode_response(Response(req_id, False, None, err.body()))


def decode_response(payload: bytes | memoryview) -> Response:
    return _resp_decoder.decode(payload)


# A payload at least this large that fills the reader's buffer is passed on
# without a copy (FrameReader.next).
HANDOVER_BYTES = 1 << 20


class FrameReader:
    """Splits a byte stream into frame payloads; transport-agnostic.

    ``push`` appends received bytes, ``next`` takes one complete payload out
    (None if there is none yet), so a server can answer a few frames and
    leave the rest for its next turn; ``feed`` does both for callers that
    want every frame at once. An announced length above ``max_size`` raises a
    fatal ProtocolError before the body is buffered, so an oversized frame
    costs the daemon 4 bytes, not its memory.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_MESSAGE):
        self.max_size = max_size
        self.buf = bytearray()
        self.pos = 0  # start of the first unconsumed byte

    def push(self, data: bytes) -> None:
        if self.pos and self.pos >= len(self.buf) // 2:
            del self.buf[: self.pos]  # compact: amortised O(1) per byte
            self.pos = 0
        self.buf += data

    def _size(self) -> int | None:
        """Announced size of the next frame, validated; None if the header is incomplete."""
        if len(self.buf) - self.pos < HEADER_SIZE:
            return None
        (size,) = HEADER.unpack_from(self.buf, self.pos)
        if size > self.max_size:
            raise ProtocolError(
                E_TOO_LARGE,
                f"frame of {size} bytes exceeds the limit of {self.max_size}",
                fatal=True,
            )
        if size == 0:
            raise ProtocolError(E_BAD_FRAME, "empty frame", fatal=True)
        return size

    def next(self) -> bytes | memoryview | None:
        size = self._size()
        if size is None:
            return None
        end = self.pos + HEADER_SIZE + size
        if end > len(self.buf):
            return None
        if self.pos == 0 and end == len(self.buf) and size >= HANDOVER_BYTES:
            # the buffer holds this frame alone: handed over, not copied (a
            # 16 MiB frame's two copies held the daemon's loop ~20 ms)
            whole, self.buf = self.buf, bytearray()
            return memoryview(whole)[HEADER_SIZE:]
        with memoryview(self.buf) as mv:
            payload = bytes(mv[self.pos + HEADER_SIZE : end])
        self.pos = end
        if self.pos == len(self.buf):
            self.buf.clear()
            self.pos = 0
        return payload

    def has_frame(self) -> bool:
        """A complete frame is waiting (a bad header counts: next() raises it)."""
        try:
            size = self._size()
        except ProtocolError:
            return True
        return size is not None and len(self.buf) - self.pos >= HEADER_SIZE + size

    def feed(self, data: bytes) -> list[bytes]:
        self.push(data)
        out = []
        while (payload := self.next()) is not None:
            out.append(payload)
        return out

    @property
    def pending(self) -> int:
        """Bytes received and not yet taken out as frames."""
        return len(self.buf) - self.pos


def pack_blocks(blocks: Any) -> bytes:
    return np.ascontiguousarray(blocks, dtype=BLOCKS_DTYPE).tobytes()


def unpack(data: bytes | None, dtype: np.dtype, what: str) -> np.ndarray | None:
    """A packed array field to numpy (zero-copy); ProtocolError if its byte
    length is not a whole number of elements."""
    if data is None:
        return None
    if len(data) % dtype.itemsize:
        raise ProtocolError(
            E_INVALID_ARGUMENT,
            f"{what}: {len(data)} bytes is not a multiple of {dtype.itemsize} ({dtype.str})",
        )
    return np.frombuffer(data, dtype=dtype)
