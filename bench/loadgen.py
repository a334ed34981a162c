"""Local load generators for the omnid-only figures (run as a separate process
so that the harness's own threads do not share its interpreter).

    python -m bench.loadgen http --port P [--path /health] [--conns C] [--duration S]
    python -m bench.loadgen zmq --endpoint ipc://PATH [--inflight K] [--duration S]

http: C keep-alive HTTP/1.1 connections in one asyncio loop, closed loop (each
connection sends its next request when the previous answer is complete).
zmq: one DEALER socket to the control ROUTER with K requests in flight, each
`{"id": N, "cmd": "status", "args": {}}`; an empty delimiter frame is sent
first, as a REQ socket would (the envelope is detected on the first request).

Prints one JSON object: requests, seconds, rps, latency percentiles (ms),
answer codes / errors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(lat_ms: list[float], seconds: float, extra: dict) -> dict:
    return {
        "requests": len(lat_ms),
        "seconds": round(seconds, 3),
        "rps": round(len(lat_ms) / seconds, 1) if seconds > 0 else None,
        "p50_ms": pct(lat_ms, 50), "p95_ms": pct(lat_ms, 95),
        "p99_ms": pct(lat_ms, 99), "max_ms": max(lat_ms) if lat_ms else None,
        **extra,
    }


# ---------------------------------------------------------------- http

async def http_conn(port: int, path: str, end: float, lat: list, codes: dict, errors: list) -> None:
    req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    reader = writer = None
    while time.monotonic() < end:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.perf_counter()
            writer.write(req)
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionError("closed")
            code = int(status_line.split()[1])
            length, close = 0, False
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                k, _, v = line.decode("latin-1").partition(":")
                k = k.strip().lower()
                if k == "content-length":
                    length = int(v.strip())
                elif k == "connection" and v.strip().lower() == "close":
                    close = True
            if length:
                await reader.readexactly(length)
            lat.append((time.perf_counter() - t0) * 1000)
            codes[code] = codes.get(code, 0) + 1
            if close:
                writer.close()
                writer = None
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, ConnectionError) as e:
            errors.append(repr(e)[:200])
            if writer is not None:
                writer.close()
            writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def run_http(a) -> dict:
    lat: list[float] = []
    codes: dict = {}
    errors: list = []
    t0 = time.monotonic()
    end = t0 + a.duration
    await asyncio.gather(*(http_conn(a.port, a.path, end, lat, codes, errors) for _ in range(a.conns)))
    return summary(lat, time.monotonic() - t0,
                   {"conns": a.conns, "codes": {str(k): v for k, v in codes.items()},
                    "errors": len(errors), "first_errors": errors[:3]})


# ---------------------------------------------------------------- zmq

def run_zmq(a) -> dict:
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(a.endpoint)
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)

    def send(i: int, envelope: bool) -> None:
        body = json.dumps({"id": i, "cmd": "status", "args": {}}).encode()
        s.send_multipart([b"", body] if envelope else [body])

    def recv(timeout_ms: int):
        if not poller.poll(timeout_ms):
            return None
        frames = s.recv_multipart()
        return json.loads(frames[-1])

    # detect the envelope the daemon expects (REQ-style first)
    envelope = None
    for env in (True, False):
        send(-1, env)
        r = recv(3000)
        if isinstance(r, dict) and r.get("id") == -1:
            envelope = env
            break
    if envelope is None:
        return {"error": "no reply to a status request", "requests": 0}

    lat: list[float] = []
    sent: dict[int, float] = {}
    errors = 0
    nxt = 0
    t0 = time.monotonic()
    end = t0 + a.duration
    for _ in range(a.inflight):
        sent[nxt] = time.perf_counter()
        send(nxt, envelope)
        nxt += 1
    while sent:
        r = recv(5000)
        if r is None:
            errors += len(sent)
            break
        now = time.perf_counter()
        rid = r.get("id")
        if rid in sent:
            lat.append((now - sent.pop(rid)) * 1000)
            if not r.get("ok"):
                errors += 1
        if time.monotonic() < end:
            sent[nxt] = time.perf_counter()
            send(nxt, envelope)
            nxt += 1
    seconds = time.monotonic() - t0
    s.close(0)
    ctx.term()
    return summary(lat, seconds, {"inflight": a.inflight, "errors": errors,
                                  "envelope": "req" if envelope else "dealer"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench.loadgen")
    sub = ap.add_subparsers(dest="mode", required=True)
    h = sub.add_parser("http")
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--path", default="/health")
    h.add_argument("--conns", type=int, default=16)
    h.add_argument("--duration", type=float, default=5)
    z = sub.add_parser("zmq")
    z.add_argument("--endpoint", required=True)
    z.add_argument("--inflight", type=int, default=1)
    z.add_argument("--duration", type=float, default=5)
    a = ap.parse_args(argv)
    out = asyncio.run(run_http(a)) if a.mode == "http" else run_zmq(a)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
