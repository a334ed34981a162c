"""What one HTTP probe costs the daemon: omnid.core.probes.http_request (the probes' and the
progress scrape's one door) against the ways aiohttp's client could do the same request.

A probe runs every `interval` for every unit, on the loop that sees deaths, so its CPU time
is what counts. The server is another process (aiohttp.web on 127.0.0.1), so the figures are
the client's alone: CPU time (time.process_time) and wall time per request, medians of
rounds interleaved between the variants (the machine is shared; interleaving keeps the load
the same for each). Two pages: /health (an empty 200) and /metrics (a vLLM-sized page,
~20 KB, read whole under the scrape's cap).

Variants:
- probes:   omnid.core.probes.http_request as it is in this checkout;
- shared:   one aiohttp.ClientSession for every probe, TCPConnector(force_close=True)
            (a fresh connection per probe, as a probe must prove), body read with a cap;
- pooled:   the same with keep-alive (a deliberate pool), for reference only;
- session:  a new ClientSession (and connector) per probe, closed after it;
- baseline: with --baseline FILE, the http_request of another probes.py (e.g. an older one:
            git show REV:omnid/core/probes.py > /tmp/probes_old.py), for before/after.

Run: .venv/bin/python -m bench.probe_numbers [--rounds 15] [--per-round 100] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from omnid.core import probes  # noqa: E402

CAP = 8 << 20

SERVER = r"""
import sys
from aiohttp import web
page = "".join(f'vllm:metric_{i}{{model_name="m",engine="0"}} {i}.5\n' for i in range(400)).encode()
async def health(_):
    return web.Response(body=b"")
async def metrics(_):
    return web.Response(body=page, content_type="text/plain")
app = web.Application()
app.add_routes([web.get("/health", health), web.get("/metrics", metrics)])
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=lambda *a: print("up", flush=True),
            access_log=None)
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def aiohttp_get(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
        return await r.content.read(CAP)


def session_for(force_close: bool) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=force_close),
                                 auto_decompress=False, skip_auto_headers=("Accept-Encoding",),
                                 headers={"User-Agent": "omnid-probe"})


def load_baseline(path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("probes_baseline", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def run(rounds: int, per_round: int, port: int,
              baseline=None) -> dict[tuple[str, str], list[tuple[float, float]]]:
    shared, pooled = session_for(True), session_for(False)

    async def v_probes(url: str) -> bytes:
        return (await probes.http_request(url, 2, read_body=CAP, body_exact=True)).body

    async def v_shared(url: str) -> bytes:
        return await aiohttp_get(shared, url)

    async def v_pooled(url: str) -> bytes:
        return await aiohttp_get(pooled, url)

    async def v_session(url: str) -> bytes:
        async with session_for(True) as s:
            return await aiohttp_get(s, url)

    variants = {"probes": v_probes, "shared": v_shared, "pooled": v_pooled, "session": v_session}
    if baseline is not None:
        async def v_baseline(url: str) -> bytes:
            return (await baseline.http_request(url, 2, read_body=CAP, body_exact=True)).body
        variants["baseline"] = v_baseline
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for path in ("/health", "/metrics"):
            url = f"http://127.0.0.1:{port}{path}"
            for fn in variants.values():  # warm up: imports, first connections
                for _ in range(20):
                    await fn(url)
            for _ in range(rounds):
                for name, fn in variants.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(per_round):
                        await fn(url)
                    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                    out.setdefault((name, path), []).append((cpu / per_round * 1e6, wall / per_round * 1e6))
    finally:
        await shared.close()
        await pooled.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--baseline", help="another probes.py to compare (before/after)")
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up", "the server did not start"
        got = asyncio.run(run(args.rounds, args.per_round, port,
                              load_baseline(args.baseline) if args.baseline else None))
    finally:
        server.terminate()
        server.wait(10)
    print(f"aiohttp {aiohttp.__version__}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
          f"{args.rounds} rounds x {args.per_round} requests, medians per request")
    print(f"{'variant':<10} {'path':<9} {'CPU us':>8} {'wall us':>8}")
    for (name, path), xs in got.items():
        print(f"{name:<10} {path:<9} {statistics.median(c for c, _ in xs):8.0f} "
              f"{statistics.median(w for _, w in xs):8.0f}")


if __name__ == "__main__":
    main()
