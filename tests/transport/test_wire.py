"""The wire format shared by both halves of the TCP transport: framing and signatures."""

from __future__ import annotations

import struct

import pytest

from instride.errors import InstrideError, WireError
from instride.transport import wire


def test_signed_requests_verify_and_tampering_is_detected() -> None:
    req = wire.sign("tok", "fetch", "a/b")
    assert wire.verify("tok", req) is None
    assert wire.verify("other", req) == "bad mac (wrong token?)"
    assert wire.verify("tok", {**req, "key": "a/c"}) == "bad mac (wrong token?)"
    assert wire.verify(None, req) == "server has no job token configured"
    assert wire.verify("tok", {**req, "ts": req["ts"] - 2 * wire.MAX_SKEW}) is not None


def test_framing_round_trip_and_bounds() -> None:
    packed = wire.pack({"ok": True, "size": 3})
    n = wire.parse_length(packed[:4])
    assert wire.parse_header(packed[4 : 4 + n]) == {"ok": True, "size": 3}
    with pytest.raises(WireError):
        wire.parse_length(struct.pack(">I", wire.MAX_HEADER + 1))
    with pytest.raises(WireError):
        wire.parse_length(struct.pack(">I", 0))
    with pytest.raises(WireError):
        wire.pack({"pad": "x" * wire.MAX_HEADER})
    with pytest.raises(WireError):
        wire.parse_header(b"[1]")


def test_wire_errors_are_instride_errors() -> None:
    assert issubclass(WireError, InstrideError) and issubclass(WireError, ValueError)
    assert wire.WireError is WireError


def test_a_header_in_utf16_is_refused_before_its_depth_can_hide() -> None:
    """``json.loads(bytes)`` also decodes UTF-16 and UTF-32, whose bytes the depth scan
    misread (a quote byte inside a character: every bracket after it looked quoted): a deeply
    nested header of an unauthenticated peer reached the recursive parser. Headers are UTF-8."""
    body = ('["\u0122",' + "[" * 3000 + "]" * 3000 + "]").encode("utf-16-be")
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.parse_header(body)
    assert wire.parse_header('{"k": "\u0122"}'.encode()) == {"k": "\u0122"}
