"""Cluster-mode metadata in Redis.

Layout (all names under the ``instride:`` prefix):

* ``instride:rec:<key>`` — a hash per published key: owner, node, size, checksum, version, time;
* ``instride:keys`` — a sorted set of all keys (score 0), listed by prefix with ZRANGEBYLEX;
* ``instride:pub:<key>`` — the channel a publication is announced on;
* ``instride:was:<publication id>`` — for a while, the version of a publication whose
  record a later one of its key overwrote (a retry of it after a lost reply finds it done);
  ``instride:was:del:<id>`` the same for a delete (its retry forgets nothing stored since);
* ``instride:clock`` — the one counter every publication's version is drawn from: a key's
  later publication always has a higher version, also after the key was deleted, and
  nothing is kept of a key once it is forgotten (a bounded stream retires a frame per frame).

A publication is one Lua script (one round trip, atomic): it bumps the version, writes the
hash, indexes the key and publishes the notification, which carries the record itself (a
woken waiter needs no second round trip). A waiter subscribes to the key's channel *before*
checking whether the record exists, so no publication can fall between the check and the
wait. Connection errors are retried with backoff until the caller's deadline,
so waiters survive a Redis restart.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import functools
import itertools
import json
import math
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from ..config import Settings
from ..errors import (
    AuthenticationError,
    ConfigError,
    ConsumeTimeout,
    InstrideError,
    KeyExistsError,
    MetadataUnavailable,
    PublicationUnsettled,
    redact_url,
)
from ..perthread import PerThread, forks, pid
from ..record import Record
from . import resp
from .base import PendingRecord
from .resp import UNAVAILABLE, RespConnection, hash_fields

PREFIX = "instride:"
_REC = PREFIX + "rec:"
_KEYS = PREFIX + "keys"
_CHAN = PREFIX + "pub:"
#: the counter of publications, every key's versions are drawn from
_CLOCK = PREFIX + "clock"
#: the version counter per key of instride before the clock (read, so versions never go back)
_LEGACY_VER = PREFIX + "ver:"
#: ``instride:was:<publication id>``: the version of a publication whose record another
#: publication of its key overwrote, or a delete forgot, kept :data:`_WAS_TTL_S` seconds for a
#: retry of it
_WAS = PREFIX + "was:"
#: seconds after its first send within which a retry of a publication whose reply was lost is
#: sure to find its mark, were it overwritten or deleted since (``instride:was:<id>``; Redis
#: holds one per overwrite of a key for that long, two per delete, the delete's own mark
#: included: ~1 MB at 10 per second). A later
#: retry that finds neither its record nor its mark is :class:`PublicationUnsettled` (the
#: script cannot tell a publication that never arrived from one whose mark expired)
_RETRY_WITHIN_S = 600.0
_WAS_TTL_S = int(_RETRY_WITHIN_S) + 60
#: the publish script's answer to such a late retry
_LATE = -2

#: the publication itself, as a function of the script's KEYS and ARGV (see _PUBLISH): KEYS =
#: the record, the keys index, the channel, the clock, the legacy counter, then a retry's marks
#: (was:<id>, late); ARGV = owner, size, checksum, time, node, key, overwrite, publication id,
#: the announcement's tail, then the follow-up commands and the hash to read back
_PUBLISH_BODY = """
local function publish(KEYS, ARGV)
local rec = KEYS[1]
-- a retry of this very publication (ARGV[8], its id), whose reply was lost with the
-- connection after Redis had stored it: done already, the same version (never a second one,
-- nor "exists" for a write-once key)
local had = redis.call('HMGET', rec, 'pub', 'version')
if had[1] == ARGV[8] and had[2] then
  return tonumber(had[2])
end
-- a retry (only a retry names KEYS[6], instride:was:<its id>) of a publication stored and
-- then overwritten by another's, before the retry came: done already, its version kept
-- there (stored again, it would put the older record over the newer one)
if KEYS[6] then
  local was = redis.call('GET', KEYS[6])
  if was then
    return tonumber(was)
  end
end
-- a retry later than the marks live (KEYS[7] named, whatever its name), neither its record
-- nor its mark there: stored and overwritten, or never stored, cannot be told -- unsettled
if KEYS[7] then
  return @LATE@
end
-- (a record always has its version: none means no record; each redis.call costs a woken
-- Redis ~10 µs, the command itself ~1)
if ARGV[7] == '0' and had[2] then
  return -1
end
-- overwriting another publication's record: its id and version are kept a while (see
-- _RETRY_WITHIN_S), for a retry of it whose reply was lost (only when a key is published
-- again: a stream's frames, each a key of its own, never pay this)
if had[1] and had[2] then
  redis.call('SET', '@WAS@' .. had[1], had[2], 'EX', @WAS_TTL@)
end
-- the next of one counter for all keys: a key's later publication always has a higher
-- version, also after the key was deleted (a node's cached copy of an earlier one is never
-- mistaken for it), and no counter per key outlives its record (a bounded stream retires a
-- frame per frame: counters kept per key would grow Redis by one key per frame, forever)
local version = redis.call('INCR', KEYS[4])
-- never at or below what the key had: its record's version, or the counter per key that an
-- earlier instride kept (instride:ver:<key>, read once: the clock is past it after this, so
-- the leftover goes in the same call), so that a copy cached before an upgrade is never
-- taken for a later publication
local floor = math.max(tonumber(had[2]) or 0, tonumber(redis.call('GETDEL', KEYS[5])) or 0)
if version <= floor then
  version = floor + 1
  redis.call('SET', KEYS[4], version)
end
redis.call('HSET', rec, 'version', version, 'owner', ARGV[1], 'size', ARGV[2],
           'checksum', ARGV[3], 'time', ARGV[4], 'node', ARGV[5], 'key', ARGV[6],
           'pub', ARGV[8])
redis.call('ZADD', KEYS[2], 0, ARGV[6])
-- the notification carries the record, so a woken waiter needs no second round trip: its
-- fields joined by NUL (no key, node or address holds one), the key last (see _from_message);
-- the caller joined all but the version (ARGV[9]: one concatenation here, ~10 µs less of a
-- woken Redis than joining them); the version as an integer (a number's default form turns
-- to 1e+14 from there on)
redis.call('PUBLISH', KEYS[3], string.format('%d', version) .. ARGV[9])
-- then the caller's follow-up commands, in the same step (a stream's head counters, its
-- retired frames' records): ARGV[10] commands, each as its length and its words
local at = 11
for _ = 1, tonumber(ARGV[10] or '0') do
  local n = tonumber(ARGV[at])
  redis.call(unpack(ARGV, at + 1, at + n))
  at = at + n + 1
end
-- and, where the caller asks, a hash read in the same step (a stream's group cursors, which
-- its producer then needs to read on its own no more)
if ARGV[at] then
  return {version, redis.call('HGETALL', ARGV[at])}
end
return version
end
""".replace("@WAS@", _WAS).replace("@WAS_TTL@", str(_WAS_TTL_S)).replace("@LATE@", str(_LATE))
_PUBLISH = _PUBLISH_BODY + "return publish(KEYS, ARGV)\n"
#: where a stream's head counters and its groups' cursors are kept (instride.store.streamstate)
_STREAM = PREFIX + "stream:"
#: A stream frame's publication in a third of the bytes (:func:`_frame_words`): the names the
#: publication derives from its key, its announcement's tail and its follow-up commands (the
#: stream's head counters, the retired frames' records forgotten, the groups' cursors read
#: back) are made here from the words they are made of. KEYS = a retry's marks alone; ARGV =
#: key, owner, size, checksum, time, node, overwrite, publication id, the stream (empty: no
#: head), oldest, written, "1" to read the groups' cursors back, the retired frames' keys.
#: Several such records fit one TCP segment (~1,448 bytes on a 1,500-byte MTU): held back
#: together (``hold``), they wake Redis once; the long form fits one.
_PUBLISH_FRAME = _PUBLISH_BODY + """
local key, stream = ARGV[1], ARGV[9]
local K = {'@REC@' .. key, '@KEYS@', '@CHAN@' .. key, '@CLOCK@', '@VER@' .. key, KEYS[1], KEYS[2]}
local A = {ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], key, ARGV[7], ARGV[8],
           '\\0' .. ARGV[3] .. '\\0' .. ARGV[5] .. '\\0' .. ARGV[2] .. '\\0' .. ARGV[6] .. '\\0' ..
           ARGV[4] .. '\\0' .. key, 0}
local at, n = 11, 0
if stream ~= '' then
  A[at], A[at + 1], A[at + 2], A[at + 3] = 6, 'HSET', '@STREAM@' .. stream .. ':head', 'oldest'
  A[at + 4], A[at + 5], A[at + 6] = ARGV[10], 'written', ARGV[11]
  at, n = at + 7, 1
end
for i = 13, #ARGV do
  A[at], A[at + 1], A[at + 2] = 2, 'DEL', '@REC@' .. ARGV[i]
  A[at + 3], A[at + 4], A[at + 5], A[at + 6] = 3, 'ZREM', '@KEYS@', ARGV[i]
  at, n = at + 7, n + 2
end
A[10] = n
if ARGV[12] == '1' then
  A[at] = '@STREAM@' .. stream .. ':groups'
end
return publish(K, A)
""".replace("@REC@", _REC).replace("@KEYS@", _KEYS).replace("@CHAN@", _CHAN) \
    .replace("@CLOCK@", _CLOCK).replace("@VER@", _LEGACY_VER).replace("@STREAM@", _STREAM)

#: sent just ahead of a publication, in the same write: Redis writes what it owes its clients
#: after it has run everything a read brought, the client that got something to send last
#: first. Answered first, this makes the publisher's client the earlier one, so the
#: announcement goes out to the waiters before the publisher's own answer (a bare PUBLISH ->
#: subscriber between emulated nodes: 151 -> 116 µs, lower in 9 of 10 alternating rounds).
#: Packed once (RespConnection.send).
_AHEAD = hiredis.pack_command(("PING",))
#: forget a key's record (KEYS: the record, the keys index) only while it is the one a caller
#: looked up (ARGV: its version, its owner, the key): a publication stored since stays
_DELETE_IF = """
local had = redis.call('HMGET', KEYS[1], 'version', 'owner', 'pub')
if had[1] ~= ARGV[1] or had[2] ~= ARGV[2] then return 0 end
-- (forgotten first: Redis full, OOM, refuses writes that take memory, not these; the marks
-- after it where Redis takes them)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
if had[3] then  -- (its publication's mark: a retry of it after a lost reply is done already)
  redis.pcall('SET', '@WAS@' .. had[3], had[1], 'EX', @WAS_TTL@)
end
return 1
""".replace("@WAS@", _WAS).replace("@WAS_TTL@", str(_WAS_TTL_S))
#: forget a key's record (see RedisMetadata.delete), leaving its publication's mark
_DELETE = """
-- a retry of this very delete (KEYS[3], its mark), its reply lost after Redis ran it: done
-- already (run again, it would forget a publication of the key stored since)
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then
  return 1
end
local had = redis.call('HMGET', KEYS[1], 'version', 'pub')
-- (forgotten first: Redis full, OOM, refuses writes that take memory, not these -- the one
-- command that frees memory must not be refused for want of it; the marks after it, where
-- Redis takes them)
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if had[1] and had[2] then
  redis.pcall('SET', '@WAS@' .. had[2], had[1], 'EX', @WAS_TTL@)
end
if KEYS[3] then
  redis.pcall('SET', KEYS[3], 1, 'EX', @WAS_TTL@)
end
return 1
""".replace("@WAS@", _WAS).replace("@WAS_TTL@", str(_WAS_TTL_S))

#: what makes a publication's id unique: this run of the program, the process, then a count
_RUN = secrets.token_hex(6)
_COUNT = itertools.count()


def _new_run() -> None:
    """In a forked child: a run of its own (its count goes on from the parent's, and a later
    child given the same process id would draw the same ids: a publication of its would be
    taken for a retry of another's, and nothing stored)."""
    global _RUN
    _RUN = secrets.token_hex(6)


os.register_at_fork(after_in_child=_new_run)


def _publication_id() -> str:
    """An id no other publication has (the process id: a forked child counts on alone)."""
    return f"{_RUN}.{pid()}.{next(_COUNT)}"  # (the kept id: no system call per record)


#: a publication's script words: its keys, its arguments, and whether they are the short form
#: (:data:`_PUBLISH_FRAME`) or the long one (:data:`_PUBLISH`)
_Sent = tuple[list[str], list[Any], bool]


class _FrameSteps(list):  # type: ignore[type-arg]
    """A stream frame's follow-up commands (:meth:`RedisMetadata.frame_steps`: its stream's
    head counters, the retired frames' records forgotten), with the words its short form
    says them in (``words``: the stream, oldest, written, the retired frames' keys) and the
    hash of its groups' cursors that form can read back (``groups``)."""

    __slots__ = ("groups", "words")

    words: list[Any]
    groups: str


def _frame_words(then: Sequence[tuple[Any, ...]], report: str | None) -> list[Any] | None:
    """The last words of a publication's short form (:data:`_PUBLISH_FRAME`): the stream, its
    oldest and written counters, whether its groups' cursors are read back, the retired
    frames' keys — for a publication without follow-up commands, or with a stream frame's
    (:meth:`RedisMetadata.frame_steps`, which the script makes again word for word) reading
    back nothing or that stream's groups. ``None`` for anything else: the long form says it."""
    if not then:
        return None if report is not None else ["", "", "", "0"]
    if then.__class__ is not _FrameSteps or report is not None and report != then.groups:
        return None
    stream, oldest, written, *retired = then.words
    if len(then) != 1 + 2 * len(retired):  # (commands added to it since: the long form)
        return None
    return [stream, oldest, written, "0" if report is None else "1", *retired]


_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
#: Redis's error replies, as redis-py raises them and as the lean connections return or raise
#: them (:mod:`.resp`): an answer, not a lost connection, so never retried. (redis-py's
#: ``AuthenticationError`` is one of its ``ConnectionError``: caught before ``_ERRORS``.)
_REPLIES = (redis.ResponseError, redis.AuthenticationError, redis.exceptions.AuthorizationError,
            hiredis.ReplyError)
#: how Redis's replies that refuse a client for want of credentials or rights begin (as the
#: lean connections see them: redis-py takes the first word off, and raises its own classes)
#: Redis's answers that mean "not now" (loading its data, a script running, no master, a
#: slot moving; READONLY: a replica after a failover's switch): tried again, as unavailability
_NOT_NOW = (*UNAVAILABLE, "READONLY")
_AUTH_REPLIES = ("NOAUTH", "WRONGPASS", "NOPERM", "ERR Protocol error: unauthenticated",
                 "ERR AUTH", "ERR Client sent AUTH")


def _refusal(url: str, what: str, exc: BaseException) -> InstrideError:
    """The typed error for Redis's error reply ``exc`` to ``what``: refused credentials or
    rights (no password, a wrong one, an ACL) are an :class:`AuthenticationError` naming the
    URL without its password; any other reply (``OOM`` when ``maxmemory`` is reached, a
    read-only replica, a script error) a :class:`MetadataUnavailable` carrying Redis's message
    (``refused``: the reply's text; ``errno`` ``ENOSPC`` for ``OOM``)."""
    reply = str(exc)
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError,
                        redis.exceptions.NoPermissionError)) or reply.startswith(_AUTH_REPLIES):
        return AuthenticationError(
            f"Redis at {redact_url(url)} refused {what}: {reply} (the user and password in "
            "INSTRIDE_REDIS_URL, or the rights Redis's ACL gives that user)")
    full = isinstance(exc, redis.exceptions.OutOfMemoryError) or reply.startswith("OOM")
    if full and not reply.startswith("OOM"):
        reply = f"OOM {reply}"  # (the word redis-py took off: what Redis's docs call it)
    err = MetadataUnavailable(url, f"{what}: Redis refused it: {reply}")
    err.refused = reply  # (see _is_refusal)
    if full:  # (Redis is full: maxmemory reached, with noeviction)
        err.errno = errno.ENOSPC  # (what the agent answers a thin client)
        OSError.__dict__["errno"].__set__(err, errno.ENOSPC)  # (and what str() shows)
    return err


def _again(exc: InstrideError) -> InstrideError:
    """A new exception like ``exc`` (its type, message and attributes), without its traceback
    — raised again, ``exc`` itself would keep each raise's traceback, and with it the frames
    that hold it, alive: what :func:`_refusal` set on it as an ``OSError`` (``errno``) too."""
    err = copy.copy(exc)
    if isinstance(exc, OSError):
        OSError.__dict__["errno"].__set__(err, OSError.__dict__["errno"].__get__(exc))
    return err


def _is_refusal(exc: MetadataUnavailable) -> bool:
    """Whether ``exc`` is Redis's answer (:func:`_refusal`), not Redis out of reach: a wait
    ends with it, as waiting on would only be refused again."""
    return getattr(exc, "refused", None) is not None
#: seconds an attempt to reach Redis is given at least, whatever the caller's deadline
_ATTEMPT_MIN = 0.1
#: a wait's first pause before it subscribes again after Redis was out of reach (or answered
#: ``LOADING``), doubled after each attempt that fails in turn, up to the last: a Redis busy
#: loading its data is not asked by each waiting thread twenty times a second
_REWAIT_FIRST, _REWAIT_MAX = 0.05, 1.0


def _rewait(pause: float, deadline: float | None) -> float:
    """Sleep ``pause`` seconds (at most until ``deadline``); the next pause."""
    left = math.inf if deadline is None else deadline - time.monotonic()
    time.sleep(max(0.0, min(pause, left)))
    return min(pause * 2, _REWAIT_MAX)


def _record(fields: dict[bytes, bytes]) -> Record | None:
    if not fields or b"version" not in fields:
        return None
    f = {k.decode(): v.decode() for k, v in fields.items()}
    return Record(
        key=f["key"],
        owner=f["owner"],
        size=int(f["size"]),
        checksum=f["checksum"] or None,
        version=int(f["version"]),
        time=float(f["time"]),
        node=f.get("node", ""),
    )


def _from_message(data: Any) -> Record | None:
    """The record carried by a publication message (``None`` if it is not one).

    The publish script joins the record's fields with NUL: version, size, time, owner, node,
    checksum, key (last: split at most six times). A woken waiter parses it first thing after
    its wake-up, when its CPU's caches are cold; a JSON object (as an earlier instride
    announced, still understood) took about twice as long to parse then (~23 against ~13 µs
    on the development VM)."""
    try:
        if data[:1] == b"{":
            f = json.loads(data)
            return Record(key=str(f["key"]), owner=str(f["owner"]), size=int(f["size"]),
                          checksum=f["checksum"] or None, version=int(f["version"]),
                          time=float(f["time"]), node=str(f.get("node", "")))
        version, size, when, owner, node, checksum, key = data.decode().split("\0", 6)
        return Record(key, owner, int(size), checksum or None, int(version), float(when), node)
    except (TypeError, ValueError, KeyError, AttributeError):
        return None


#: directories whose publications a thread's subscriber keeps watching between waits
_WATCH_MAX = 8
#: announcements of keys not asked for yet a thread keeps (a reader behind its producer
#: reads the announcements of the frames ahead together with the one it asked for)
_HEARD_MAX = 256
#: seconds after dropping a kept announcement during which :meth:`RedisMetadata.announced`
#: does not wait for one (it may have been among those dropped: a reader far behind)
_HEARD_OVERFLOW_S = 5.0


def _common_dir(keys: Sequence[str]) -> str:
    """The directory (``"a/b/"``) holding every one of ``keys``, or ``""`` (top level)."""
    first = keys[0].rpartition("/")[0]
    if not first:
        return ""
    prefix = first + "/"
    for key in keys[1:]:
        while not key.startswith(prefix):
            first = first.rpartition("/")[0]
            if not first:
                return ""
            prefix = first + "/"
    return prefix


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@functools.lru_cache(maxsize=256)
def _pattern(prefix: str) -> str:
    """The channel pattern of the publications under the directory ``prefix`` (computed once
    per directory: a stream's reader asks for it several times per frame)."""
    return _CHAN + _glob_escape(prefix) + "*"


def _announced(msg: Any) -> Record | None:
    """The record a pattern message announces (``None`` for anything else)."""
    if not isinstance(msg, list) or len(msg) < 4 or msg[0] != b"pmessage":
        return None
    return _from_message(msg[3])


class _PatternsRefused(Exception):
    """Redis refused a pattern subscription (an ACL that allows channels, not patterns)."""


class _SoonRecord(PendingRecord):
    """A publication sent by :meth:`RedisMetadata.publish_soon`, its answer read when called.

    A class rather than closures: a closure that confirms would refer to its own pending
    record, a reference cycle per frame that only the cyclic garbage collector frees (~22
    objects per frame of a stream, and every few hundred frames a full collection of the
    producer's whole heap, simulation included).
    """

    def __init__(self, metadata: RedisMetadata, record: Record,
                 sent: _Sent,
                 replies: Callable[[], list[Any]] | None, fast: RespConnection) -> None:
        # (not PendingRecord's callables: bound methods of this object would be the cycle)
        self.reported: dict[bytes, bytes] | None = None
        self.held = replies is not None and fast.held_last
        self._metadata, self._record, self._sent = metadata, record, sent
        self._replies: Callable[[], list[Any]] | None = replies
        self._fast = fast
        self._sender = (threading.get_ident(), forks())
        self._at = time.monotonic()  # (sent then: a retry comes within _RETRY_WITHIN_S)
        #: whether it may have been stored (sent, or a settlement of it went out)
        self._went = replies is not None
        self._done: Record | None = None
        #: an error answer's text, raised every time (a new exception each time: one raised
        #: again would keep each raise's traceback, and with it this object, in a cycle)
        self._refused: str | None = None
        #: the same for an answer refused where it went again (after ``NOSCRIPT``): a copy,
        #: without a traceback, of what was raised
        self._refused_error: InstrideError | None = None

    def answered(self) -> bool:
        return self._done is not None or self._replies is None or self._fast.answered()

    def push(self) -> None:
        """Push the record out if its connection holds it back (from any thread)."""
        if self._replies is not None and self._sender[1] == forks():
            self._fast.push()

    def __call__(self) -> Record:
        if self._done is not None:
            return self._done
        reply: Any = None
        if self._replies is not None and self._sender == (threading.get_ident(), forks()):
            try:
                _pong, reply = self._replies()  # (see _AHEAD)
            except _ERRORS:
                reply = None
        elif self._replies is not None:  # (the sender's answer is not read here: the record
            self.push()  # goes again, after the original, which must not come after it)
        self._replies = None
        if isinstance(reply, Exception) and not str(reply).startswith("NOSCRIPT"):
            self._refused = str(reply)
        if self._refused is not None:  # (as publish raises it)
            raise _refusal(self._metadata.url, "publish", redis.ResponseError(self._refused))
        if self._refused_error is not None:
            raise _again(self._refused_error)
        # NOSCRIPT (Redis restarted), a lost reply: again, as the same publication -- a
        # retry where it may have been stored (not one NOSCRIPT answered: it did not run)
        metadata = self._metadata
        if reply is None or isinstance(reply, Exception):
            retry = self._went and reply is None
            # (what goes now may be stored, whatever ends this call: an error answer to a
            # retry after it, an interrupt right after its write -- the next is a retry)
            self._went = True
            try:
                stored = metadata._publish_now(self._record, self._sent, self,
                                               self._at if retry else None)
            except (MetadataUnavailable, AuthenticationError) as exc:
                if not isinstance(exc, PublicationUnsettled):
                    # (not a retry -- NOSCRIPT answered, so it did not run -- and nothing
                    # of this call may be stored, _publish_now says: not stored, on the
                    # next call either)
                    self._went = False
                    if getattr(exc, "script_answered", False):
                        # Redis's answer to the script (a follow-up command refused after
                        # the record was stored, WRONGTYPE; OOM; NOPERM): raised every
                        # time, as the answer to its first send is -- sent again, it would
                        # be taken for a retry of a publication done, and answered stored.
                        # (A refused login or SELECT is not: the next call tries again.)
                        self._refused_error = _again(exc)
                raise
        else:
            stored = metadata._stored(self._record, reply, self)
        self._done = stored
        return stored


class _Liveness:
    """The liveness check of a waiting redis-py subscriber (``unix://`` and TLS URLs), as a
    lean one's (:meth:`RespConnection._probe`).

    After :data:`~instride.metadata.resp.PROBE_AFTER` seconds without a word on the
    connection it is asked a ``PING``; when that goes unanswered
    :data:`~instride.metadata.resp.PROBE_WAIT` seconds, it is taken for lost. A connection
    whose far end went without a word (the Redis host crashed, was cut off, or hangs) would
    otherwise be waited on until the caller's timeout, for ever without one, its
    subscriptions long gone. (redis-py's own ``health_check_interval`` sends a ``PING`` but
    never misses its answer.)

    Parameters
    ----------
    ps
        The subscriber (a :class:`redis.client.PubSub`, subscribed).
    """

    def __init__(self, ps: Any) -> None:
        self.ps = ps
        self.heard = time.monotonic()
        self.probed: float | None = None  # (when a PING went out unanswered so far)

    def message(self, timeout: float) -> dict[str, Any] | None:
        """The next message of the subscriber, or ``None`` if none came within ``timeout``
        seconds (or by the time a check was due).

        Raises
        ------
        ConnectionError
            The ``PING`` went unanswered: the connection is lost (the caller drops it).
        """
        due = self.heard + resp.PROBE_AFTER if self.probed is None \
            else self.probed + resp.PROBE_WAIT
        msg = self.ps.get_message(timeout=max(0.0, min(timeout, due - time.monotonic())))
        now = time.monotonic()
        if msg is not None:
            self.heard, self.probed = now, None
        elif self.probed is None:
            if now - self.heard >= resp.PROBE_AFTER:
                self.ps.ping()  # (its answer, a "pong" of no data, is skipped by the waits)
                self.probed = now
        elif now - self.probed >= resp.PROBE_WAIT:
            raise ConnectionError(f"Redis did not answer a PING within {resp.PROBE_WAIT:g} s: "
                                  "the connection is lost")
        return msg


#: every backend of this process (a forked child closes its copies of their subscribers)
_backends: weakref.WeakSet[RedisMetadata] = weakref.WeakSet()


def _close_inherited_subscribers() -> None:
    """In a child made by ``fork``: close this process's descriptors of the parent's redis-py
    subscriber connections (redis-py's ``disconnect`` only closes them in a process other
    than the one that connected: the parent's stay up). A descriptor kept open would hold
    their subscriptions in Redis for as long as the child lives. (The lean connections:
    :mod:`.resp`.)"""
    for backend in list(_backends):
        for ps in list(backend._pubsubs):
            with contextlib.suppress(Exception):
                if ps.connection is not None:
                    ps.connection.disconnect()
        backend._pubsubs.clear()


os.register_at_fork(after_in_child=_close_inherited_subscribers)


class RedisMetadata:
    """Metadata backend on a Redis server (``INSTRIDE_REDIS_URL``)."""

    name = "redis"

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url:
            raise MetadataUnavailable("(unset)", "INSTRIDE_REDIS_URL is not set")
        self.url = settings.redis_url
        self.settings = settings
        self.redis = redis.Redis.from_url(
            self.url,
            socket_connect_timeout=settings.connect_timeout,
            socket_timeout=max(settings.connect_timeout, 5.0),
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.01), 3),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=0,
        )
        # The subscribers' client (URLs that need redis-py), also the publish script's: no
        # retry. redis-py's own retry reconnects a subscriber and subscribes again inside a
        # read, silently: a publication made in between was missed, and the wait never
        # looked the key up again. Without it the error reaches the wait, which subscribes
        # again and looks again.
        self._subscribers = redis.Redis.from_url(
            self.url,
            socket_connect_timeout=settings.connect_timeout,
            socket_timeout=max(settings.connect_timeout, 5.0),
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        # (run through that client too, where redis-py runs it: its Retry would send it again
        # after a lost connection, the same words -- a publication Redis stored, sent again
        # naming no mark, was stored over a newer record of its key; _call retries it, as
        # a retry, see _publish_now)
        self._publish = self._subscribers.register_script(_PUBLISH)
        self._publish_frame = self._subscribers.register_script(_PUBLISH_FRAME)
        # (by digest: the text goes only where Redis forgot it, NOSCRIPT)
        self._delete = self.redis.register_script(_DELETE)
        self._delete_if = self.redis.register_script(_DELETE_IF)
        self._scripts: dict[str, Any] = {}  # (:meth:`eval_later`'s, by their text)
        self._per_thread = PerThread()
        self._lock_of: tuple[int, threading.Lock] = (forks(), threading.Lock())
        # weak: a thread's subscriber goes (and its connection closes) when the thread ends
        self._pubsubs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._fasts: weakref.WeakSet[RespConnection] = weakref.WeakSet()
        # The per-frame commands (publish, lookup) go through a lean connection per thread
        # (:mod:`.resp`) when the URL is plain TCP; anything else keeps to redis-py.
        pool = self.redis.connection_pool
        kw = pool.connection_kwargs
        self._fast_args: tuple[Any, ...] | None = None
        if pool.connection_class is redis.Connection and "host" in kw:
            self._fast_args = (kw["host"], int(kw.get("port", 6379)), int(kw.get("db") or 0),
                               kw.get("username"), kw.get("password"),
                               max(settings.connect_timeout, 5.0), settings.connect_timeout)
        #: whether waits may keep pattern subscriptions (off once Redis refused one: an ACL)
        self._patterns = True
        _backends.add(self)

    # ------------------------------------------------------------------ retries
    def _call(self, what: str, fn: Any, deadline: float | None = None) -> Any:
        """Run ``fn`` retrying connection errors until ``deadline``.

        ``deadline`` defaults to the connect timeout from now; a waiter passes its own (or
        ``math.inf`` to retry for as long as it waits).
        """
        # (a caller's own deadline also bounds each attempt's wait for Redis's answer on the
        # lean connection, not only the retries: a Redis that stops answering)
        fast = self._fast() if deadline is not None and math.isfinite(deadline) else None
        if deadline is None:
            deadline = time.monotonic() + self.settings.connect_timeout
        delay = 0.02
        while True:
            try:
                # (what this thread holds back runs first: also before a command that goes
                # through redis-py's connections, which must see it done)
                held = getattr(self._per_thread.get(), "fast", None)
                if held is not None and held._held:
                    held._settle()
                if fast is None:
                    return fn()
                # (every attempt gets a moment at least: a deadline that has passed, or a
                # timeout of 0, still looks once, as it always did)
                fast.until = max(deadline, time.monotonic() + _ATTEMPT_MIN)
                try:
                    return fn()
                finally:
                    fast.until = None
            except _REPLIES as exc:  # (an answer: asking again would be refused again —
                # except Redis's "not now" answers, a restart or failover under way, which the
                # lean connections take for unavailability and try again, as here)
                if not str(exc).startswith(_NOT_NOW):
                    raise _refusal(self.url, what, exc) from None
                if time.monotonic() + delay > deadline:
                    raise MetadataUnavailable(self.url, f"{what}: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except _ERRORS as exc:
                if time.monotonic() + delay > deadline:
                    raise MetadataUnavailable(self.url, f"{what}: {exc}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _fast(self) -> RespConnection | None:
        """This thread's lean connection, or ``None`` when the URL needs redis-py."""
        if self._fast_args is None:
            return None
        local = self._per_thread.get()
        conn = getattr(local, "fast", None)
        if conn is None:
            conn = local.fast = RespConnection(*self._fast_args)
            with self._lock:
                self._fasts.add(conn)
        return conn

    # ------------------------------------------------------------------ contract
    def publish(self, record: Record, *, overwrite: bool = True,
                then: Sequence[tuple[Any, ...]] = ()) -> Record:
        """Record ``record`` (its version is assigned here) and notify waiters; then run the
        commands ``then`` (e.g. :meth:`forget_commands`) in the same step, only if the record
        was stored. Retried after a connection failure, it stays one publication: a reply
        lost after Redis stored it gives the stored version on the retry (not a second
        version, nor :class:`KeyExistsError` for a write-once key)."""
        return self._publish_now(record, self._publication(record, overwrite, then))

    def publish_soon(self, record: Record, *, overwrite: bool = True,
                     then: Sequence[tuple[Any, ...]] = (),
                     report: str | None = None, hold: bool = False) -> PendingRecord:
        """:meth:`publish` without waiting for Redis's reply, which the result reads.

        ``report``: the name of a hash that the publication reads in the same step; once the
        result is called, its ``reported`` holds the hash's fields as they were then (a
        stream's group cursors: the producer needs no round trip of its own for them). A
        publication answered as a retry of one stored already reports nothing (``None``).

        The record is sent at once: Redis stores and announces it as soon as it reads it,
        as for :meth:`publish`; only the caller does not wait for the answer (a stream's
        producer confirms its frames' records a few frames later: no round trip, and no
        sleep and wake-up of the producer, per frame). Calling the result returns the stored
        record or raises what :meth:`publish` would raise; a reply that cannot be read (the
        connection failed, Redis restarted) is settled by publishing again as the same
        publication, so it stays one version. It may be called again after it raised.
        Several may be pending at once; confirm them in the order they were sent (a
        publication sent again after a later one would set the stream's head back).
        Confirmed from another thread or a forked child, the answer (on the sender's
        connection) is not read: the record is sent again, as the same publication.

        ``hold``: the record is held back, to go out with this thread's next command to
        Redis (:meth:`RespConnection.call_soon`'s ``hold``: after ~0.2 s if none comes, and
        before the connection closes): several records in one segment, one wake-up of Redis
        for them. Readers that wait for the key through Redis see it that much later. Only
        while Redis owes the connection no reply (else it goes now): the result's ``held``
        says which.
        """
        sent = self._publication(record, overwrite, then, report)
        fast = self._fast()
        if fast is None:  # (a URL that needs redis-py: the usual way, now)
            pending = PendingRecord(lambda: stored, lambda: True)
            stored = self._publish_now(record, sent, pending)
            return pending
        try:
            replies: Callable[[], list[Any]] | None = fast.call_soon(
                [_AHEAD, self._evalsha(sent)], hold=hold)
        except _ERRORS:
            replies = None  # (not sent: the confirmation publishes)
        return _SoonRecord(self, record, sent, replies, fast)

    def _publication(self, record: Record, overwrite: bool, then: Sequence[tuple[Any, ...]],
                     report: str | None = None) -> _Sent:
        """The keys and arguments of the publish script for ``record``, with a new
        publication id (a retry with the same arguments is the same publication); ``report``:
        the hash the script reads back (see :meth:`publish_soon`). In the short form
        (:data:`_PUBLISH_FRAME`) wherever its words can say it: always but where ``then``
        holds other commands than a stream's head counters and forgotten records."""
        size, when = str(record.size), repr(record.time)
        # the announcement's fields but the version, joined by NUL (see _PUBLISH)
        tail = "\0".join(("", size, when, record.owner, record.node, record.checksum or "",
                           record.key))
        if tail.count("\0") != 6:  # (a field holds the separator: refused)
            name, value = next((n, v) for n, v in (("INSTRIDE_ADDR", record.owner),
                                                   ("INSTRIDE_NODE", record.node),
                                                   ("checksum", record.checksum))
                               if v and "\0" in v)
            raise ConfigError(name, value, f"a NUL byte cannot be recorded (key {record.key!r})")
        # the publication's id: a retry after a lost reply finds it stored (see _PUBLISH)
        args: list[Any] = [record.owner, size, record.checksum or "", when, record.node,
                           record.key, "1" if overwrite else "0", _publication_id()]
        short = _frame_words(then, report)
        if short is not None:
            return [], [args[5], *args[:5], *args[6:], *short], True
        keys = [_REC + record.key, _KEYS, _CHAN + record.key, _CLOCK, _LEGACY_VER + record.key]
        args.append(tail)
        if then or report is not None:
            args.append(len(then))
            for command in then:
                args += (len(command), *command)
        if report is not None:
            args.append(report)
        return keys, args, False

    def _evalsha(self, sent: _Sent) -> tuple[Any, ...]:
        keys, args, short = sent
        return ("EVALSHA", (self._publish_frame if short else self._publish).sha, len(keys),
                *keys, *args)

    def _publish_now(self, record: Record, sent: _Sent,
                     pending: PendingRecord | None = None, first: float | None = None) -> Record:
        """Run the publication ``sent`` (:meth:`_publication`), retrying connection errors
        (what it reports goes to ``pending``); ``first``: when it was sent before (a
        ``time.monotonic()``), if it was (:meth:`publish_soon`'s, its answer lost).

        Once an attempt may have been stored (sent whole, or sent before: ``first``), every
        later attempt is a retry, and a failure — Redis out of reach, or a refusal of the
        retry — is :class:`PublicationUnsettled`; plain :class:`MetadataUnavailable` or
        :class:`AuthenticationError` only where nothing may be stored."""
        keys, args, short = sent
        base = 0 if short else 5  # (the keys before a retry's marks)
        went = False  # (an attempt sent it whole: a failure after that leaves it unknown)
        again = first is not None  # (sent before: each attempt is a retry)
        if first is None:
            first = time.monotonic()

        answered = False  # (the script itself answered an error: it ran, or Redis refused it)

        def run() -> Any:
            nonlocal went, sent, keys, answered
            answered = False
            if (went or again) and len(keys) == base:  # a retry: it names where it may be
                keys = [*keys, _WAS + args[7]]  # found done (see _PUBLISH: overwritten since)
                sent = (keys, args, short)
            if len(keys) == base + 1 and time.monotonic() - first > _RETRY_WITHIN_S:
                # (its mark, were it overwritten or deleted meanwhile, may be gone: the
                # script says unsettled unless it finds its own record)
                keys = [*keys, _WAS + "late"]
                sent = (keys, args, short)
            fast = self._fast()
            if fast is not None:
                fast.fresh()  # (a connection Redis closed goes first: not sent, not unsettled)
                before = fast.sent
                try:
                    _pong, reply = fast.call([_AHEAD, self._evalsha(sent)])
                except _ERRORS as exc:
                    # (a connection Redis turned away ran nothing: maxclients)
                    went = went or (fast.sent != before and not isinstance(exc, resp.TurnedAway))
                    raise
                if not isinstance(reply, Exception):
                    return reply
                if not str(reply).startswith("NOSCRIPT"):
                    answered = True
                    raise redis.ResponseError(str(reply))
            # redis-py loads the script when Redis does not know it (first use, restart)
            try:
                return (self._publish_frame if short else self._publish)(keys=keys, args=args)
            except redis.ResponseError:
                answered = True  # (not a login's or a SELECT's: those fail the connection)
                raise
            except _ERRORS:
                went = True  # (redis-py does not say whether it went out)
                raise

        try:
            version = self._call("publish", run)
        except (MetadataUnavailable, AuthenticationError) as exc:
            # stored or not: Redis never answered (see PublicationUnsettled) -- an attempt
            # here, or the send before (``first``: its reply lost, Redis out of reach since);
            # a retry refused (an ACL changed, Redis full) says nothing of what went before
            if went or again:
                detail = exc.detail
                if isinstance(exc, AuthenticationError) or _is_refusal(exc):
                    detail = f"its answer was lost, and its retry refused: {detail}"
                raise PublicationUnsettled(self.url, record.key, detail) from None
            if answered:
                exc.script_answered = True  # type: ignore[union-attr]  (see _SoonRecord)
            raise
        if version == _LATE:
            raise PublicationUnsettled(self.url, record.key, "its answer was lost, and "
                                       f"{_RETRY_WITHIN_S:g} s later Redis holds neither its "
                                       "record nor a mark of it (stored and forgotten since, or "
                                       "never stored: cannot be told)")
        return self._stored(record, version, pending)

    @staticmethod
    def _stored(record: Record, version: Any, pending: PendingRecord | None = None) -> Record:
        """``record`` with the version the publish script answered (negative: it exists); a
        hash it was asked to read back (``[version, fields]``) goes to ``pending``."""
        if isinstance(version, list):
            version, fields = version
            if pending is not None:
                pending.reported = fields if isinstance(fields, dict) else hash_fields(fields)
        if int(version) < 0:
            raise KeyExistsError(record.key)
        return Record(record.key, record.owner, record.size, record.checksum, int(version),
                      record.time, record.node)

    def set_later(self, name: str, mapping: dict[str, Any]) -> None:
        """``HSET name mapping`` without waiting for the reply (its round trip overlaps the
        caller's next work; see :meth:`RespConnection.defer`). Plain ``HSET`` where the URL
        needs redis-py."""
        fast = self._fast()
        if fast is None:
            self._call("hset", lambda: self.redis.hset(name, mapping=mapping))
            return
        args = [x for kv in mapping.items() for x in kv]
        self._call("hset", lambda: fast.defer([("HSET", name, *args)]))

    def eval_later(self, script: str, keys: Sequence[str], args: Sequence[Any], *,
                   on_reply: Callable[[Any], None] | None = None) -> None:
        """Run the Lua ``script`` on ``keys`` and ``args`` without waiting for its reply.

        An ``EVAL`` deferred as :meth:`set_later`'s ``HSET`` is (see
        :meth:`RespConnection.defer`): it may run twice, sent again on a new connection after
        the first failed before its reply, so the script must check what it may still do
        then (a group's cursor written only while the reader still holds the group's lease).
        The script's text goes with every call (~150 bytes for a commit): nothing depends on
        Redis's script cache, which a restart or ``SCRIPT FLUSH`` empties (an ``EVALSHA``
        would fail with ``NOSCRIPT`` then). Its reply goes to ``on_reply`` when it is read
        (by the thread's next call that reads, or :meth:`take_deferred`), else it is dropped;
        an error reply also goes there (an exception), and is raised by the thread's next
        deferred command or :meth:`flush`. Run at once (waiting) where the URL needs
        redis-py.

        Parameters
        ----------
        script
            The script's text.
        keys, args
            Its ``KEYS`` and ``ARGV``.
        on_reply
            Given the script's reply (an error's as its exception); it must not raise, nor
            use Redis (it runs while the connection reads).
        """
        fast = self._fast()
        if fast is None:
            runner = self._scripts.get(script)
            if runner is None:
                runner = self._scripts.setdefault(script, self.redis.register_script(script))
            reply = self._call("evalsha", lambda: runner(keys=list(keys), args=list(args)))
            if on_reply is not None:
                on_reply(reply)
            return

        self._call("eval", lambda: fast.defer([("EVAL", script, len(keys), *keys, *args)],
                                              on_reply=on_reply))

    def take_deferred(self, wait: float = 0.0) -> bool:
        """Take in the replies come to this thread's deferred commands (see
        :meth:`eval_later`'s ``on_reply``): a look at its connection, a read where one came;
        ``wait``: for at most that many seconds, those still on their way too. Never raises
        (see :meth:`RespConnection.take_deferred`).

        Returns
        -------
        bool
            Whether no reply to a deferred command of this thread is owed now.
        """
        conn = getattr(self._per_thread.get(), "fast", None)
        return conn is None or conn.take_deferred(wait)

    def command(self, *args: Any, deadline: float | None = None) -> Any:
        """One Redis command, on this thread's lean connection where the URL allows (the
        per-frame commands of streams), else through redis-py; connection errors retried
        until ``deadline`` (``time.monotonic()``; default: the connect timeout from now)."""
        fast = self._fast()
        if fast is None:
            return self._call(str(args[0]), lambda: self.redis.execute_command(*args),
                              deadline)

        def run() -> Any:
            (reply,) = fast.call([args])
            if isinstance(reply, Exception):
                raise redis.ResponseError(str(reply))
            return reply

        return self._call(str(args[0]), run, deadline)

    def flush(self) -> None:
        """Wait until this thread's deferred commands (:meth:`set_later`,
        :meth:`eval_later`) have run.

        Raises
        ------
        MetadataUnavailable, AuthenticationError
            One of them failed (its error answer, read here or by an earlier call: see
            :func:`_refusal`).
        """
        fast = self._fast()
        if fast is not None:
            if fast.deferred or fast._held:  # (held records: run too, see publish_soon)
                self.command("PING")
            try:
                fast.raise_deferred()
            except _REPLIES as exc:
                raise _refusal(self.url, "a deferred command", exc) from None

    def hgetall(self, name: str) -> dict[bytes, bytes]:
        """``HGETALL name`` (see :meth:`command`)."""
        reply = self.command("HGETALL", name)
        return reply if isinstance(reply, dict) else hash_fields(reply)

    def _hgetall(self, keys: Sequence[str]) -> list[dict[bytes, bytes]]:
        fast = self._fast()
        if fast is not None:  # pipelined: one write, one round trip
            return [hash_fields(r) for r in fast.call([("HGETALL", _REC + k) for k in keys])]
        if len(keys) == 1:
            return [self.redis.hgetall(_REC + keys[0])]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(_REC + key)
        return pipe.execute()

    def lookup(self, key: str, deadline: float | None = None) -> Record | None:
        """The record of ``key``, or ``None``; :class:`MetadataUnavailable` if Redis is down.

        ``deadline`` (``time.monotonic()``): when to give up retrying a connection that
        fails (a caller's own timeout); by default the connect timeout from now.
        """
        return _record(self._call("lookup", lambda: self._hgetall([key])[0], deadline))

    def lookup_soon(self, key: str) -> Callable[[], Record | None]:
        """Ask for the record of ``key`` now; the function returned gives it (or ``None``).

        On the lean connection the request goes out at once and its round trip overlaps the
        caller's work until the function is called (which must come before any other command
        of this thread); elsewhere, or if the connection fails, the function looks it up then.
        """
        fast = self._fast()
        if fast is None:
            return lambda: self.lookup(key)
        try:
            replies = fast.call_soon([("HGETALL", _REC + key)])
        except (ConnectionError, OSError, redis.RedisError):
            return lambda: self.lookup(key)

        def finish() -> Record | None:
            try:
                (reply,) = replies()
            except (ConnectionError, OSError, redis.RedisError):
                return self.lookup(key)  # (with the usual retries and errors)
            if isinstance(reply, Exception):
                return self.lookup(key)
            return _record(hash_fields(reply))

        return finish

    def lookup_any(self, keys: Sequence[str]) -> Record | None:
        """The record of the first of ``keys`` that is recorded (one round trip), or ``None``."""
        return self._lookup_many(keys)

    def _check(self, keys: Sequence[str], start: float, deadline: float | None) -> Record | None:
        """A waiter's look at ``keys``: retried for as long as it waits, and
        :class:`ConsumeTimeout` at its deadline (``MetadataUnavailable`` never ends a wait)."""
        try:
            return self._lookup_many(keys, math.inf if deadline is None else deadline)
        except MetadataUnavailable as exc:
            if _is_refusal(exc):
                raise
            raise ConsumeTimeout(keys[0], time.monotonic() - start) from exc

    def _lookup_many(self, keys: Sequence[str], deadline: float | None = None) -> Record | None:
        if self._fast_args is not None:
            for f in self._call("lookup", lambda: self._hgetall(keys), deadline):
                rec = _record(f)
                if rec is not None:
                    return rec
            return None

        def run() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(_REC + key)
            return pipe.execute()

        for fields in self._call("lookup", run, deadline):
            rec = _record(fields)
            if rec is not None:
                return rec
        return None

    def _pubsub(self) -> Any:
        """This thread's subscriber connection, kept across waits (PubSub is not thread-safe)."""
        local = self._per_thread.get()
        ps = getattr(local, "pubsub", None)
        if ps is None:
            ps = self._subscribers.pubsub(ignore_subscribe_messages=False)
            local.pubsub = ps
            with self._lock:
                self._pubsubs.add(ps)
        return ps

    def _drop_pubsub(self) -> None:
        local = self._per_thread.get()
        ps = getattr(local, "pubsub", None)
        local.pubsub = None
        if ps is not None:
            with self._lock:
                self._pubsubs.discard(ps)
            try:
                ps.close()
            except _ERRORS:
                pass

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> Record:
        """Block until one of ``keys`` is recorded; :class:`ConsumeTimeout` after ``timeout``.

        Subscribes before checking, so no publication is missed; survives Redis restarts.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout

        def remaining() -> float:
            if deadline is None:
                return 1.0
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConsumeTimeout(keys[0], time.monotonic() - start)
            return min(left, 1.0)

        prefix = _common_dir(keys) if self._fast_args is not None and self._patterns else ""
        if prefix and self._watching(prefix):
            # the directory's publications are heard already: one lookup, then wait
            with contextlib.suppress(_PatternsRefused):
                return self._wait_watched(prefix, keys, remaining, start, deadline)
        try:  # fast path: already published, no subscription needed
            rec = self._lookup_many(keys, math.inf if deadline is None else deadline)
        except MetadataUnavailable as exc:
            if _is_refusal(exc):
                raise
            raise ConsumeTimeout(keys[0], time.monotonic() - start) from exc
        if rec is not None:
            return rec
        channels = [_CHAN + k for k in keys]
        wanted = {c.encode() for c in channels}
        if self._fast_args is not None:
            if prefix:
                try:
                    return self._wait_watched(prefix, keys, remaining, start, deadline)
                except _PatternsRefused:
                    self._patterns = False  # (and per key from now on)
            return self._wait_lean(keys, channels, wanted, remaining, start, deadline)

        pause = _REWAIT_FIRST
        while True:
            ps = self._pubsub()
            try:
                ps.subscribe(*channels)
                nonce = secrets.token_hex(8).encode()
                ps.ping(nonce)
                live = _Liveness(ps)  # (a silent connection is asked, then given up)
                try:
                    # The subscription must be in force before the existence check: SUBSCRIBE
                    # travels on its own connection, and Redis may serve the check (sent on
                    # another connection) first. The PING's reply, with this wait's nonce,
                    # comes once it is; what comes before it is an earlier wait's (its
                    # confirmations, messages published before its UNSUBSCRIBE): skipped.
                    while True:
                        msg = live.message(remaining())
                        if msg is not None and msg["type"] == "pong" and msg["data"] == nonce:
                            break
                    pause = _REWAIT_FIRST  # (Redis answers: a later loss is a new one)
                    rec = self._check(keys, start, deadline)
                    if rec is not None:
                        return rec
                    while True:
                        msg = live.message(remaining())
                        if msg is not None and msg["type"] == "message" and msg["channel"] in wanted:
                            rec = _from_message(msg["data"]) or self._check(keys, start, deadline)
                            if rec is not None:
                                return rec
                finally:
                    try:
                        ps.unsubscribe(*channels)
                    except _REPLIES:
                        pass  # (an error answer: refused as the SUBSCRIBE was; nothing to undo)
                    except _ERRORS:
                        # (the connection broke: dropped, its subscriptions with it; a
                        # record found is returned all the same, an error goes on as it was)
                        self._drop_pubsub()
            except ConsumeTimeout:
                raise  # (the wait's own end, not a lost connection: nothing dropped)
            except _REPLIES as exc:  # (Redis's answer, a NOPERM say: again would be refused
                raise _refusal(self.url, "wait (SUBSCRIBE)", exc) from None  # again, for ever)
            except _ERRORS as exc:
                # Redis went away (or stopped answering: see _Liveness): drop the connection,
                # back off, re-subscribe, re-check. The pool's idle connections go too: they
                # lead where this one did, and the check's look would otherwise wait out its
                # socket timeout (5 s) on one of them before reconnecting.
                self._drop_pubsub()
                with contextlib.suppress(Exception):
                    self.redis.connection_pool.disconnect(inuse_connections=False)
                if deadline is not None and time.monotonic() >= deadline:
                    raise ConsumeTimeout(keys[0], time.monotonic() - start) from exc
                pause = _rewait(pause, deadline)

    @property
    def _lock(self) -> threading.Lock:
        """This object's lock, made again in a forked child (one that another thread held at
        the fork would stay held there for ever: the child's first subscriber, deadlocked)."""
        made, lock = self._lock_of
        if made != forks():
            self._lock_of = (forks(), threading.Lock())
            lock = self._lock_of[1]
        return lock

    def _subscriber(self) -> RespConnection:
        local = self._per_thread.get()
        conn = getattr(local, "sub", None)
        if conn is None:
            assert self._fast_args is not None
            conn = local.sub = RespConnection(*self._fast_args)
            with self._lock:
                self._fasts.add(conn)
        return conn

    def _watching(self, prefix: str) -> bool:
        """Whether this thread's subscriber hears the publications under ``prefix`` now."""
        sub = getattr(self._per_thread.get(), "sub", None)
        return sub is not None and sub.sock is not None and _pattern(prefix) in sub.patterns

    def _wait_watched(self, prefix: str, keys: Sequence[str], remaining: Any, start: float,
                      deadline: float | None) -> Record:
        """:meth:`wait_any` for keys under one directory, through a pattern subscription to
        the directory's publications that stays in force between waits.

        A stream's consumer waits for frame after frame of one directory: subscribing and
        unsubscribing per frame cost three round trips. Instead the thread's subscriber keeps
        ``PSUBSCRIBE instride:pub:<dir>/*`` (the :data:`_WATCH_MAX` directories used last).
        Each wait drops what arrived before it (the lookup that follows covers it), looks
        the keys up once, and trusts only announcements read after that lookup — the same
        protocol as a per-key subscription, so no publication is missed and no record of a
        key deleted meanwhile is returned.

        Raises
        ------
        _PatternsRefused
            Redis refused the pattern subscription (the caller waits per key instead).
        """
        spin = self.settings.spin
        pattern = _pattern(prefix)
        wanted = set(keys)
        local = self._per_thread.get()
        pause = _REWAIT_FIRST
        while True:
            sub = self._subscriber()
            try:
                if pattern in sub.patterns:
                    sub.patterns[pattern] = sub.patterns.pop(pattern)  # most recently used
                else:
                    self._watch(sub, pattern, remaining)
                    pause = _REWAIT_FIRST  # (Redis answers: a later loss is a new one)
                # Published before the lookup: the lookup sees the keys waited for; other
                # keys' announcements are kept for :meth:`announced`.
                for msg in sub.pending():
                    self._keep_heard(local, _announced(msg))
                self._take_heard(local, keys)
                rec = self._check(keys, start, deadline)
                if rec is not None:
                    return rec
                while True:
                    rec = _announced(sub.read(remaining(), spin))
                    if rec is not None and rec.key in wanted:
                        return rec
                    self._keep_heard(local, rec)
            except ConsumeTimeout:
                raise  # (the wait's own end: what was heard is kept)
            except _ERRORS as exc:
                # Redis went away: the connection (and its subscriptions) closed; back off,
                # subscribe again, check again.
                self._forget_heard(local)  # (what it missed meanwhile is not among them)
                if deadline is not None and time.monotonic() >= deadline:
                    raise ConsumeTimeout(keys[0], time.monotonic() - start) from exc
                pause = _rewait(pause, deadline)

    def watch(self, prefix: str, timeout: float) -> bool:
        """Have this thread's subscriber hear the publications under ``prefix`` (a directory,
        ``"a/b/"``) from now on, as a wait there that found nothing leaves it: for a reader
        about to wait in that directory on a thread that never waited there (a node server
        runs each wait on whichever thread of its pool is free). ``False`` where it cannot
        within ``timeout`` seconds (patterns refused, Redis away): the caller waits the usual
        way."""
        if self._fast_args is None or not self._patterns:
            return False
        if self._watching(prefix):
            return True
        deadline = time.monotonic() + timeout

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConsumeTimeout(prefix, timeout)
            return left

        try:
            self._watch(self._subscriber(), _pattern(prefix), remaining)
        except _PatternsRefused:
            self._patterns = False
            return False
        except (ConsumeTimeout, *_ERRORS):
            return False
        return True

    def watching(self, prefix: str) -> bool:
        """Whether this thread keeps a subscription to the publications under ``prefix`` (a
        directory, ``"a/b/"``), as a wait there leaves one: see :meth:`announced`."""
        return self._watching(prefix)

    def announced(self, key: str, wait: float = 0.0) -> Record | None:
        """The record of ``key`` as this thread's kept subscription to its directory heard it
        announced, without a round trip; ``None`` when not heard within ``wait`` seconds, or
        when the directory is not watched.

        What was received already is read first; announcements of other keys are kept for a
        later call (the :data:`_HEARD_MAX` last: a reader behind its producer reads the
        announcements of the frames ahead with the one it asks for). For a stream's reader that received
        a frame before asking for its record: the owner records a frame right after renaming
        it into place, so its announcement is in, or moments away, by the time the bytes
        are — reading it replaces a lookup's round trip.
        """
        prefix = key.rpartition("/")[0] + "/"
        if prefix == "/" or not self._watching(prefix):
            return None
        sub = self._subscriber()
        local = self._per_thread.get()
        found = self.heard([key]).get(key)
        if time.monotonic() - getattr(local, "heard_overflow", -math.inf) < _HEARD_OVERFLOW_S:
            wait = 0.0  # (kept announcements were dropped lately: this one may have been)
        try:
            end = time.monotonic() + wait
            while found is None and sub.sock is not None:
                left = end - time.monotonic()
                if left <= 0:
                    break
                rec = _announced(sub.read(left))
                if rec is not None and rec.key == key:
                    found = rec
                else:
                    self._keep_heard(local, rec)
        except _ERRORS:
            return None  # (the connection is closed; the next wait subscribes again)
        return found

    def heard(self, keys: Sequence[str]) -> dict[str, Record]:
        """The records of ``keys`` announced on this thread's kept subscriptions since they
        were last read (the newest of each; taken: a second call does not return them again);
        nothing is waited for, and announcements of other keys are kept for a later call.
        Empty when the thread keeps no subscription, or when reading
        it finds the connection lost: the connection is closed then, which callers see as
        :meth:`subscription` no longer returning its socket (the next wait subscribes
        again, and its lookup covers what was announced meanwhile)."""
        local = self._per_thread.get()
        sub = getattr(local, "sub", None)
        if sub is None or sub.sock is None:
            self._forget_heard(local)
            return {}
        try:
            for msg in sub.pending():
                self._keep_heard(local, _announced(msg))
        except _ERRORS:
            self._forget_heard(local)
            return {}  # (lost: pending() closed the connection; see above)
        return self._take_heard(local, keys)

    @staticmethod
    def _keep_heard(local: Any, rec: Record | None) -> None:
        """Keep an announced record (the newest of each key, the :data:`_HEARD_MAX` last)."""
        if rec is None:
            return
        kept = getattr(local, "heard", None)
        if kept is None:
            kept = local.heard = collections.OrderedDict()
        old = kept.pop(rec.key, None)
        kept[rec.key] = rec if old is None or rec.version >= old.version else old
        while len(kept) > _HEARD_MAX:
            kept.popitem(last=False)
            local.heard_overflow = time.monotonic()

    @staticmethod
    def _forget_heard(local: Any, prefix: str = "") -> None:
        """Drop the kept announcements (of the keys under ``prefix``; all by default)."""
        kept = getattr(local, "heard", None)
        if kept:
            for key in [k for k in kept if k.startswith(prefix)]:
                del kept[key]

    @staticmethod
    def _take_heard(local: Any, keys: Sequence[str]) -> dict[str, Record]:
        kept = getattr(local, "heard", None)
        if not kept:
            return {}
        return {k: kept.pop(k) for k in keys if k in kept}

    def subscription(self, prefix: str) -> Any | None:
        """The socket of this thread's kept subscription to the publications under ``prefix``
        (to poll beside another socket; read it with :meth:`heard`), or ``None`` when the
        thread does not watch ``prefix``."""
        sub = getattr(self._per_thread.get(), "sub", None)
        return sub.sock if self._watching(prefix) else None

    def unwatch(self, prefix: str) -> None:
        """End this thread's kept subscription to the publications under ``prefix`` (a
        directory, ``"a/b/"``; see :meth:`wait_any`).

        Called when a stream's reader closes, and when it receives frames from their owner as
        they are published (it checks them by their own checksums: it needs no announcements,
        and Redis stops sending them); nothing to do if the thread never waited there.
        """
        local = self._per_thread.get()
        self._forget_heard(local, prefix)
        sub = getattr(local, "sub", None)
        pattern = _pattern(prefix)
        if sub is None or sub.sock is None or pattern not in sub.patterns:
            return
        del sub.patterns[pattern]
        # The confirmation is skipped by the next wait, as other leftovers are. If the send
        # fails, send() has closed the connection, and Redis dropped its subscriptions with it.
        with contextlib.suppress(*_ERRORS):
            sub.send([("PUNSUBSCRIBE", pattern)])

    @staticmethod
    def _watch(sub: RespConnection, pattern: str, remaining: Any) -> None:
        """Subscribe ``sub`` to ``pattern`` and wait for Redis's confirmation.

        A subscription that cannot be confirmed (a timeout, an error) closes the connection,
        so that none stays in force unaccounted for.
        """
        commands: list[tuple[Any, ...]] = [("PSUBSCRIBE", pattern)]
        while len(sub.patterns) >= _WATCH_MAX:  # the least recently used goes
            old = next(iter(sub.patterns))
            del sub.patterns[old]
            commands.append(("PUNSUBSCRIBE", old))
        sub.send(commands)
        want = pattern.encode()
        try:
            while True:
                msg = sub.read(remaining())
                if isinstance(msg, Exception):  # e.g. NOPERM: patterns are not allowed
                    # (unless it is Redis's "not now": turned away at its maxclients)
                    raise resp.not_now(msg) or _PatternsRefused(str(msg))
                if isinstance(msg, list) and len(msg) >= 2 and msg[0] == b"psubscribe" \
                        and msg[1] == want:
                    sub.patterns[pattern] = None
                    return
        except BaseException:
            sub.close()
            raise

    def _wait_lean(self, keys: Sequence[str], channels: list[str], wanted: set[bytes],
                   remaining: Any, start: float, deadline: float | None) -> Record:
        """:meth:`wait_any`'s subscription on this thread's lean subscriber connection.

        The same protocol as the redis-py path: subscribe, wait for Redis to say that the
        subscription is in force (the reply of a PING sent after it), check, then wait for a
        message; leftovers of earlier waits (confirmations, messages of other channels or
        from before) are skipped.
        """
        spin = self.settings.spin  # busy-poll the subscription before sleeping on it
        pause = _REWAIT_FIRST
        while True:
            sub = self._subscriber()
            try:
                # A PING after the SUBSCRIBE: its reply (with a nonce of this wait's own)
                # comes once the subscription is in force, after everything an earlier wait
                # left on the connection (confirmations it did not stay for, messages
                # published before its UNSUBSCRIBE): all that is skipped, then the check.
                nonce = secrets.token_hex(8).encode()
                sub.send([("SUBSCRIBE", *channels), ("PING", nonce)])
                try:
                    in_force = False
                    while True:
                        msg = sub.read(remaining(), spin)
                        if isinstance(msg, Exception):
                            busy = resp.not_now(msg)
                            if busy is not None:  # (the PING answered LOADING after a
                                sub.close()  # restart, the connection turned away at
                                raise busy  # maxclients: subscribed again, as when lost)
                            # (Redis refused the SUBSCRIBE: an ACL user without channel
                            # rights; waiting on would be for ever)
                            raise _refusal(self.url, "wait (SUBSCRIBE)", msg)
                        if not isinstance(msg, list) or len(msg) < 2:
                            continue
                        if not in_force:
                            if msg[0] == b"pong" and msg[1] == nonce:
                                in_force = True  # the subscription is in force: check now
                                pause = _REWAIT_FIRST  # (Redis answers: a later loss is new)
                                rec = self._check(keys, start, deadline)
                                if rec is not None:
                                    return rec
                        elif len(msg) >= 3 and msg[0] == b"message" and msg[1] in wanted:
                            rec = _from_message(msg[2]) or self._check(keys, start, deadline)
                            if rec is not None:
                                return rec
                finally:
                    # (a broken connection is gone already; one that breaks now is closed by
                    # send(), and Redis drops its subscriptions with it: a record found is
                    # returned all the same, an error on its way out goes on as it was)
                    if sub.sock is not None:
                        with contextlib.suppress(*_ERRORS):
                            sub.send([("UNSUBSCRIBE", *channels)])
            except (ConsumeTimeout, InstrideError):
                raise  # (the wait's own end; a refusal, typed above: not a lost connection)
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
                # (the subscriber's login refused: again would be refused again, for ever)
                raise _refusal(self.url, "wait", exc) from None
            except _ERRORS as exc:
                # Redis went away: the connection is closed; back off, re-subscribe, re-check.
                if deadline is not None and time.monotonic() >= deadline:
                    raise ConsumeTimeout(keys[0], time.monotonic() - start) from exc
                pause = _rewait(pause, deadline)

    @staticmethod
    def forget_commands(key: str) -> list[tuple[Any, ...]]:
        """The commands that forget ``key``'s record (nothing of the key is kept)."""
        return [("DEL", _REC + key), ("ZREM", _KEYS, key)]

    @staticmethod
    def frame_steps(stream: str, head: str, groups: str, oldest: int, written: int,
                    retired: Sequence[str]) -> list[tuple[Any, ...]]:
        """What a stream's producer runs with a frame's publication (the ``then`` of
        :meth:`publish` and :meth:`publish_soon`): ``HSET head oldest .. written ..`` and
        :meth:`forget_commands` of each ``retired`` key. Where ``head`` and ``groups`` are the
        stream's own names (``instride:stream:<stream>:head`` and ``:groups``), the
        publication goes in the short form, ``groups`` the one hash it may read back."""
        commands: list[tuple[Any, ...]] = [("HSET", head, "oldest", oldest, "written", written)]
        for key in retired:
            commands += (("DEL", _REC + key), ("ZREM", _KEYS, key))
        if not stream or head != f"{_STREAM}{stream}:head" or groups != f"{_STREAM}{stream}:groups":
            return commands
        steps = _FrameSteps(commands)
        steps.words, steps.groups = [stream, oldest, written, *retired], groups
        return steps

    def delete(self, key: str) -> None:
        """Forget ``key`` (nothing of it is kept: its next publication still gets a higher
        version, see ``instride:clock``), leaving a mark of its publication for
        :data:`_WAS_TTL_S` seconds: a retry of that publication after a lost reply finds it
        done, and does not bring the record back (nor store it over a later one). The delete
        leaves a mark of its own as long (``instride:was:del:<id>``): a retry of it after a
        lost reply finds it done, and does not forget a publication stored since. Redis full
        (``maxmemory`` reached, ``OOM``) still forgets the record, without the marks it does
        not take then."""
        keys = [_REC + key, _KEYS, f"{_WAS}del:{_publication_id()}"]
        fast = self._fast()
        if fast is not None:
            def lean() -> None:
                reply = fast.call([("EVALSHA", self._delete.sha, len(keys), *keys, key)])[0]
                if isinstance(reply, Exception) and str(reply).startswith("NOSCRIPT"):
                    # (Redis forgot it, a restart or SCRIPT FLUSH: it did not run; its
                    # text runs it, and loads it for the next one)
                    reply = fast.call([("EVAL", _DELETE, len(keys), *keys, key)])[0]
                if isinstance(reply, Exception):
                    raise redis.ResponseError(str(reply))

            self._call("delete", lean)
            return
        self._call("delete", lambda: self._delete(keys=keys, args=[key]))

    def forget(self, key: str) -> None:
        """:meth:`delete` without the mark: for a stream's retired frame, whose record's
        publication is confirmed before its retirement (a producer confirms its frames'
        records first), once per frame (a mark per frame would grow Redis by one key per
        frame for minutes)."""
        fast = self._fast()
        if fast is not None:  # one write, one round trip (a bounded stream retires per frame)
            def lean() -> None:
                replies = fast.call([("MULTI",), *self.forget_commands(key), ("EXEC",)])
                failed = [r for r in replies if isinstance(r, Exception)]
                if failed:
                    raise redis.ResponseError(str(failed[0]))

            self._call("delete", lean)
            return

        def run() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(_REC + key)
            pipe.zrem(_KEYS, key)
            pipe.execute()

        self._call("delete", run)

    def delete_if(self, record: Record) -> bool:
        """Forget ``record``'s key only while its record is still that one (the same version
        and owner): a publication of the key stored since — a new version — stays. Whether it
        was forgotten."""
        keys, args = [_REC + record.key, _KEYS], [str(record.version), record.owner, record.key]
        return bool(self._call("delete_if", lambda: self._delete_if(keys=keys, args=args)))

    def list(self, prefix: str = "") -> list[str]:
        """Recorded keys starting with ``prefix``, sorted."""
        lo = b"[" + prefix.encode() if prefix else b"-"
        hi = b"[" + prefix.encode() + b"\xff" if prefix else b"+"
        keys = self._call("list", lambda: self.redis.zrangebylex(_KEYS, lo, hi))
        return sorted(k.decode() for k in keys)

    def ping(self) -> bool:
        """Whether the server answers."""
        return bool(self._call("ping", self.redis.ping))

    def close(self) -> None:
        """Close the subscriber connections and the connection pool (another thread's lean
        connections are shut down, and closed by that thread: see
        :meth:`RespConnection.close`)."""
        with self._lock:
            subs = list(self._pubsubs)
            self._pubsubs.clear()
        for ps in subs:
            try:
                ps.close()
            except _ERRORS:
                pass
        with self._lock:
            fasts = list(self._fasts)
        for conn in fasts:
            conn.close()  # reconnected on next use: the backend stays usable
        self.redis.close()
        self._subscribers.close()
