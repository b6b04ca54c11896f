"""Wire format shared by the data server and its clients.

Every message starts with a 4-byte big-endian length and a JSON header of that length; a
successful fetch reply is followed by exactly ``size`` raw bytes. Requests carry an HMAC-SHA256
over their canonical fields, keyed by the job token (``INSTRIDE_TOKEN``), and a timestamp
that must be within :data:`MAX_SKEW` seconds of the server's clock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import struct
import time
from typing import Any

from ..errors import WireError

LENGTH = struct.Struct(">I")
#: Largest header accepted, request or reply.
MAX_HEADER = 16 * 1024
#: Largest clock difference accepted between a request's timestamp and the server.
MAX_SKEW = 300.0
PROTOCOL = 1
_MAC = re.compile(r"[0-9a-f]{64}")


#: Longest a fetch may ask the server to wait for its key to be published (milliseconds).
MAX_WAIT_MS = 60_000
#: Most keys one request may ask for (``count``; the C server's ISS_MAX_COUNT).
MAX_COUNT = 64


def _canonical(op: str, key: str, nonce: str, ts: float, wait: int | None = None,
               until: str | None = None, count: int | None = None) -> bytes:
    text = f"instride/{PROTOCOL}\n{op}\n{key}\n{nonce}\n{ts:.6f}"
    if wait is not None:
        text += f"\nwait={wait}"
    if until is not None:
        text += f"\nuntil={until}"
    if count is not None:
        text += f"\ncount={count}"
    return text.encode()


def sign(token: str, op: str, key: str, wait: int | None = None,
         until: str | None = None, count: int | None = None) -> dict[str, Any]:
    """Build a signed request header for ``op`` on ``key``.

    ``wait`` (milliseconds, a fetch only): the server holds the request up to that long for
    a key not published yet; ``until``: a name in the key's directory (a stream's end marker)
    whose presence ends that wait; ``count`` (2 to :data:`MAX_COUNT`, with a wait): the
    server also sends the numbered keys after ``key`` (a stream's next frames), each as it
    is published and with its own reply, until one is not published in time. All are
    signed with the rest.
    """
    nonce = secrets.token_hex(8)
    ts = round(time.time(), 6)
    canonical = _canonical(op, key, nonce, ts, wait, until, count)
    mac = hmac.new(token.encode(), canonical, hashlib.sha256).hexdigest()
    header = {"v": PROTOCOL, "op": op, "key": key, "nonce": nonce, "ts": ts, "mac": mac}
    if wait is not None:
        header["wait"] = wait
    if until is not None:
        header["until"] = until
    if count is not None:
        header["count"] = count
    return header


def verify(token: str | None, req: dict[str, Any], *, window: bool = True) -> str | None:
    """Return ``None`` when ``req`` is authentic, else the reason it is not.

    ``op``, ``key`` and ``nonce`` must be strings, ``ts`` a finite number and ``mac`` 64
    lowercase hex digits; anything else is refused before the MAC is computed. ``window``:
    also refuse a timestamp more than :data:`MAX_SKEW` s off (not for a request verified
    when it arrived, then held while it waited for its key: the clock has moved since).
    """
    if not token:
        return "server has no job token configured"
    mac = req.get("mac")
    if not isinstance(mac, str) or not mac:
        return "missing mac"
    if _MAC.fullmatch(mac) is None:
        return "malformed mac (64 lowercase hex digits expected)"
    op, key, nonce, ts = req.get("op"), req.get("key"), req.get("nonce"), req.get("ts")
    if not (isinstance(op, str) and isinstance(key, str) and isinstance(nonce, str)):
        return "missing or malformed fields (op, key, nonce must be strings)"
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "missing or malformed fields (ts must be a number)"
    try:
        ts = float(ts)
    except OverflowError:
        return "timestamp out of range"
    if not math.isfinite(ts):
        return "timestamp is not finite"
    wait = req.get("wait")
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int)
                             or not 0 <= wait <= MAX_WAIT_MS):
        return f"malformed wait (whole milliseconds, 0 to {MAX_WAIT_MS})"
    until = req.get("until")
    if until is not None and not isinstance(until, str):
        return "malformed until (a name expected)"
    count = req.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int)
                              or not 2 <= count <= MAX_COUNT or wait is None):
        return f"malformed count (2 to {MAX_COUNT} keys, with a wait)"
    try:
        canonical = _canonical(op, key, nonce, ts, wait, until, count)
    except UnicodeEncodeError:  # lone surrogates from \ud800-style JSON escapes
        return "fields are not valid Unicode"
    expected = hmac.new(token.encode(), canonical, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, mac):
        return "bad mac (wrong token?)"
    if window and abs(time.time() - ts) > MAX_SKEW:
        return "timestamp outside the accepted window"
    return None


def pack(header: dict[str, Any]) -> bytes:
    """Serialize a header with its length prefix."""
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER:
        raise WireError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    return LENGTH.pack(len(body)) + body


def parse_length(prefix: bytes) -> int:
    """Parse a length prefix, refusing oversized headers."""
    (n,) = LENGTH.unpack(prefix)
    if n == 0 or n > MAX_HEADER:
        raise WireError(f"header length {n} out of range (1..{MAX_HEADER})")
    return n


#: The deepest nesting of arrays and objects a header may have (headers are flat objects)
MAX_DEPTH = 16
#: Headers with up to this many brackets are not scanned for their depth (it cannot pass it)
_BRACKETS_LOOKED_AT = MAX_DEPTH


def _depth(body: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in ``body`` (brackets within strings
    not counted; ill-formed JSON is left to the parser)."""
    depth = most = 0
    quoted = escaped = False
    for c in body:
        if quoted:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # '"'
                quoted = False
        elif c == 0x22:
            quoted = True
        elif c in (0x5B, 0x7B):  # '[', '{'
            depth += 1
            most = max(most, depth)
        elif c in (0x5D, 0x7D):  # ']', '}'
            depth -= 1
    return most


def parse_header(body: bytes) -> dict[str, Any]:
    """Parse a JSON header, refusing anything but an object.

    Every way the bytes can be wrong (not UTF-8, not JSON, nested too deeply, an integer of
    too many digits...) is a :class:`WireError`.
    """
    if body.count(b"[") + body.count(b"{") > _BRACKETS_LOOKED_AT and _depth(body) > MAX_DEPTH:
        # (refused before the parser: it recurses once per level, and a server's connection
        # thread, with a small stack, would overflow it long before Python's recursion
        # limit: one request of an unauthenticated peer would kill the data server)
        raise WireError(f"header is nested more than {MAX_DEPTH} levels deep")
    try:
        # (decoded as UTF-8 first: json.loads(bytes) also takes UTF-16 and UTF-32, whose
        # bytes the depth scan above misreads — a quote byte inside a character, and every
        # bracket after it looked quoted while the parser recursed on them)
        obj = json.loads(body.decode("utf-8"))
    except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise WireError(f"header is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise WireError("header is not a JSON object")
    return obj
