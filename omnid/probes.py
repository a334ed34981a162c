"""Readiness and liveness probes: HTTP GET and TCP connect, each bounded in time
(omnid.unit(5), keys `ready` and `liveness`). Plain asyncio streams: no client
library threads, no resolver thread (numeric hosts are used as given)."""

from __future__ import annotations

import asyncio
import urllib.parse


class ProbeFailed(Exception):
    """One probe attempt failed; the message is what an operator reads."""


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


async def http_probe(url: str, timeout: float) -> int:
    """GET url; success is a 2xx answer. Returns the status code."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    what = f"GET {url}"

    async def go() -> int:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUser-Agent: omnid-probe\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            await writer.drain()
            try:
                status_line = await reader.readline()
            except ValueError as exc:  # asyncio's 64 KiB line limit
                raise ProbeFailed(f"{what}: status line over 64 KiB") from exc
            fields = status_line.split()
            if len(fields) < 2 or not fields[1].isdigit():
                raise ProbeFailed(f"{what}: malformed answer {status_line[:60]!r}")
            return int(fields[1])
        finally:
            writer.close()

    try:
        status = await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError as exc:
        raise ProbeFailed(f"{what} timed out") from exc
    except OSError as exc:
        raise ProbeFailed(f"{what}: {exc.strerror or exc}") from exc
    if not 200 <= status < 300:
        raise ProbeFailed(f"{what} answered {status}")
    return status
