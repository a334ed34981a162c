"""Readiness and liveness probes: HTTP requests and TCP connects, each bounded in time
(omnid.unit(5), keys `ready`, `liveness` and `progress`). Plain asyncio streams: no client
library threads, no resolver thread (numeric hosts are used as given). An answer's body
is read only when the caller asks for it, and never past the cap it gives.

The answer comes from a unit, so it is read as hostile: every way it can be wrong (a status
line that is not HTTP's, a header line over the head's cap, a Content-Length that is not a
number or says two things, a chunk size that is not hex, a chunk not followed by its CRLF,
a body cut short, over the cap, or trickled past the deadline) is a ProbeFailed whose
message names it, and nothing else leaves `http_request`. The bytes read for one answer are
bounded (HEAD_MAX for the status line and headers, the caller's cap for the body, as much
again for a chunked body's framing) and so is its time (the caller's timeout, for the whole
exchange). The reader is fuzzed by tests/test_probe_malformed.py (hypothesis finds the chunk
size of -1 that made the reader before this one raise ValueError).

Why this reader and not aiohttp's client (llhttp), by bench/probe_numbers.py (a local server
in another process, client CPU per request, medians of interleaved rounds on the project's
shared 2-core VM, four runs): one ClientSession for every probe, a fresh connection each,
costs 16-46 % more CPU per probe than this reader (e.g. 790 against 638 us for a 20 KB page);
a session per probe more again (887 us); only a kept-alive pool is cheaper (299 us), and a
pool proves a connection accepted long ago, not a listener that accepts now, and holds an fd
per unit. The session would also need an owner to close it on every loop's end (the daemon's,
a re-exec's), which this layer does not have. Hardening cost nothing measurable: the reader
before it took 593-774 us a request in the same runs, this one 562-831 us."""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("omnid.supervisor")

HEAD_MAX = 64 * 1024  # an answer's status line and headers together, at most
SNIPPET = 200  # bytes of a failing answer's body quoted in its reason
INTERIM_MAX = 8  # 1xx answers skipped before the final one, at most

_STATUS_LINE = re.compile(rb"HTTP/1\.[0-9] ([1-9][0-9][0-9])(?:[ \t][^\r\n]*)?\r?\n\Z")
_HEADER_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")  # RFC 9110's token
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?\r?\n\Z")  # 15 hex digits: under 2**60


class ProbeFailed(Exception):
    """One probe attempt failed; the message is what an operator reads."""


class BodyTooLarge(ProbeFailed):
    """The answer's body is longer than the cap the caller gave."""


class ProbeTimedOut(ProbeFailed):
    """No whole answer within the timeout (the connection may have been accepted)."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes  # as much as the caller asked for (read_body), else b""


@dataclass
class Reading:
    """How far one answer got: a timeout's reason says where it waited (not how many bytes
    had come, so that the reason stays the same from one probe of a trickling answer to the next)."""

    part: str = "connecting"  # the reason's words: "... timed out after 2 s in the body"


async def tcp_probe(host: str, port: int, timeout: float) -> None:
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError as exc:
        raise ProbeFailed(f"connect {host}:{port} timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise ProbeFailed(f"connect {host}:{port}: {exc.strerror or exc}") from exc
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def http_request(url: str, timeout: float, *, method: str = "GET", body: bytes = b"",
                       headers: tuple[tuple[str, str], ...] = (), read_body: int | Callable[[int], int] = 0,
                       body_exact: bool = False, on_connected: Callable[[], None] | None = None) -> HttpAnswer:
    """One HTTP/1.1 request (Connection: close; Content-Length set here when there is a body
    or the method is POST), bounded by `timeout` as a whole. Returns the status and, when
    `read_body` > 0, up to that many bytes of the body (Content-Length, chunked, or to EOF);
    `read_body` may be a function of the status (a failing answer's body only).
    `body_exact`: a body longer than `read_body` is an error (BodyTooLarge) rather than cut.
    `on_connected` is called once the connection is open (a refusal never calls it).
    ProbeFailed when there is no answer (refused, timed out: ProbeTimedOut, malformed)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    what = f"{method} {url}"
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "User-Agent: omnid-probe"]
    head += [f"{k}: {v}" for k, v in headers]
    if body or method == "POST":
        head.append(f"Content-Length: {len(body)}")
    head.append("Connection: close")
    try:
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    except UnicodeEncodeError as exc:  # the unit file's checks keep URLs and headers ASCII
        raise ProbeFailed(f"{what}: cannot be sent ({exc.reason} in the URL or a header)") from None
    reading = Reading()

    async def go() -> HttpAnswer:
        reader, writer = await asyncio.open_connection(host, port, limit=HEAD_MAX)
        reading.part = "waiting for the answer"
        if on_connected is not None:
            on_connected()
        try:
            writer.write(request)
            await writer.drain()
            return await read_answer(reader, what, read_body, body_exact, head_only=method == "HEAD",
                                     reading=reading)
        finally:
            writer.close()  # the transport is aborted with the task on a timeout: no fd kept

    try:
        return await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError as exc:
        raise ProbeTimedOut(f"{what} timed out after {timeout:g} s {reading.part}") from exc
    except ProbeFailed:
        raise
    except asyncio.IncompleteReadError as exc:
        raise ProbeFailed(f"{what}: answer cut short ({len(exc.partial)} bytes of a part)") from exc
    except OSError as exc:
        raise ProbeFailed(f"{what}: {exc.strerror or exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a reader's gap is this probe's failure, never the monitor's crash
        log.warning("probe: an answer the reader has no words for; a failed probe", url=url,
                    error=f"{type(exc).__name__}: {exc}")
        raise ProbeFailed(f"{what}: unreadable answer ({type(exc).__name__}: {exc})") from None


async def read_answer(reader: asyncio.StreamReader, what: str, read_body: int | Callable[[int], int] = 0,
                      body_exact: bool = False, *, head_only: bool = False,
                      reading: Reading | None = None) -> HttpAnswer:
    """Read one HTTP/1.x answer from `reader` (a StreamReader whose limit is HEAD_MAX): its
    head always (interim 1xx answers skipped), its body as `http_request` says. ProbeFailed
    naming what is wrong with it; `what` begins every message (the method and the URL)."""
    at = reading or Reading()
    at.part = "waiting for the answer"
    head_left = HEAD_MAX
    for _ in range(INTERIM_MAX + 1):
        status_line = await _line(reader, what, "status line", HEAD_MAX)
        head_left -= len(status_line)
        m = _STATUS_LINE.match(status_line)
        if m is None:
            raise ProbeFailed(f"{what}: malformed answer {status_line[:60]!r} (not an HTTP/1 status line)")
        status = int(m.group(1))
        at.part = "in the headers"
        length, chunked, head_left = await _headers(reader, what, head_left)
        if not 100 <= status < 200 or status == 101:
            break
        at.part = "waiting for the answer after an interim one"
    else:
        raise ProbeFailed(f"{what}: more than {INTERIM_MAX} interim (1xx) answers")
    cap = read_body(status) if callable(read_body) else read_body
    if cap <= 0 or head_only or status in (101, 204, 304):
        return HttpAnswer(status, b"")
    at.part = "in the body"
    if chunked:
        data = await _chunked(reader, what, cap, body_exact)
    elif length is not None:
        data = await _sized(reader, what, length, cap, body_exact)
    else:
        data = await _to_eof(reader, what, cap, body_exact)
    return HttpAnswer(status, data)


async def _line(reader: asyncio.StreamReader, what: str, part: str, limit: int) -> bytes:
    """One line, ending in LF; `part` ("status line", "header line", ...) named when it is
    too long or cut short."""
    named = "the status line" if part == "status line" else f"a {part}"
    try:
        line = await reader.readline()
    except ValueError:  # asyncio's line limit (HEAD_MAX): the line is not read
        raise ProbeFailed(f"{what}: {named} over {HEAD_MAX // 1024} KiB") from None
    if not line.endswith(b"\n"):
        where = f"after {len(line)} bytes of {named}" if line else f"before {named}"
        raise ProbeFailed(f"{what}: answer cut short: the connection closed {where}")
    if len(line) > limit:
        raise ProbeFailed(f"{what}: {named} over {limit} bytes")
    return line


async def _headers(reader: asyncio.StreamReader, what: str, left: int) -> tuple[int | None, bool, int]:
    """The header lines up to the blank one: (Content-Length, chunked, head bytes left)."""
    length: int | None = None
    chunked = False
    while True:
        if left <= 0:
            raise ProbeFailed(f"{what}: headers over {HEAD_MAX // 1024} KiB")
        line = await _line(reader, what, "header line", HEAD_MAX)
        left -= len(line)
        if left < 0:
            raise ProbeFailed(f"{what}: headers over {HEAD_MAX // 1024} KiB")
        if line in (b"\r\n", b"\n"):
            return length, chunked, left
        name, colon, value = line.partition(b":")
        if not colon or not _HEADER_NAME.match(name):  # also a folded line (leading space)
            raise ProbeFailed(f"{what}: malformed header line {line[:60]!r}")
        name, value = name.lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or len(value) > 15:  # bytes.isdigit: ASCII digits only
                raise ProbeFailed(f"{what}: malformed Content-Length {value[:40]!r}")
            if length is not None and length != int(value):
                raise ProbeFailed(f"{what}: two Content-Lengths ({length} and {int(value)})")
            length = int(value)
        elif name == b"transfer-encoding":
            # The last coding says how the body ends: chunked, or (anything else) at EOF.
            chunked = value.rsplit(b",", 1)[-1].strip().lower() == b"chunked"


def _too_big(what: str, cap: int) -> BodyTooLarge:
    return BodyTooLarge(f"{what}: body over {cap} bytes")


async def _exactly(reader: asyncio.StreamReader, n: int, what: str, whole: str) -> bytes:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        raise ProbeFailed(f"{what}: answer cut short: {whole} ended after {len(exc.partial)} of "
                          f"{exc.expected} bytes (the connection closed)") from None


async def _chunked(reader: asyncio.StreamReader, what: str, cap: int, exact: bool) -> bytes:
    out = bytearray()
    framing_left = HEAD_MAX + cap  # size lines and CRLFs: bounded like the data
    while True:
        size_line = await _line(reader, what, "chunk-size line", framing_left)
        framing_left -= len(size_line)
        m = _CHUNK_SIZE.match(size_line)
        if m is None:
            raise ProbeFailed(f"{what}: malformed chunk size {size_line[:40]!r}")
        size = int(m.group(1), 16)
        if size == 0:
            return bytes(out)  # trailers, if any, are not read: the connection closes
        if len(out) + size > cap:
            if exact:
                raise _too_big(what, cap)
            out += await _exactly(reader, cap - len(out), what, "a chunk")
            return bytes(out)
        out += await _exactly(reader, size, what, "a chunk")
        end = await _line(reader, what, "chunk's end", framing_left)
        framing_left -= len(end)
        if end not in (b"\r\n", b"\n"):
            raise ProbeFailed(f"{what}: malformed chunk: {size} bytes announced, more sent ({end[:40]!r})")


async def _sized(reader: asyncio.StreamReader, what: str, length: int, cap: int, exact: bool) -> bytes:
    if length > cap:
        if exact:
            raise _too_big(what, cap)
        return await _exactly(reader, cap, what, f"the body (Content-Length {length})")
    return await _exactly(reader, length, what, "the body")


async def _to_eof(reader: asyncio.StreamReader, what: str, cap: int, exact: bool) -> bytes:
    if not exact:
        return (await reader.read(cap))[:cap]  # what has come: a snippet
    buf = bytearray()  # to EOF, in pieces, for at most cap bytes
    while len(buf) <= cap:
        piece = await reader.read(65536)
        if not piece:
            return bytes(buf)
        buf += piece
    raise _too_big(what, cap)


async def http_status(url: str, timeout: float, method: str = "GET") -> int:
    """One HTTP request (GET, or POST with an empty body); returns the status code.
    ProbeFailed when there is no answer (refused, timed out, malformed)."""
    return (await http_request(url, timeout, method=method)).status


async def http_probe(url: str, timeout: float) -> int:
    """GET url; success is a 2xx answer. Returns the status code."""
    status = await http_status(url, timeout)
    if not 200 <= status < 300:
        raise ProbeFailed(f"GET {url} answered {status}")
    return status


async def http_check(url: str, timeout: float, *, method: str, body: str, headers: tuple[tuple[str, str], ...],
                     accepts: Callable[[int], bool], expect: tuple[int, ...]) -> int:
    """The http form of liveness: send the request, pass when `accepts(status)`. A failure's
    reason names the method, the URL, the status and what the body began with."""
    answer = await http_request(url, timeout, method=method, body=body.encode(), headers=headers,
                                read_body=lambda status: 0 if accepts(status) else SNIPPET)
    if accepts(answer.status):
        return answer.status
    wanted = ", ".join(map(str, expect)) if expect else "2xx"
    text = answer.body.decode("utf-8", "replace").strip().replace("\n", " ")
    raise ProbeFailed(f"{method} {url} answered {answer.status} (expected {wanted})" + (f": {text}" if text else ""))
