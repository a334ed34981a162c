"""A unit for the probe tests (tests/test_probes.py) that behaves like an inference engine
as omnid sees it: an HTTP server (asyncio, no framework) with /health, /ready, /metrics
(Prometheus text) and POST /v1/completions, and a worker child process whose output is
the "generation": every line it writes is a token. SIGSTOP of the worker hangs generation
while /health stays 200 -- the hang a real engine shows.

Controlled through a JSON file (read at every request and every tick):
  {"ready": 200 | 503 | "hang", "gen": "ok" | "500" | "hang", "busy": N, "reset": K}
busy: requests "running" (the gauge); tokens count only while busy > 0. reset: each new
value of K sets the token counter back to 0 (an engine whose metrics restarted).
Writes DIR/worker.pid, and DIR/stats.json: the most requests each path had in flight at
once (a connection counts from accept until the client closes it), and the last POST seen.
"""

import asyncio
import json
import os
import subprocess
import sys
import time

if sys.argv[1] == "--worker":
    while True:  # one token every 20 ms
        sys.stdout.write("t\n")
        sys.stdout.flush()
        time.sleep(0.02)

port, ctl_path, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
tokens = 0
last_reset = None
inflight: dict[str, int] = {}
stats = {"max_inflight": {}, "requests": {}, "post": None}


def ctl() -> dict:
    try:
        with open(ctl_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save() -> None:
    tmp = os.path.join(out_dir, "stats.json.tmp")
    with open(tmp, "w") as f:
        json.dump(stats, f)
    os.replace(tmp, os.path.join(out_dir, "stats.json"))


def metrics() -> bytes:
    c = ctl()
    busy = int(c.get("busy", 0))
    return (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        f'vllm:generation_tokens_total{{engine="0",model_name="tiny \\"llama\\", {{v1}}"}} {tokens}.0\n'
        f'vllm:generation_tokens_total{{engine="1",model_name="other"}} 0.0 {int(time.time() * 1000)}\n'
        'vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e9\n'
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0"}} {busy}.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        "vllm:kv_cache_usage_perc NaN\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf"} 0\n'
    ).encode()


async def answer(writer, status: int, body: bytes = b"") -> None:
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()


async def handle(reader, writer) -> None:
    path = "?"
    try:
        line = await reader.readline()
        parts = line.decode().split()
        if len(parts) < 2:
            return
        method, path = parts[0], parts[1]
        inflight[path] = inflight.get(path, 0) + 1
        stats["requests"][path] = stats["requests"].get(path, 0) + 1
        stats["max_inflight"][path] = max(stats["max_inflight"].get(path, 0), inflight[path])
        save()
        headers = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        c = ctl()
        if path == "/ready" and c.get("ready", 200) == "hang" or path == "/v1/completions" and c.get("gen") == "hang":
            await reader.read()  # until the client gives up and closes
            return
        if path == "/metrics":
            await answer(writer, 200, metrics())
        elif path == "/ready":
            await answer(writer, int(c.get("ready", 200)), b'{"ready": false}' if c.get("ready", 200) != 200 else b"")
        elif path == "/v1/completions" and method == "POST":
            stats["post"] = {"body": body.decode(), "headers": headers}
            save()
            if c.get("gen") == "500":
                await answer(writer, 500, b'{"error": "EngineCore died"}')
            else:
                await answer(writer, 200, b'{"choices": [{"text": "x"}]}')
        else:
            await answer(writer, 200, b"ok")
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        if path in inflight:
            inflight[path] -= 1
        writer.close()


async def count_tokens(worker) -> None:
    global tokens, last_reset
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), worker.stdout)
    while await reader.readline():
        c = ctl()
        if c.get("reset") != last_reset:
            last_reset = c.get("reset")
            tokens = 0
        if int(c.get("busy", 0)) > 0:
            tokens += 1


async def main() -> None:
    worker = subprocess.Popen([sys.executable, __file__, "--worker"], stdout=subprocess.PIPE)
    with open(os.path.join(out_dir, "worker.pid"), "w") as f:
        f.write(str(worker.pid))
    save()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await count_tokens(worker)


asyncio.run(main())
