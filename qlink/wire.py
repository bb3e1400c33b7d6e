"""Frame encoding and validation: the CUDA-Q QEC realtime decoder RPC, byte for byte.

Every qlink frame is a 24-byte header followed by a payload, packed little-endian
with no padding, exactly as the CUDA-Q realtime dispatcher (``RPCHeader`` /
``RPCResponse``) and the CUDA-Q QEC decoder RPC lay them out::

    request   u32 magic 0x43555152 'CUQR' | u32 function_id | u32 arg_len    | u32 request_id | u64 ptp_timestamp
    response  u32 magic 0x43555153 'CUQS' | i32 status      | u32 result_len | u32 request_id | u64 ptp_timestamp

``function_id`` is the 32-bit FNV-1a hash of the callee name, hashed over the bare
ASCII name with no terminator (``fnv1a_32("enqueue_syndromes") == 0x7ED8BE82``).
The three decoder calls and their payloads (signed 64-bit integers):

=====================  ==========  ===================================================
call                   payload     layout
=====================  ==========  ===================================================
``enqueue_syndromes``  32 + ⌈n/8⌉  decoder_id, counter, syndrome_mapping_id,
                                   num_syndromes (= n bits), then n bits packed LSB
                                   first (bit i is ``(byte[i // 8] >> (i % 8)) & 1``)
``get_corrections``    17          decoder_id, return_size (a count of correction
                                   *bits*), u8 reset (0 keep state, 1 reset after read)
``reset_decoder``      8           decoder_id
=====================  ==========  ===================================================

The answer to ``get_corrections`` carries the corrections packed LSB first, so its
``result_len`` is ⌈return_size/8⌉ bytes. ``enqueue_syndromes`` is fire-and-forget in
CUDA-Q realtime (the decoder answers nothing); the other two are answered.

Validation (what :func:`decode_request` accepts; every refusal is a
:class:`FrameError` whose ``fault`` names the rule broken and the status to answer):

- ``arg_len`` delimits the frame. Bytes of the buffer *after* ``24 + arg_len`` are
  not part of the frame and are ignored (ring-buffer slots are fixed-size), so a
  stream reader advances by :attr:`Request.nbytes`. Inside the frame qlink is
  strict: ``arg_len`` must be exactly the size the payload needs; extra bytes
  inside ``arg_len`` are a ``PAYLOAD_SIZE``/``PACKED_LENGTH`` fault. (CUDA-Q's own
  slot parsers tolerate such extra bytes; qlink's encoders never write them.)
- ``num_syndromes`` must lie in ``[1, 2**20]`` (CUDA-Q rejects 0 too), the packed
  bytes must be exactly ⌈num_syndromes/8⌉; pad bits of the last byte are ignored
  on decode and written as 0 on encode.
- ``decoder_id`` in ``[0, 32)`` (fault status ``INVALID_DECODER``), ``counter >= 0``,
  ``0 <= return_size <= 2**20`` (qlink's own cap), ``reset`` byte 0 or 1.
- A response's ``status`` is any i32: known values decode to :class:`Status`,
  others stay plain ints (the CUDA-Q dispatcher answers -1 when no handler matches).

Other qlink traffic (KV-write notifications, control) uses the same header with
its own FNV-1a ids registered in a :class:`FunctionRegistry`, so one parser serves
everything.

>>> buf = bytearray(64)
>>> n = encode_get_corrections_into(buf, request_id=7, decoder_id=0, return_size=9)
>>> n
41
>>> req = decode_request(buf[:n])
>>> req.function, req.request_id, req.payload
('get_corrections', 7, GetCorrections(decoder_id=0, return_size=9, reset=False))
>>> decode_request(buf[1:n])
Traceback (most recent call last):
...
qlink.wire.FrameError: bad request magic 0xA1435551 (not ASCII); expected 0x43555152 ('CUQR')
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from qlink.errors import WireError

__all__ = [
    "REQUEST_MAGIC",
    "RESPONSE_MAGIC",
    "HEADER_NBYTES",
    "MAX_SYNDROME_BITS",
    "MAX_CORRECTION_BITS",
    "MAX_DECODERS",
    "ENQUEUE_SYNDROMES",
    "GET_CORRECTIONS",
    "RESET_DECODER",
    "ENQUEUE_SYNDROMES_FIXED_NBYTES",
    "GET_CORRECTIONS_PAYLOAD_NBYTES",
    "RESET_DECODER_PAYLOAD_NBYTES",
    "REQUEST_IDS", "REQUEST_IDS_OFFSET", "REQUEST_ID_FIELD", "REQUEST_ID_OFFSET", "PTP_FIELD", "PTP_OFFSET",
    "RESPONSE_FIELDS", "RESPONSE_FIELDS_OFFSET", "ENQUEUE_COUNTER", "ENQUEUE_COUNTER_OFFSET", "GET_RETURN_SIZE",
    "GET_RETURN_SIZE_OFFSET",
    "Status",
    "Fault",
    "FrameError",
    "UnknownFunctionError",
    "fnv1a_32",
    "function_id_for",
    "FunctionSpec",
    "FunctionRegistry",
    "REGISTRY",
    "register_function",
    "EnqueueSyndromes",
    "GetCorrections",
    "ResetDecoder",
    "Request",
    "Response",
    "enqueue_syndromes_nbytes",
    "corrections_nbytes",
    "frame_nbytes",
    "encode_request_header_into",
    "encode_request_into",
    "encode_enqueue_syndromes_into",
    "encode_get_corrections_into",
    "encode_reset_decoder_into",
    "encode_response_header_into",
    "encode_response_into",
    "encode_corrections_response_into",
    "decode_request",
    "decode_response",
    "pack_bits",
    "unpack_bits",
    "REQUEST_HEADER",
    "RESPONSE_HEADER",
    "ENQUEUE_FIXED",
    "GET_CORRECTIONS_PAYLOAD",
    "RESET_DECODER_PAYLOAD",
    "native_layout",
]

REQUEST_MAGIC = 0x43555152  # b"RQUC" on the wire: 'CUQR' read as a little-endian u32
RESPONSE_MAGIC = 0x43555153  # 'CUQS'
HEADER_NBYTES = 24
MAX_SYNDROME_BITS = 1 << 20
MAX_CORRECTION_BITS = 1 << 20  # qlink's cap on get_corrections.return_size
MAX_DECODERS = 32

ENQUEUE_SYNDROMES_FIXED_NBYTES = 32
GET_CORRECTIONS_PAYLOAD_NBYTES = 17
RESET_DECODER_PAYLOAD_NBYTES = 8

_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

_REQUEST_HEADER = struct.Struct("<IIIIQ")
_RESPONSE_HEADER = struct.Struct("<IiIIQ")
_ENQUEUE_FIXED = struct.Struct("<qqqq")
_GET_CORRECTIONS = struct.Struct("<qqB")
_RESET_DECODER = struct.Struct("<q")
_MAGIC = struct.Struct("<I")
# The byte layouts, public: every fast path (the service's, the controller's, the native
# core's through native_layout()) reads and writes frames with these and no other.
REQUEST_HEADER = _REQUEST_HEADER  # magic, function_id, arg_len, request_id, ptp_timestamp
RESPONSE_HEADER = _RESPONSE_HEADER  # magic, status, result_len, request_id, ptp_timestamp
ENQUEUE_FIXED = _ENQUEUE_FIXED  # decoder_id, counter, syndrome_mapping_id, num_syndromes
GET_CORRECTIONS_PAYLOAD = _GET_CORRECTIONS  # decoder_id, return_size, reset
RESET_DECODER_PAYLOAD = _RESET_DECODER  # decoder_id


def _fields(layout: struct.Struct, first: int, last: int, *, base: int = 0) -> tuple[struct.Struct, int]:
    """Fields ``first..last`` (0-based) of ``layout`` (one code a field, little-endian, unpadded)
    as a layout of their own, and the byte offset of the first (plus ``base``): what a hot path
    patches in place in a prebuilt frame, derived here so no other module restates a layout."""
    codes = layout.format[1:]
    return struct.Struct("<" + codes[first:last + 1]), base + struct.calcsize("<" + codes[:first])


# Fields patched in place by the fast paths (each with its byte offset in the frame)
REQUEST_IDS, REQUEST_IDS_OFFSET = _fields(_REQUEST_HEADER, 3, 4)  # request_id, ptp_timestamp
REQUEST_ID_FIELD, REQUEST_ID_OFFSET = _fields(_REQUEST_HEADER, 3, 3)
PTP_FIELD, PTP_OFFSET = _fields(_REQUEST_HEADER, 4, 4)
RESPONSE_FIELDS, RESPONSE_FIELDS_OFFSET = _fields(_RESPONSE_HEADER, 1, 4)  # status, result_len, request_id, ptp
ENQUEUE_COUNTER, ENQUEUE_COUNTER_OFFSET = _fields(_ENQUEUE_FIXED, 1, 1, base=HEADER_NBYTES)
GET_RETURN_SIZE, GET_RETURN_SIZE_OFFSET = _fields(_GET_CORRECTIONS, 1, 1, base=HEADER_NBYTES)
assert (REQUEST_IDS_OFFSET, PTP_OFFSET, RESPONSE_FIELDS_OFFSET) == (12, 16, 4)
assert ENQUEUE_COUNTER_OFFSET == GET_RETURN_SIZE_OFFSET == HEADER_NBYTES + 8
assert _REQUEST_HEADER.size == _RESPONSE_HEADER.size == HEADER_NBYTES
assert _ENQUEUE_FIXED.size == ENQUEUE_SYNDROMES_FIXED_NBYTES
assert _GET_CORRECTIONS.size == GET_CORRECTIONS_PAYLOAD_NBYTES
assert _RESET_DECODER.size == RESET_DECODER_PAYLOAD_NBYTES


# --------------------------------------------------------------------------- ids


def fnv1a_32(data: str | bytes) -> int:
    """32-bit FNV-1a hash (offset basis 0x811C9DC5, prime 0x01000193) of ``data``.

    A ``str`` is hashed as its UTF-8 bytes.

    >>> hex(fnv1a_32("enqueue_syndromes"))
    '0x7ed8be82'
    >>> hex(fnv1a_32(b""))
    '0x811c9dc5'
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    h = 0x811C9DC5
    for byte in bytes(data):
        h = ((h ^ byte) * 0x01000193) & _U32_MAX
    return h


def function_id_for(name: str) -> int:
    """The ``function_id`` of callee ``name``: FNV-1a 32 of its ASCII bytes.

    Names must be non-empty ASCII: CUDA-Q hashes C ``char`` values, which are
    signed on x86-64, so non-ASCII bytes would hash differently on the two sides.

    >>> hex(function_id_for("get_corrections")), hex(function_id_for("reset_decoder"))
    ('0x882d5ba1', '0x977a59cf')
    >>> function_id_for("décodeur")
    Traceback (most recent call last):
    ...
    ValueError: function name 'décodeur' must be non-empty ASCII ...
    """
    if not isinstance(name, str) or not name or not name.isascii() or "\0" in name:
        raise ValueError(
            f"function name {name!r} must be non-empty ASCII without NUL: CUDA-Q hashes "
            "C chars, which are signed on x86-64, so non-ASCII names hash differently there"
        )
    return fnv1a_32(name.encode("ascii"))


ENQUEUE_SYNDROMES = 0x7ED8BE82
GET_CORRECTIONS = 0x882D5BA1
RESET_DECODER = 0x977A59CF


class Status(enum.IntEnum):
    """Status carried in a response header (CUDA-Q QEC ``RpcStatus``)."""

    OK = 0
    INVALID_DECODER = 1
    BAD_REQUEST = 2
    INTERNAL_ERROR = 3
    NOT_READY = 4
    BUSY = 5
    SYNDROMES_DROPPED = 6


_STATUS_BY_VALUE = {int(s): s for s in Status}


def native_layout() -> dict:
    """The wire's numbers and struct formats, as plain data for native code.

    ``qlink.qec._hotcore`` takes its layout from here (and refuses formats it does not
    implement), so this module stays the one owner of the bytes.

    >>> lay = native_layout()
    >>> lay["request_header"], hex(lay["ENQUEUE_SYNDROMES"]), lay["NOT_READY"]
    ('<IIIIQ', '0x7ed8be82', 4)
    """
    out = {name: globals()[name] for name in (
        "REQUEST_MAGIC", "RESPONSE_MAGIC", "HEADER_NBYTES", "MAX_SYNDROME_BITS", "MAX_CORRECTION_BITS",
        "MAX_DECODERS", "ENQUEUE_SYNDROMES", "GET_CORRECTIONS", "RESET_DECODER", "ENQUEUE_SYNDROMES_FIXED_NBYTES",
        "GET_CORRECTIONS_PAYLOAD_NBYTES", "RESET_DECODER_PAYLOAD_NBYTES")}
    out.update({st.name: int(st) for st in Status})
    out.update(request_header=REQUEST_HEADER.format, response_header=RESPONSE_HEADER.format,
               enqueue_fixed=ENQUEUE_FIXED.format, get_corrections=GET_CORRECTIONS_PAYLOAD.format,
               reset_decoder=RESET_DECODER_PAYLOAD.format)
    return out


# ------------------------------------------------------------------------ errors


class Fault(enum.Enum):
    """Which validation rule a frame broke; :attr:`status` is the answer to send.

    >>> Fault.DECODER_ID.status, Fault.BAD_MAGIC.status
    (<Status.INVALID_DECODER: 1>, <Status.BAD_REQUEST: 2>)
    """

    SHORT_BUFFER = "short_buffer"  # fewer than 24 bytes
    BAD_MAGIC = "bad_magic"
    LENGTH_PAST_END = "length_past_end"  # arg_len / result_len runs past the buffer
    UNKNOWN_FUNCTION = "unknown_function"
    PAYLOAD_SIZE = "payload_size"  # arg_len wrong for the function
    NUM_SYNDROMES = "num_syndromes"  # outside [1, 2**20]
    PACKED_LENGTH = "packed_length"  # packed bytes != ceil(num_syndromes / 8)
    DECODER_ID = "decoder_id"  # outside [0, 32)
    COUNTER = "counter"  # negative
    RETURN_SIZE = "return_size"  # outside [0, 2**20]
    RESET_FLAG = "reset_flag"  # reset byte neither 0 nor 1
    PAYLOAD_INVALID = "payload_invalid"  # a registered parser refused the payload

    @property
    def status(self) -> Status:
        return Status.INVALID_DECODER if self is Fault.DECODER_ID else Status.BAD_REQUEST


class FrameError(WireError):
    """A frame failed validation.

    Attributes: ``fault`` (:class:`Fault`), and where the header could be read,
    ``function_id``, ``request_id`` and ``ptp_timestamp`` (else ``None``) so a service
    can answer ``fault.status`` to the right request.
    """

    def __init__(
        self,
        message: str,
        *,
        fault: Fault,
        function_id: int | None = None,
        request_id: int | None = None,
        ptp_timestamp: int | None = None,
    ) -> None:
        super().__init__(message)
        self.fault = fault
        self.function_id = function_id
        self.request_id = request_id
        self.ptp_timestamp = ptp_timestamp


class UnknownFunctionError(FrameError):
    """The request names a ``function_id`` nobody registered (fault ``UNKNOWN_FUNCTION``)."""


def _magic_text(magic: int) -> str:
    raw = _MAGIC.pack(magic)[::-1]  # big-endian reading gives the intended letters
    return repr(raw.decode("latin-1")) if all(32 <= b < 127 for b in raw) else "not ASCII"


# ---------------------------------------------------------------------- registry


@dataclass(frozen=True)
class FunctionSpec:
    """A callee the parser knows: its name, id, payload size bounds and parser.

    ``parse(payload: memoryview)`` returns the decoded payload or raises
    :class:`FrameError`; ``None`` leaves the payload as a raw ``memoryview``.
    """

    name: str
    function_id: int
    min_payload_nbytes: int = 0
    max_payload_nbytes: int | None = None
    parse: Callable[[memoryview], Any] | None = None


class FunctionRegistry:
    """``function_id`` → :class:`FunctionSpec`; one registry serves one parser.

    >>> reg = FunctionRegistry()
    >>> spec = reg.register("kv_write_done", payload_nbytes=16)
    >>> hex(spec.function_id), spec.function_id in reg
    ('0x...', True)
    >>> reg.register("kv_write_done", payload_nbytes=8)
    Traceback (most recent call last):
    ...
    ValueError: function 'kv_write_done' (0x...) is already registered with different options
    """

    def __init__(self, specs: tuple[FunctionSpec, ...] = ()) -> None:
        self._by_id: dict[int, FunctionSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: FunctionSpec) -> FunctionSpec:
        """Register a prepared spec; re-adding an identical spec is a no-op."""
        if spec.function_id != function_id_for(spec.name):
            raise ValueError(
                f"spec for {spec.name!r} has function_id 0x{spec.function_id:08X}; "
                f"FNV-1a of the name is 0x{function_id_for(spec.name):08X}"
            )
        if spec.min_payload_nbytes < 0 or (
            spec.max_payload_nbytes is not None and spec.max_payload_nbytes < spec.min_payload_nbytes
        ):
            raise ValueError(
                f"payload bounds of {spec.name!r} must satisfy 0 <= min <= max, got "
                f"min={spec.min_payload_nbytes}, max={spec.max_payload_nbytes}"
            )
        old = self._by_id.get(spec.function_id)
        if old is not None and old != spec:
            if old.name != spec.name:
                raise ValueError(
                    f"function {spec.name!r} collides with {old.name!r}: both hash to "
                    f"0x{spec.function_id:08X}; rename one of them"
                )
            raise ValueError(
                f"function {spec.name!r} (0x{spec.function_id:08X}) is already registered "
                "with different options"
            )
        self._by_id[spec.function_id] = spec
        return spec

    def register(
        self,
        name: str,
        *,
        payload_nbytes: int | None = None,
        min_payload_nbytes: int = 0,
        max_payload_nbytes: int | None = None,
        parse: Callable[[memoryview], Any] | None = None,
    ) -> FunctionSpec:
        """Register callee ``name``; ``payload_nbytes`` fixes the size exactly."""
        if payload_nbytes is not None:
            min_payload_nbytes = max_payload_nbytes = payload_nbytes
        return self.add(
            FunctionSpec(name, function_id_for(name), min_payload_nbytes, max_payload_nbytes, parse)
        )

    def get(self, function_id: int) -> FunctionSpec | None:
        return self._by_id.get(function_id)

    def copy(self) -> "FunctionRegistry":
        return FunctionRegistry(tuple(self._by_id.values()))

    def __contains__(self, function_id: object) -> bool:
        return function_id in self._by_id

    def __iter__(self) -> Iterator[FunctionSpec]:
        return iter(tuple(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)


# ---------------------------------------------------------------------- payloads


class EnqueueSyndromes(NamedTuple):
    """Decoded ``enqueue_syndromes`` payload; the bits stay a view into the frame."""

    decoder_id: int
    counter: int
    syndrome_mapping_id: int
    num_syndromes: int
    syndromes_bits_packed: memoryview

    def syndromes(self, *, out: np.ndarray | None = None) -> np.ndarray:
        """The syndrome bits unpacked to a uint8 array of 0/1 (see :func:`unpack_bits`)."""
        return unpack_bits(self.syndromes_bits_packed, self.num_syndromes, out=out)


class GetCorrections(NamedTuple):
    """Decoded ``get_corrections`` payload; ``return_size`` counts correction bits."""

    decoder_id: int
    return_size: int
    reset: bool


class ResetDecoder(NamedTuple):
    """Decoded ``reset_decoder`` payload."""

    decoder_id: int


def _fault(fault: Fault, message: str) -> FrameError:
    return FrameError(message, fault=fault)


def _check_decoder_id(decoder_id: int) -> None:
    if not 0 <= decoder_id < MAX_DECODERS:
        raise _fault(Fault.DECODER_ID, f"decoder_id {decoder_id} is outside [0, {MAX_DECODERS})")


def _parse_enqueue(payload: memoryview) -> EnqueueSyndromes:
    decoder_id, counter, mapping_id, num_syndromes = _ENQUEUE_FIXED.unpack_from(payload)
    _check_decoder_id(decoder_id)
    if counter < 0:
        raise _fault(Fault.COUNTER, f"counter {counter} is negative; it must be >= 0")
    if not 1 <= num_syndromes <= MAX_SYNDROME_BITS:
        raise _fault(
            Fault.NUM_SYNDROMES,
            f"num_syndromes {num_syndromes} is outside [1, {MAX_SYNDROME_BITS}]",
        )
    packed_nbytes = len(payload) - ENQUEUE_SYNDROMES_FIXED_NBYTES
    if packed_nbytes != (num_syndromes + 7) >> 3:
        raise _fault(
            Fault.PACKED_LENGTH,
            f"{packed_nbytes} packed syndrome bytes follow, but num_syndromes={num_syndromes} "
            f"needs exactly {(num_syndromes + 7) >> 3} (arg_len must be "
            f"{ENQUEUE_SYNDROMES_FIXED_NBYTES + ((num_syndromes + 7) >> 3)})",
        )
    bits = payload[ENQUEUE_SYNDROMES_FIXED_NBYTES:]
    return EnqueueSyndromes(decoder_id, counter, mapping_id, num_syndromes, bits)


def _parse_get_corrections(payload: memoryview) -> GetCorrections:
    decoder_id, return_size, reset = _GET_CORRECTIONS.unpack_from(payload)
    _check_decoder_id(decoder_id)
    if not 0 <= return_size <= MAX_CORRECTION_BITS:
        raise _fault(
            Fault.RETURN_SIZE,
            f"return_size {return_size} is outside [0, {MAX_CORRECTION_BITS}] correction bits",
        )
    if reset > 1:
        raise _fault(Fault.RESET_FLAG, f"reset byte is {reset}; it must be 0 or 1")
    return GetCorrections(decoder_id, return_size, bool(reset))


def _parse_reset_decoder(payload: memoryview) -> ResetDecoder:
    (decoder_id,) = _RESET_DECODER.unpack_from(payload)
    _check_decoder_id(decoder_id)
    return ResetDecoder(decoder_id)


REGISTRY = FunctionRegistry(
    (
        FunctionSpec(
            "enqueue_syndromes",
            ENQUEUE_SYNDROMES,
            ENQUEUE_SYNDROMES_FIXED_NBYTES,
            ENQUEUE_SYNDROMES_FIXED_NBYTES + MAX_SYNDROME_BITS // 8,
            _parse_enqueue,
        ),
        FunctionSpec(
            "get_corrections",
            GET_CORRECTIONS,
            GET_CORRECTIONS_PAYLOAD_NBYTES,
            GET_CORRECTIONS_PAYLOAD_NBYTES,
            _parse_get_corrections,
        ),
        FunctionSpec(
            "reset_decoder",
            RESET_DECODER,
            RESET_DECODER_PAYLOAD_NBYTES,
            RESET_DECODER_PAYLOAD_NBYTES,
            _parse_reset_decoder,
        ),
    )
)
"""The default registry: the three decoder calls plus whatever qlink modules add."""


def register_function(name: str, **options: Any) -> int:
    """Register ``name`` in :data:`REGISTRY` (see :meth:`FunctionRegistry.register`);
    returns its ``function_id``."""
    return REGISTRY.register(name, **options).function_id


# ------------------------------------------------------------------------ frames


class Request(NamedTuple):
    """A validated request. ``payload`` is the parsed payload, or a ``memoryview`` of
    the payload bytes for functions registered without a parser. Views alias the
    decoded buffer: copy them before the buffer is reused."""

    function: str
    function_id: int
    arg_len: int
    request_id: int
    ptp_timestamp: int
    payload: Any

    @property
    def nbytes(self) -> int:
        """Bytes of the frame: header plus ``arg_len``."""
        return HEADER_NBYTES + self.arg_len


class Response(NamedTuple):
    """A validated response. ``status`` is a :class:`Status` when the value is known,
    else the raw int; ``result`` is a ``memoryview`` into the decoded buffer."""

    status: Status | int
    result_len: int
    request_id: int
    ptp_timestamp: int
    result: memoryview

    @property
    def nbytes(self) -> int:
        """Bytes of the frame: header plus ``result_len``."""
        return HEADER_NBYTES + self.result_len


def enqueue_syndromes_nbytes(num_syndromes: int) -> int:
    """Frame size of an ``enqueue_syndromes`` request carrying ``num_syndromes`` bits.

    >>> enqueue_syndromes_nbytes(1), enqueue_syndromes_nbytes(17)
    (57, 59)
    """
    return HEADER_NBYTES + ENQUEUE_SYNDROMES_FIXED_NBYTES + ((num_syndromes + 7) >> 3)


def longest_enqueue_nbytes(queues) -> int:
    """The longest ``enqueue_syndromes`` request decoders can use: a whole queue of the largest
    decoder's shots, capped by the wire's 2^20 bits; ``queues`` gives ``(syndrome bits per
    shot, shots queued)`` for each decoder. A service refuses a longer one from its header.

    >>> longest_enqueue_nbytes([(24, 1024), (120, 16)]) == enqueue_syndromes_nbytes(24 * 1024)
    True
    """
    return enqueue_syndromes_nbytes(max(min(MAX_SYNDROME_BITS, bits * shots) for bits, shots in queues))


def corrections_nbytes(num_corrections: int) -> int:
    """Frame size of the response to ``get_corrections(return_size=num_corrections)``.

    >>> corrections_nbytes(0), corrections_nbytes(9)
    (24, 26)
    """
    return HEADER_NBYTES + ((num_corrections + 7) >> 3)


def _byte_view(buf: Any) -> memoryview:
    mv = buf if type(buf) is memoryview else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def frame_nbytes(buf: Any) -> int:
    """Size of the request or response frame starting at ``buf[0]``, read from its
    header (for stream transports: how many bytes to wait for).

    >>> frame_nbytes(bytes.fromhex("52515543" "829bd87e" "09000000") + bytes(12))
    33
    """
    mv = _byte_view(buf)
    if len(mv) < HEADER_NBYTES:
        raise _fault(
            Fault.SHORT_BUFFER, f"a frame header needs {HEADER_NBYTES} bytes, got {len(mv)}"
        )
    (magic,) = _MAGIC.unpack_from(mv)
    if magic not in (REQUEST_MAGIC, RESPONSE_MAGIC):
        raise _fault(
            Fault.BAD_MAGIC,
            f"bad magic 0x{magic:08X} ({_magic_text(magic)}); expected 0x{REQUEST_MAGIC:08X} "
            f"('CUQR') or 0x{RESPONSE_MAGIC:08X} ('CUQS')",
        )
    return HEADER_NBYTES + _MAGIC.unpack_from(mv, 8)[0]


def decode_request(buf: Any, *, registry: FunctionRegistry | None = None) -> Request:
    """Validate and decode the request frame at the start of ``buf`` (zero-copy).

    ``buf`` is any buffer (bytes, bytearray, memoryview, numpy array); bytes past
    the frame's end are ignored. Raises :class:`FrameError` (fault named) on any
    invalid frame, and only that.

    >>> buf = bytearray(100)
    >>> n = encode_enqueue_syndromes_into(buf, request_id=1, decoder_id=3, counter=0,
    ...                                   syndrome_mapping_id=0, syndromes=[1, 0, 1])
    >>> req = decode_request(buf)
    >>> req.payload.num_syndromes, req.payload.syndromes().tolist(), req.nbytes == n
    (3, [1, 0, 1], True)
    """
    mv = _byte_view(buf)
    nbytes = len(mv)
    if nbytes < HEADER_NBYTES:
        raise _fault(
            Fault.SHORT_BUFFER,
            f"a request needs at least {HEADER_NBYTES} header bytes, got {nbytes}",
        )
    magic, function_id, arg_len, request_id, ptp_timestamp = _REQUEST_HEADER.unpack_from(mv)
    if magic != REQUEST_MAGIC:
        hint = " (this is a response frame: use decode_response)" if magic == RESPONSE_MAGIC else ""
        raise _fault(
            Fault.BAD_MAGIC,
            f"bad request magic 0x{magic:08X} ({_magic_text(magic)}); expected "
            f"0x{REQUEST_MAGIC:08X} ('CUQR'){hint}",
        )
    try:
        if arg_len > nbytes - HEADER_NBYTES:
            raise _fault(
                Fault.LENGTH_PAST_END,
                f"arg_len {arg_len} runs past the end of the buffer: only "
                f"{nbytes - HEADER_NBYTES} bytes follow the header",
            )
        spec = (REGISTRY if registry is None else registry).get(function_id)
        if spec is None:
            raise UnknownFunctionError(
                f"unknown function_id 0x{function_id:08X}: register the callee name "
                "(FNV-1a 32 of it) in the FunctionRegistry used to decode",
                fault=Fault.UNKNOWN_FUNCTION,
            )
        if arg_len < spec.min_payload_nbytes or (
            spec.max_payload_nbytes is not None and arg_len > spec.max_payload_nbytes
        ):
            bounds = (
                f"exactly {spec.min_payload_nbytes}"
                if spec.min_payload_nbytes == spec.max_payload_nbytes
                else f"between {spec.min_payload_nbytes} and {spec.max_payload_nbytes}"
            )
            raise _fault(
                Fault.PAYLOAD_SIZE,
                f"{spec.name} payload is {arg_len} bytes; it must be {bounds}",
            )
        payload = mv[HEADER_NBYTES : HEADER_NBYTES + arg_len]
        if spec.parse is not None:
            try:
                payload = spec.parse(payload)
            except FrameError:
                raise
            except (struct.error, ValueError, IndexError, TypeError, OverflowError) as exc:
                raise _fault(
                    Fault.PAYLOAD_INVALID, f"{spec.name} payload rejected by its parser: {exc}"
                ) from exc
    except FrameError as exc:
        exc.function_id, exc.request_id, exc.ptp_timestamp = function_id, request_id, ptp_timestamp
        raise
    return Request(spec.name, function_id, arg_len, request_id, ptp_timestamp, payload)


def decode_response(buf: Any) -> Response:
    """Validate and decode the response frame at the start of ``buf`` (zero-copy).

    >>> buf = bytearray(32)
    >>> n = encode_response_into(buf, status=Status.NOT_READY, request_id=5, ptp_timestamp=9)
    >>> decode_response(buf)
    Response(status=<Status.NOT_READY: 4>, result_len=0, request_id=5, ptp_timestamp=9, result=<memory at ...>)
    """
    mv = _byte_view(buf)
    nbytes = len(mv)
    if nbytes < HEADER_NBYTES:
        raise _fault(
            Fault.SHORT_BUFFER,
            f"a response needs at least {HEADER_NBYTES} header bytes, got {nbytes}",
        )
    magic, status, result_len, request_id, ptp_timestamp = _RESPONSE_HEADER.unpack_from(mv)
    if magic != RESPONSE_MAGIC:
        hint = " (this is a request frame: use decode_request)" if magic == REQUEST_MAGIC else ""
        raise FrameError(
            f"bad response magic 0x{magic:08X} ({_magic_text(magic)}); expected "
            f"0x{RESPONSE_MAGIC:08X} ('CUQS'){hint}",
            fault=Fault.BAD_MAGIC,
        )
    if result_len > nbytes - HEADER_NBYTES:
        raise FrameError(
            f"result_len {result_len} runs past the end of the buffer: only "
            f"{nbytes - HEADER_NBYTES} bytes follow the header",
            fault=Fault.LENGTH_PAST_END,
            request_id=request_id,
            ptp_timestamp=ptp_timestamp,
        )
    return Response(
        _STATUS_BY_VALUE.get(status, status),
        result_len,
        request_id,
        ptp_timestamp,
        mv[HEADER_NBYTES : HEADER_NBYTES + result_len],
    )


# ---------------------------------------------------------------------- encoders


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _room(mv: memoryview, offset: int, nbytes: int) -> None:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if offset + nbytes > len(mv):
        raise ValueError(
            f"buffer too small: the frame needs {nbytes} bytes at offset {offset}, "
            f"the buffer holds {len(mv)}"
        )


def _pack_request_header(
    mv: memoryview, offset: int, function_id: int, arg_len: int, request_id: int, ptp_timestamp: int
) -> None:
    _check_range("function_id", function_id, 0, _U32_MAX)
    _check_range("request_id", request_id, 0, _U32_MAX)
    _check_range("ptp_timestamp", ptp_timestamp, 0, _U64_MAX)
    _REQUEST_HEADER.pack_into(mv, offset, REQUEST_MAGIC, function_id, arg_len, request_id, ptp_timestamp)


def encode_request_header_into(
    buf: Any, *, function_id: int, arg_len: int, request_id: int, ptp_timestamp: int = 0, offset: int = 0
) -> int:
    """Write a 24-byte request header (the payload is the caller's to write after it).

    >>> buf = bytearray(24)
    >>> encode_request_header_into(buf, function_id=RESET_DECODER, arg_len=8, request_id=1)
    24
    >>> bytes(buf[:4])
    b'RQUC'
    """
    mv = _byte_view(buf)
    _room(mv, offset, HEADER_NBYTES)
    _check_range("arg_len", arg_len, 0, _U32_MAX)
    _pack_request_header(mv, offset, function_id, arg_len, request_id, ptp_timestamp)
    return HEADER_NBYTES


def encode_request_into(
    buf: Any, *, function_id: int, request_id: int, payload: Any = b"", ptp_timestamp: int = 0, offset: int = 0
) -> int:
    """Write a request with an opaque ``payload`` (any bytes-like); returns bytes written.

    >>> buf = bytearray(32)
    >>> encode_request_into(buf, function_id=function_id_for("ping"), request_id=2, payload=b"hi")
    26
    """
    mv = _byte_view(buf)
    body = _byte_view(payload)
    total = HEADER_NBYTES + len(body)
    _room(mv, offset, total)
    _pack_request_header(mv, offset, function_id, len(body), request_id, ptp_timestamp)
    mv[offset + HEADER_NBYTES : offset + total] = body
    return total


def encode_enqueue_syndromes_into(
    buf: Any,
    *,
    request_id: int,
    decoder_id: int,
    counter: int,
    syndrome_mapping_id: int,
    syndromes: Any = None,
    syndromes_bits_packed: Any = None,
    num_syndromes: int | None = None,
    ptp_timestamp: int = 0,
    offset: int = 0,
) -> int:
    """Write an ``enqueue_syndromes`` request; returns bytes written.

    Give either ``syndromes`` (one entry per bit, nonzero = 1; packed straight into
    the frame) or ``syndromes_bits_packed`` (already LSB-first packed, copied, the
    allocation-free path) with ``num_syndromes``.

    >>> buf = bytearray(64)
    >>> encode_enqueue_syndromes_into(buf, request_id=1, decoder_id=0, counter=4,
    ...     syndrome_mapping_id=0, syndromes_bits_packed=b"\\x05", num_syndromes=3)
    57
    >>> buf[56]
    5
    """
    mv = _byte_view(buf)
    if (syndromes is None) == (syndromes_bits_packed is None):
        raise ValueError("give exactly one of syndromes= or syndromes_bits_packed=")
    if syndromes is not None:
        bits = np.asarray(syndromes)
        if bits.ndim != 1:
            raise ValueError(f"syndromes must be a 1-D array of bits, got shape {bits.shape}")
        if num_syndromes is None:
            num_syndromes = bits.size
        elif num_syndromes != bits.size:
            raise ValueError(f"num_syndromes={num_syndromes} but {bits.size} syndrome bits given")
    elif num_syndromes is None:
        raise ValueError("syndromes_bits_packed= needs num_syndromes= (the number of bits)")
    _check_range("num_syndromes", num_syndromes, 1, MAX_SYNDROME_BITS)
    _check_range("decoder_id", decoder_id, 0, MAX_DECODERS - 1)
    _check_range("counter", counter, 0, _I64_MAX)
    _check_range("syndrome_mapping_id", syndrome_mapping_id, _I64_MIN, _I64_MAX)
    packed_nbytes = (num_syndromes + 7) >> 3
    arg_len = ENQUEUE_SYNDROMES_FIXED_NBYTES + packed_nbytes
    _room(mv, offset, HEADER_NBYTES + arg_len)
    start = offset + HEADER_NBYTES + ENQUEUE_SYNDROMES_FIXED_NBYTES
    if syndromes is not None:
        target = np.frombuffer(mv, dtype=np.uint8, count=packed_nbytes, offset=start)
        pack_bits(bits, out=target)
    else:
        packed = _byte_view(syndromes_bits_packed)
        if len(packed) != packed_nbytes:
            raise ValueError(
                f"syndromes_bits_packed holds {len(packed)} bytes; num_syndromes="
                f"{num_syndromes} needs exactly {packed_nbytes}"
            )
        mv[start : start + packed_nbytes] = packed
        pad_bits = num_syndromes & 7
        if pad_bits:
            mv[start + packed_nbytes - 1] &= (1 << pad_bits) - 1
    _pack_request_header(mv, offset, ENQUEUE_SYNDROMES, arg_len, request_id, ptp_timestamp)
    _ENQUEUE_FIXED.pack_into(
        mv, offset + HEADER_NBYTES, decoder_id, counter, syndrome_mapping_id, num_syndromes
    )
    return HEADER_NBYTES + arg_len


def encode_get_corrections_into(
    buf: Any,
    *,
    request_id: int,
    decoder_id: int,
    return_size: int,
    reset: bool = False,
    ptp_timestamp: int = 0,
    offset: int = 0,
) -> int:
    """Write a ``get_corrections`` request (41 bytes); ``return_size`` counts bits."""
    mv = _byte_view(buf)
    _room(mv, offset, HEADER_NBYTES + GET_CORRECTIONS_PAYLOAD_NBYTES)
    _check_range("decoder_id", decoder_id, 0, MAX_DECODERS - 1)
    _check_range("return_size", return_size, 0, MAX_CORRECTION_BITS)
    _pack_request_header(
        mv, offset, GET_CORRECTIONS, GET_CORRECTIONS_PAYLOAD_NBYTES, request_id, ptp_timestamp
    )
    _GET_CORRECTIONS.pack_into(mv, offset + HEADER_NBYTES, decoder_id, return_size, 1 if reset else 0)
    return HEADER_NBYTES + GET_CORRECTIONS_PAYLOAD_NBYTES


def encode_reset_decoder_into(
    buf: Any, *, request_id: int, decoder_id: int, ptp_timestamp: int = 0, offset: int = 0
) -> int:
    """Write a ``reset_decoder`` request (32 bytes)."""
    mv = _byte_view(buf)
    _room(mv, offset, HEADER_NBYTES + RESET_DECODER_PAYLOAD_NBYTES)
    _check_range("decoder_id", decoder_id, 0, MAX_DECODERS - 1)
    _pack_request_header(
        mv, offset, RESET_DECODER, RESET_DECODER_PAYLOAD_NBYTES, request_id, ptp_timestamp
    )
    _RESET_DECODER.pack_into(mv, offset + HEADER_NBYTES, decoder_id)
    return HEADER_NBYTES + RESET_DECODER_PAYLOAD_NBYTES


def encode_response_header_into(
    buf: Any, *, status: int, result_len: int, request_id: int, ptp_timestamp: int = 0, offset: int = 0
) -> int:
    """Write a 24-byte response header; write the result after it yourself (in place)."""
    mv = _byte_view(buf)
    _room(mv, offset, HEADER_NBYTES)
    _check_range("status", int(status), _I32_MIN, _I32_MAX)
    _check_range("result_len", result_len, 0, _U32_MAX)
    _check_range("request_id", request_id, 0, _U32_MAX)
    _check_range("ptp_timestamp", ptp_timestamp, 0, _U64_MAX)
    _RESPONSE_HEADER.pack_into(
        mv, offset, RESPONSE_MAGIC, int(status), result_len, request_id, ptp_timestamp
    )
    return HEADER_NBYTES


def encode_response_into(
    buf: Any, *, status: int, request_id: int, ptp_timestamp: int = 0, result: Any = b"", offset: int = 0
) -> int:
    """Write a response carrying ``result`` (any bytes-like); returns bytes written."""
    mv = _byte_view(buf)
    body = _byte_view(result)
    total = HEADER_NBYTES + len(body)
    _room(mv, offset, total)
    encode_response_header_into(
        mv, status=status, result_len=len(body), request_id=request_id,
        ptp_timestamp=ptp_timestamp, offset=offset,
    )
    mv[offset + HEADER_NBYTES : offset + total] = body
    return total


def encode_corrections_response_into(
    buf: Any,
    *,
    request_id: int,
    ptp_timestamp: int = 0,
    corrections: Any = None,
    corrections_bits_packed: Any = None,
    num_corrections: int | None = None,
    offset: int = 0,
) -> int:
    """Write the OK answer to ``get_corrections``: the bits packed LSB first.

    >>> buf = bytearray(32)
    >>> n = encode_corrections_response_into(buf, request_id=3, corrections=[0, 1, 1])
    >>> resp = decode_response(buf[:n])
    >>> resp.status, unpack_bits(resp.result, 3).tolist()
    (<Status.OK: 0>, [0, 1, 1])
    """
    mv = _byte_view(buf)
    if (corrections is None) == (corrections_bits_packed is None):
        raise ValueError("give exactly one of corrections= or corrections_bits_packed=")
    if corrections is not None:
        bits = np.asarray(corrections)
        if bits.ndim != 1:
            raise ValueError(f"corrections must be a 1-D array of bits, got shape {bits.shape}")
        num_corrections = bits.size
    elif num_corrections is None:
        raise ValueError("corrections_bits_packed= needs num_corrections= (the number of bits)")
    _check_range("num_corrections", num_corrections, 0, MAX_CORRECTION_BITS)
    packed_nbytes = (num_corrections + 7) >> 3
    _room(mv, offset, HEADER_NBYTES + packed_nbytes)
    start = offset + HEADER_NBYTES
    if corrections is not None:
        pack_bits(bits, out=np.frombuffer(mv, dtype=np.uint8, count=packed_nbytes, offset=start))
    else:
        packed = _byte_view(corrections_bits_packed)
        if len(packed) != packed_nbytes:
            raise ValueError(
                f"corrections_bits_packed holds {len(packed)} bytes; num_corrections="
                f"{num_corrections} needs exactly {packed_nbytes}"
            )
        mv[start : start + packed_nbytes] = packed
    encode_response_header_into(
        mv, status=Status.OK, result_len=packed_nbytes, request_id=request_id,
        ptp_timestamp=ptp_timestamp, offset=offset,
    )
    return HEADER_NBYTES + packed_nbytes


# ------------------------------------------------------------------------- bits


def pack_bits(bits: Any, *, out: np.ndarray | None = None) -> np.ndarray:
    """Pack a 1-D array of bits (nonzero = 1) into bytes, LSB first.

    ``out``, when given, must be a writable uint8 array of exactly ⌈n/8⌉ bytes; the
    pad bits of the last byte are written as 0.

    >>> pack_bits([1, 0, 1, 0, 0, 0, 0, 0, 1]).tolist()
    [5, 1]
    """
    arr = np.asarray(bits)
    if arr.ndim != 1:
        raise ValueError(f"bits must be 1-D, got shape {arr.shape}")
    packed = np.packbits(arr, bitorder="little")
    if out is None:
        return packed
    if out.dtype != np.uint8 or out.shape != packed.shape:
        raise ValueError(
            f"out must be a uint8 array of shape {packed.shape}, got {out.dtype} {out.shape}"
        )
    np.copyto(out, packed)
    return out


def unpack_bits(packed: Any, nbits: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """Unpack the first ``nbits`` LSB-first bits of ``packed`` into a uint8 array of 0/1.

    >>> unpack_bits(b"\\x05\\x01", 9).tolist()
    [1, 0, 1, 0, 0, 0, 0, 0, 1]
    """
    arr = np.frombuffer(packed, dtype=np.uint8) if not isinstance(packed, np.ndarray) else packed
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise ValueError(f"packed must be 1-D uint8 bytes, got {arr.dtype} with shape {arr.shape}")
    if not 0 <= nbits <= 8 * arr.size:
        raise ValueError(f"nbits must be in [0, {8 * arr.size}] for {arr.size} packed bytes, got {nbits}")
    bits = np.unpackbits(arr[: (nbits + 7) >> 3], count=nbits, bitorder="little")
    if out is None:
        return bits
    if out.dtype != np.uint8 or out.shape != (nbits,):
        raise ValueError(f"out must be a uint8 array of shape ({nbits},), got {out.dtype} {out.shape}")
    np.copyto(out, bits)
    return out

