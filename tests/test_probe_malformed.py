"""FM-39: a unit's probe or progress scrape gets a malformed answer (a chunk size of -1, a
70 KiB header line, a body cut short, over the cap, trickled past the deadline, a status
line that is not HTTP's, random bytes): a probe failure whose reason names the
malformation; never "internal error", never a traceback.

Every answer comes from a real TCP server on 127.0.0.1 (asyncio, raw bytes written as
given); omnid.core.probes.http_request (the one door of liveness, readiness, the drain hook,
the progress scrape and its canary) reads it. Hypothesis then feeds the reader what an
attacker would, and promtext's reader what a hostile page holds. The last tests run a real
daemon whose unit's liveness and progress scrape meet such answers."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnid.base import promtext
from omnid.core import probes, progress
from omnid.model.unitmodel import Progress
from tests.harness import alive, free_port, make_stack, wait_for

PY = sys.executable
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def canned(data: bytes) -> Script:
    async def send(w: asyncio.StreamWriter) -> None:
        w.write(data)
        await w.drain()
    return send


async def _probe(answer: Script, timeout: float, read_body: int,
                 exact: bool) -> probes.HttpAnswer | probes.ProbeFailed:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.readuntil(b"\r\n\r\n")  # the request's head: it answers after it, as servers do
            await answer(w)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the probe hung up first (its cap, its deadline)
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await probes.http_request(f"http://127.0.0.1:{port}/metrics", timeout, read_body=read_body,
                                         body_exact=exact)
    except probes.ProbeFailed as exc:
        return exc
    finally:
        server.close()
        await server.wait_closed()


def probe(answer: bytes | Script, timeout: float = 2.0, read_body: int = 4096,
          exact: bool = True) -> tuple[probes.HttpAnswer | probes.ProbeFailed, float]:
    """(the answer or the failure, seconds taken). Anything else raised fails the test."""
    script = canned(answer) if isinstance(answer, bytes) else answer
    t0 = time.monotonic()
    got = asyncio.run(_probe(script, timeout, read_body, exact))
    return got, time.monotonic() - t0


def failure(answer: bytes | Script, **kw) -> str:
    got, _ = probe(answer, **kw)
    assert isinstance(got, probes.ProbeFailed), f"expected a probe failure, got {got!r}"
    return str(got)


HEAD = b"HTTP/1.1 200 OK\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"


# ------------------------------------------------------------------ each malformation, named
@pytest.mark.parametrize("answer, words", [
    (CHUNKED + b"-1\r\nabc\r\n0\r\n\r\n", "malformed chunk size b'-1\\r\\n'"),
    (CHUNKED + b"0x10\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "malformed chunk size b'0x10\\r\\n'"),
    (CHUNKED + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "malformed chunk size b'1_0\\r\\n'"),
    (CHUNKED + b"f" * 70 * 1024 + b"\r\n", "a chunk-size line over 64 KiB"),
    (CHUNKED + b"3\r\nabcdef\r\n0\r\n\r\n", "malformed chunk: 3 bytes announced, more sent"),
    (CHUNKED + b"a\r\nabc", "answer cut short: a chunk ended after 3 of 10 bytes"),
    (HEAD + b"X-Big: " + b"x" * 70 * 1024 + b"\r\n\r\n", "a header line over 64 KiB"),
    (HEAD + b"X-A: b\r\n" * 10000 + b"\r\n", "headers over 64 KiB"),
    (b"HTTP/1.1 200 " + b"x" * 70 * 1024 + b"\r\n\r\n", "status line over 64 KiB"),
    (HEAD + b"Content-Length: 100\r\n\r\nonly this", "answer cut short: the body ended after 9 of 100 bytes"),
    (HEAD + b"Content-Length: -1\r\n\r\n", "malformed Content-Length b'-1'"),
    (HEAD + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", "two Content-Lengths (3 and 4)"),
    (HEAD + b"Bad Header: x\r\n\r\n", "malformed header line b'Bad Header: x\\r\\n'"),
    (HEAD + b" folded\r\n\r\n", "malformed header line b' folded\\r\\n'"),
    (HEAD + b"Content-Length: 5000\r\n\r\n" + b"a" * 5000, "body over 4096 bytes"),
    (HEAD + b"\r\n" + b"a" * 5000, "body over 4096 bytes"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "malformed answer b'SSH-2.0-OpenSSH_9.6\\r\\n' (not an HTTP/1 status line)"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed answer b'HTTP/1.1 2000 OK\\r\\n'"),
    (b"\x00\xff\xfe garbage", "answer cut short: the connection closed after 11 bytes of the status line"),
    (b"", "answer cut short: the connection closed before the status line"),
    (HEAD + b"Content-Length: 3\r\n", "answer cut short: the connection closed before a header line"),
    (b"HTTP/1.1 100 Continue\r\n\r\n" * 9 + HEAD + b"\r\n", "more than 8 interim (1xx) answers"),
])
def test_a_malformed_answer_is_a_probe_failure_that_names_it(answer, words):
    why = failure(answer)
    assert why.startswith("GET http://127.0.0.1:") and words in why, why
    assert "unreadable answer" not in why, why  # named, not caught by the reader's last net


def test_well_formed_answers_are_read_whole():
    """The reader still reads what servers send: chunked (with an extension and trailers),
    sized, to EOF, after interim answers, HTTP/1.0, bare LF line ends."""
    cases = [
        (CHUNKED + b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n", b"abcde"),
        (HEAD + b"Content-Length: 4\r\nContent-Length: 4\r\n\r\nabcd", b"abcd"),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200\r\n\r\nto the end", b"to the end"),
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", b"ok"),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", b""),
    ]
    for answer, body in cases:
        got, _ = probe(answer)
        assert isinstance(got, probes.HttpAnswer) and got.body == body, (answer[:60], got)


def test_a_body_over_the_cap_is_cut_for_a_snippet_and_refused_when_exact():
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"800\r\n" + b"a" * 0x800 + b"\r\n0\r\n\r\n"
    got, _ = probe(answer, read_body=100, exact=False)
    assert isinstance(got, probes.HttpAnswer) and got.body == b"a" * 100, got
    assert "body over 100 bytes" in failure(answer, read_body=100, exact=True)


def test_an_endless_body_ends_at_the_cap_not_at_the_deadline():
    """An exporter that never stops sending: the probe stops at its cap, long before its
    deadline, and closes the connection (the server's writes then fail)."""
    written = [0]

    async def endless(w: asyncio.StreamWriter) -> None:
        w.write(HEAD + b"\r\n")
        while True:
            w.write(b"# HELP x y\n" * 6000)
            written[0] += 66000
            await w.drain()

    cap = 1 << 20
    got, took = probe(endless, timeout=20, read_body=cap)
    assert isinstance(got, probes.BodyTooLarge) and f"body over {cap} bytes" in str(got), got
    assert took < 5, f"{took:.2f} s: the cap, not the 20 s deadline, should end it"
    print(f"\nendless body: refused over {cap} bytes after {took * 1000:.0f} ms; the server had written "
          f"{written[0] / 1e6:.1f} MB when its writes failed (the rest sat in socket buffers)")


def test_endless_headers_end_at_the_head_cap():
    async def endless(w: asyncio.StreamWriter) -> None:
        w.write(HEAD)
        while True:
            w.write(b"X-More: yes\r\n" * 1000)
            await w.drain()

    got, took = probe(endless, timeout=20)
    assert isinstance(got, probes.ProbeFailed) and "headers over 64 KiB" in str(got), got
    assert took < 5, took


@pytest.mark.parametrize("where, start, words", [
    ("body", HEAD + b"Content-Length: 1000\r\n\r\n", "timed out after 0.5 s in the body"),
    ("headers", HEAD + b"X-Slow: ", "timed out after 0.5 s in the headers"),
    ("status line", b"HTTP/1.1 2", "timed out after 0.5 s waiting for the answer"),
])
def test_an_answer_trickled_past_the_deadline_times_out_naming_where(where, start, words):
    """A byte every 20 ms: each read gets something, none gets the whole; the probe's one
    deadline covers the exchange as a whole, not each read."""
    async def trickle(w: asyncio.StreamWriter) -> None:
        w.write(start)
        await w.drain()
        while True:
            await asyncio.sleep(0.02)
            w.write(b"a")
            await w.drain()

    got, took = probe(trickle, timeout=0.5, read_body=4096)
    assert isinstance(got, probes.ProbeTimedOut) and words in str(got), got
    assert 0.45 <= took < 2.0, took
    print(f"\ntrickle in the {where}: {got} after {took:.2f} s")


def test_an_unexpected_error_in_the_reader_is_a_probe_failure(monkeypatch):
    """The reader's last net: a gap in it is this probe's failure with the error named, not
    the monitor's crash (the unit's 'internal error')."""
    async def broken(*_a, **_kw):
        raise IndexError("a gap in the reader")

    monkeypatch.setattr(probes, "read_answer", broken)
    why = failure(HEAD + b"\r\n")
    assert why.endswith(": unreadable answer (IndexError: a gap in the reader)"), why


# ------------------------------------------------------------------ what an attacker sends
_STATUS = st.one_of(st.sampled_from([b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 500 Oops\r\n", b"HTTP/1.0 204\r\n"]),
                    st.binary(max_size=40).map(lambda b: b + b"\r\n"))
_HEADER = st.one_of(
    st.sampled_from([b"Transfer-Encoding: chunked", b"Content-Length: 5", b"Content-Length: -1",
                     b"Content-Length: 99999999999999999999", b"Transfer-Encoding: gzip, chunked",
                     b"Content-Length: \xd9\xa3"]),
    st.binary(max_size=30)).map(lambda b: b + b"\r\n")
_CHUNK = st.one_of(
    st.binary(max_size=12).map(lambda b: b"%x\r\n%s\r\n" % (len(b), b)),
    st.sampled_from([b"-1", b"-0", b"+3", b" 3", b"1_0", b"0x3", b"f" * 20, b"3;a=b", b"\xd9\xa3"]).map(
        lambda size: size + b"\r\nabc\r\n"),
    st.text(alphabet="0123456789abcdefABCDEFxX-+_ ;=\t\r\n\x00\u0663", max_size=12).map(
        lambda t: t.encode() + b"\r\nabc\r\n"),
    st.binary(max_size=20))


@st.composite
def hostile_answer(draw) -> bytes:
    """Random bytes, or an answer built of parts that are mostly HTTP, each of which may be
    wrong (a status line, header lines, chunks, the last chunk)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=300))
    head = draw(_STATUS) + b"".join(draw(st.lists(_HEADER, max_size=4))) + draw(st.sampled_from([b"\r\n", b""]))
    return head + b"".join(draw(st.lists(_CHUNK, max_size=4))) + draw(st.sampled_from([b"0\r\n\r\n", b""]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=hostile_answer(), read_body=st.sampled_from([0, 1, 7, 4096]), exact=st.booleans())
def test_no_answer_raises_anything_but_a_probe_failure_with_its_reason(answer, read_body, exact):
    got, _ = probe(answer, timeout=2.0, read_body=read_body, exact=exact)
    if isinstance(got, probes.ProbeFailed):
        why = str(got)
        assert why.startswith("GET http://127.0.0.1:") and "unreadable answer" not in why, why
        assert "timed out" not in why, why  # every such answer ends with the connection: no wait
    else:
        assert len(got.body) <= read_body, (answer, got)


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=3000), cuts=st.lists(st.integers(1, 3000), max_size=6))
def test_any_body_chunked_any_way_reads_back_the_same(body, cuts):
    pieces, at = [], 0
    for c in sorted(set(cuts)):
        if at < c <= len(body):
            pieces.append(body[at:c])
            at = c
    pieces.append(body[at:])
    answer = CHUNKED + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    got, _ = probe(answer, read_body=4096)
    assert isinstance(got, probes.HttpAnswer) and got.body == body, got


_PAGE_LINE = st.one_of(
    st.text(max_size=60),
    st.builds(lambda n, lab, v: f"{n}{lab} {v}", st.sampled_from(["tok_total", "busy", "x", "{", ""]),
              st.text(alphabet='{}=",\\ a1n\n', max_size=20),
              st.sampled_from(["1", "NaN", "+Inf", "-1e400", "1e999", "0x10", "1_0", "", "nan(1)"])))


@settings(max_examples=400, deadline=None)
@given(lines=st.lists(_PAGE_LINE, max_size=8))
def test_a_hostile_metrics_page_is_read_or_refused_naming_the_line(lines):
    text = "\n".join(lines)
    try:
        got = promtext.sums(text, ["tok_total", "busy"])
    except promtext.MalformedExposition as exc:
        assert str(exc).startswith("line "), exc
    else:
        assert set(got) == {"tok_total", "busy"}


def test_a_scrape_of_a_hostile_page_is_a_probe_failure_naming_it():
    """progress.scrape: a malformed answer or page is ProbeFailed with its reason, whatever the
    parse of the page raises."""
    async def run(answer: bytes) -> str:
        async def serve(r, w):
            await r.readuntil(b"\r\n\r\n")
            w.write(answer)
            await w.drain()
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        rule = Progress(metrics=f"http://127.0.0.1:{port}/metrics", counter="tok_total", busy=("busy",),
                        stall_sec=10, interval=1)
        try:
            await progress.scrape(rule)
        except probes.ProbeFailed as exc:
            return str(exc)
        finally:
            server.close()
            await server.wait_closed()
        raise AssertionError(f"{answer[:60]!r} was read as a page")

    why = asyncio.run(run(CHUNKED + b"-1\r\n"))
    assert why.endswith(": malformed chunk size b'-1\\r\\n'"), why
    why = asyncio.run(run(HEAD + b"\r\ntok_total{a=\"1\" 2\n"))
    assert "not Prometheus text: line 1: labels not closed by '}'" in why, why


# ------------------------------------------------------------------ a real daemon
SERVER = r'''
import asyncio, json, sys
port, mode, state = int(sys.argv[1]), sys.argv[2], sys.argv[3]
scrapes = 0
HEAD = b"HTTP/1.1 200 OK\r\n"
def malformed(path):
    if mode == "chunk":  # a failing answer, so liveness reads its body: a chunk size of -1
        return b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n"
    return HEAD + b"X-Big: " + b"x" * 70 * 1024 + b"\r\n\r\n"  # mode "header"
async def serve(r, w):
    global scrapes
    try:
        line = await r.readline()
        await r.readuntil(b"\r\n\r\n")
        path = line.split()[1].decode()
        if path == "/health":
            w.write(HEAD + b"Content-Length: 2\r\n\r\nok")
        elif path == "/metrics":
            scrapes += 1
            if scrapes <= 3:  # busy, the counter moving; then a chunk size of -1 for ever
                page = f"tok_total {scrapes}\nbusy 1\n".encode()
                w.write(HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(page), page))
            else:
                w.write(HEAD + b"Transfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n")
        else:
            w.write(malformed(path))
        with open(state, "w") as f:
            json.dump({"scrapes": scrapes}, f)
        await w.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        w.close()
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()
asyncio.run(main())
'''


def _daemon_said_nothing_internal(d) -> None:
    log = d.log()
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("mode, words", [
    ("chunk", "malformed chunk size b'-1\\r\\n'"),
    ("header", "a header line over 64 KiB"),
])
def test_liveness_meeting_a_malformed_answer_fails_the_unit_naming_it(tmp_path, daemon_factory, mode, words):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d = daemon_factory(make_stack({"eng": f"""exec = {json.dumps([PY, str(script), str(port), mode, str(tmp_path / 'st')])}
ready = {{ http = "{url}/health" }}
liveness = {{ http = "{url}/live", interval = 0.2, timeout = 1, failures = 2 }}
stop_timeout = 2
"""}))
    u = wait_for(lambda: (x := d.unit("eng"))["state"] == "failed" and x, 15,
                 lambda: f"eng to fail its liveness probe: {d.unit('eng')}\n{d.log()[-2000:]}")
    pid = d.logged_pid("eng", "active")  # active first (liveness runs there): ~0.4 s, maybe over before a look
    assert u["reason"].startswith(f"liveness: GET {url}/live: {words} (2/2)"), u["reason"]  # then its stacks
    assert not alive(pid)
    _daemon_said_nothing_internal(d)
    print(f"\n{mode}: {u['reason']}")


def test_progress_scrape_meeting_a_chunk_size_of_minus_one_names_it_in_the_stall(tmp_path, daemon_factory):
    """The issue's case: an exporter answering /metrics with a chunk size of -1 while work
    waits. The scrape fails with that reason, the stall rule counts it as no progress, and
    the unit is failed for a stall whose reason carries it; the daemon reports no error of
    its own."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    d = daemon_factory(make_stack({"eng": f"""exec = {json.dumps([PY, str(script), str(port), "chunk", str(tmp_path / 'st')])}
ready = {{ http = "{url}/health" }}
progress = {{ metrics = "{url}/metrics", counter = "tok_total", busy = ["busy"], stall_sec = 1, interval = 0.2 }}
stop_timeout = 2
capture_timeout = 2
"""}))
    u = wait_for(lambda: (x := d.unit("eng"))["state"] == "failed" and x, 20,
                 lambda: f"eng to fail for a stall: {d.unit('eng')}\n{d.log()[-2000:]}")
    pid = d.logged_pid("eng", "active")  # active first (progress is judged there): ~2 s, maybe over before a look
    assert u["reason"].startswith("progress: tok_total stuck at 3 for "), u["reason"]
    assert (f"while busy = 1; metrics unreadable (GET {url}/metrics: malformed chunk size b'-1\\r\\n')"
            in u["reason"]), u["reason"]
    assert not alive(pid)
    said = [e for e in d.log_events() if e.get("event") == "progress: metrics scrape failed"]
    assert said and said[0]["error"] == f"GET {url}/metrics: malformed chunk size b'-1\\r\\n'", said
    _daemon_said_nothing_internal(d)
    print(f"\nprogress: {u['reason']}")



def test_a_page_near_the_cap_is_parsed_off_the_loop():
    """A page just under SCRAPE_MAX_BYTES took promtext.sums ~1.5 s on the loop (every death
    the daemon sees waits that long). It is parsed on a worker thread: the loop goes on."""
    line = b'vllm:some_histogram_bucket{model_name="m",le="0.5"} 12.5\n'
    page = line * ((progress.SCRAPE_MAX_BYTES - 100) // len(line)) + b"tok_total 7\n"

    async def run() -> tuple[tuple, float, float]:
        async def serve(r, w):
            await r.readuntil(b"\r\n\r\n")
            w.write(HEAD + b"Content-Length: %d\r\n\r\n" % len(page) + page)
            await w.drain()
            w.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        rule = Progress(metrics=f"http://127.0.0.1:{port}/metrics", counter="tok_total", busy=("busy",),
                        stall_sec=10, interval=5)
        gaps = [0.0]
        done = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        t0 = time.monotonic()
        try:
            got = await progress.scrape(rule)
        finally:
            took = time.monotonic() - t0
            done.set()
            await ticker
            server.close()
            await server.wait_closed()
        return got, took, max(gaps)

    got, took, gap = asyncio.run(run())
    assert got == (7.0, {"busy": None}), got
    # Parsed on the loop, the loop would stand still for about the whole scrape (1.5 s quiet,
    # 7.9 s at load 26); off it, its longest wait is the scheduler's (515 ms was seen at load
    # 26 while the scrape took 7.9 s): bounded by a quarter of the scrape, and 0.5 s when quiet.
    assert gap < max(0.5, took / 4), f"the loop stood still for {gap * 1000:.0f} ms during a {took:.2f} s scrape"
    print(f"\n{len(page) / 1e6:.1f} MB page: scraped in {took:.2f} s; the loop's longest wait {gap * 1000:.0f} ms")


def test_a_page_of_tiny_lines_is_read_a_block_at_a_time():
    """8 MiB of 3-byte lines: split whole (splitlines) it was ~170 MB of strings before the
    first line was judged; read a block at a time, the first bad line ends it at once."""
    import tracemalloc

    text = "ab\n" * ((8 << 20) // 3)
    tracemalloc.start()
    try:
        with pytest.raises(promtext.MalformedExposition, match="^line 1: no value: 'ab'"):
            promtext.sums(text, ["tok_total"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 1e6:.0f} MB held to read the first line"
    many = "x 1\n" * 70000 + "x{\n"  # the line number counts across blocks
    with pytest.raises(promtext.MalformedExposition, match="^line 70001: labels not closed"):
        promtext.sums(many, ["x"])
    print(f"\n8 MiB page of tiny lines: {peak / 1e6:.1f} MB peak to refuse it")
