"""Readiness and liveness probes: HTTP requests and TCP connects, each bounded in time
(omnid.unit(5), keys `ready`, `liveness` and `progress`). Plain asyncio streams: no client
library threads, no resolver thread (numeric hosts are used as given). An answer's body
is read only when the caller asks for it, and never past the cap it gives."""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

HEAD_MAX = 64 * 1024  # an answer's status line and headers, at most
SNIPPET = 200  # bytes of a failing answer's body quoted in its reason


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

    async def go() -> HttpAnswer:
        reader, writer = await asyncio.open_connection(host, port, limit=HEAD_MAX)
        if on_connected is not None:
            on_connected()
        try:
            writer.write(request)
            await writer.drain()
            try:
                status_line = await reader.readline()
            except ValueError as exc:  # asyncio's line limit
                raise ProbeFailed(f"{what}: status line over {HEAD_MAX // 1024} KiB") from exc
            fields = status_line.split()
            if len(fields) < 2 or not fields[1].isdigit():
                raise ProbeFailed(f"{what}: malformed answer {status_line[:60]!r}")
            status = int(fields[1])
            cap = read_body(status) if callable(read_body) else read_body
            data = await _read_body(reader, cap, body_exact, what) if cap > 0 else b""
            return HttpAnswer(status, data)
        finally:
            writer.close()  # the transport is aborted with the task on a timeout: no fd kept

    try:
        return await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError as exc:
        raise ProbeTimedOut(f"{what} timed out after {timeout:g} s") from exc
    except asyncio.IncompleteReadError as exc:
        raise ProbeFailed(f"{what}: answer cut short ({len(exc.partial)} bytes of a part)") from exc
    except OSError as exc:
        raise ProbeFailed(f"{what}: {exc.strerror or exc}") from exc


async def _read_body(reader: asyncio.StreamReader, cap: int, exact: bool, what: str) -> bytes:
    length: int | None = None
    chunked = False
    while True:
        try:
            line = await reader.readline()
        except ValueError as exc:
            raise ProbeFailed(f"{what}: a header line over {HEAD_MAX // 1024} KiB") from exc
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip()
        if name == "content-length" and value.isdigit():
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True

    def too_big() -> BodyTooLarge:
        return BodyTooLarge(f"{what}: body over {cap} bytes")

    if chunked:
        out = bytearray()
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";")[0].strip() or b"x", 16)
            except ValueError as exc:
                raise ProbeFailed(f"{what}: malformed chunk size {size_line[:40]!r}") from exc
            if size == 0:
                return bytes(out)
            if len(out) + size > cap:
                if exact:
                    raise too_big()
                out += await reader.readexactly(cap - len(out))
                return bytes(out)
            out += await reader.readexactly(size)
            await reader.readline()  # the CRLF after a chunk
    if length is not None:
        if length > cap:
            if exact:
                raise too_big()
            return await reader.readexactly(cap)
        return await reader.readexactly(length)
    if not exact:
        return (await reader.read(cap))[:cap]  # what has come: a snippet
    buf = bytearray()  # to EOF, in pieces, for at most cap bytes
    while len(buf) <= cap:
        piece = await reader.read(65536)
        if not piece:
            return bytes(buf)
        buf += piece
    raise too_big()


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
