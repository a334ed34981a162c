"""Rolling restarts (`update = "rolling"`, `omnid restart UNIT --rolling`): the instances of a
replicated HTTP server are replaced `max_unavailable` at a time while a client loop sends
requests. Capacity is what answers: each instance serves /health on a port of its own (bound
once it serves, closed first when it stops), sampled from outside; requests go to the one
address omnid holds for every instance (SO_REUSEPORT). "Kept running" is a pid with the same
start time in /proc."""

from __future__ import annotations

import http.client
import random
import socket
import sys
import textwrap
import threading
import time
from datetime import datetime

import pytest

from omnid.model.units import check_stack
from tests.harness import REPO, alive, free_port, make_stack, wait_for
from tests.test_reload import omnid, show, started

PY = sys.executable
SERVER = str(REPO / "tests" / "roll_server.py")


def health_prefix() -> str:
    """A prefix P such that ports P0..P3 are free (instance i serves /health on P%i)."""
    for _ in range(200):
        prefix = str(random.randint(2000, 6000))
        socks = []
        try:
            for i in range(4):
                s = socket.socket()
                s.bind(("127.0.0.1", int(prefix + str(i))))
                socks.append(s)
            return prefix
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no four free ports for /health")


def server_unit(port: int, prefix: str, extra: str = "", exec_: str | None = None) -> str:
    return textwrap.dedent(f"""\
        exec = {exec_ or f'["{PY}", "{SERVER}", "{prefix}%i"]'}
        instances = 4
        sockets = [{{ listen = "127.0.0.1:{port}", name = "http", reuseport = true }}]
        ready = {{ http = "http://127.0.0.1:{prefix}%i/health" }}
        ready_timeout = 20
        stop_timeout = 5
        """) + extra


FRONT = 'exec = ["sleep", "1000"]\nrequires = ["srv"]\nstop_timeout = 2\n'


def answer(port: int, path: str, timeout: float) -> int | str:
    """The pid that answered, or what went wrong (refused, reset, timed out, not 200)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return int(body) if r.status == 200 else f"HTTP {r.status}"
    except (OSError, ValueError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def get(port: int, path: str, timeout: float) -> int | None:
    """The pid that answered, or None."""
    got = answer(port, path, timeout)
    return got if isinstance(got, int) else None


class Load:
    """A request loop on the shared address and a capacity sampler on the health ports."""

    def __init__(self, port: int, prefix: str) -> None:
        self.port, self.prefix = port, prefix
        self.ok = self.failed = 0
        self.errors: list[str] = []  # when (wall clock, as the daemon's log) and what, for each failure
        self.served_by: set[int] = set()
        self.samples: list[int] = []
        self.sampled_at: list[float] = []  # monotonic time each sample began
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._requests), threading.Thread(target=self._capacity)]

    def _requests(self) -> None:
        while not self.stop.is_set():
            got = answer(self.port, "/", 10)
            if isinstance(got, int):
                self.ok += 1
                self.served_by.add(got)
            else:
                self.failed += 1
                self.errors.append(f"{datetime.now().isoformat(timespec='milliseconds')} {got}")
            time.sleep(0.002)

    def _capacity(self) -> None:
        # A sample's four probes go at one moment, each on a thread of its own. Probed one after
        # another (each up to its timeout), a sample at load 15 straddled a step of the roll: the
        # instance not back yet when probed and the next one, stopped by the time it was probed,
        # were both counted down (2), though the roll never had two down at once.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4, thread_name_prefix="capacity") as pool:
            while not self.stop.is_set():
                began = time.monotonic()
                got = list(pool.map(lambda i: get(int(self.prefix + str(i)), "/health", 2), range(4)))
                self.samples.append(sum(g is not None for g in got))
                self.sampled_at.append(began)
                time.sleep(0.005)

    def samples_since(self, t: float, n: int, timeout: float = 30) -> list[int]:
        """The first `n` capacity samples begun at or after monotonic time `t` (one begun before
        the last instance was ready can end after it, and say 3)."""
        def since():
            got = [c for at, c in zip(self.sampled_at, self.samples) if at >= t]
            return got[:n] if len(got) >= n else None
        return wait_for(since, timeout, f"{n} capacity samples after the roll ({self.report()})")

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        wait_for(lambda: self.ok > 0 and self.samples, 10, "the first request and capacity sample")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def report(self) -> str:
        return (f"requests ok={self.ok} failed={self.failed}; capacity samples={len(self.samples)} "
                f"min={min(self.samples)} below-4={sum(s < 4 for s in self.samples)}"
                + "".join(f"\n  failed at {e}" for e in self.errors))


def pids(d, names) -> dict[str, tuple[int, int]]:
    return {n: started(d.unit(n)["pid"]) for n in names}


SRV = [f"srv@{i}" for i in range(4)]


def test_restart_rolling_under_load_keeps_three_of_four_up_and_fails_no_request(daemon_factory):
    port, prefix = free_port(), health_prefix()
    d_dir = make_stack({"srv": server_unit(port, prefix), "front": FRONT})
    d = daemon_factory(d_dir)
    d.wait_all_active(60)
    before = pids(d, SRV + ["front"])
    with Load(port, prefix) as load:
        t0 = time.monotonic()
        r = omnid(d, "restart", "srv", "--rolling")
        took = time.monotonic() - t0
        at_end = load.samples_since(time.monotonic(), 5)
    print(f"restart --rolling of 4 instances: {took:.2f} s; {load.report()}; after it: {at_end}")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    assert "rolling restart of srv@0, srv@1, srv@2, srv@3" in r.stdout, r.stdout
    after = pids(d, SRV + ["front"])
    for n in SRV:
        assert after[n] != before[n] and not alive(before[n][0]), f"{n} was not replaced: {show(d)}"
    assert after["front"] == before["front"], "front requires srv: a roll keeps it running"
    assert load.failed == 0, load.report()
    assert min(load.samples) >= 3, load.report()
    assert at_end == [4] * 5, f"after the roll: {at_end}; {load.report()}"  # all four back at the end
    assert load.served_by & {p for p, _ in after.values()}, "the new instances serve"
    # one at a time, from the kernel's side too: the daemon logged each stop before the next start
    order = [(e["unit"], e["to"]) for e in d.log_events() if e.get("event") == "unit state"
             and e.get("unit", "").startswith("srv@") and e.get("to") in ("stopping", "active")]
    tail = order[-8:]
    assert tail == [(n, s) for n in SRV for s in ("stopping", "active")], tail


def test_a_reload_with_update_rolling_rolls_and_a_broken_spec_stops_after_the_first(daemon_factory):
    port, prefix = free_port(), health_prefix()
    d_dir = make_stack({"srv": server_unit(port, prefix, 'update = "rolling"\n'), "front": FRONT})
    d = daemon_factory(d_dir)
    d.wait_all_active(60)
    before = pids(d, SRV + ["front"])
    (d_dir / "srv.toml").write_text(server_unit(port, prefix, 'update = "rolling"\nenv = { V = "2" }\n'))
    with Load(port, prefix) as load:
        r = omnid(d, "reload")
    print(f"reload (update = rolling) of 4 instances: {load.report()}")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    mid = pids(d, SRV + ["front"])
    for n in SRV:
        assert mid[n] != before[n] and not alive(before[n][0]), f"{n} was not replaced: {show(d)}"
        with open(f"/proc/{mid[n][0]}/environ", "rb") as f:
            assert b"\0V=2\0" in b"\0" + f.read(), f"{n} runs the new spec"
    assert mid["front"] == before["front"]
    assert load.failed == 0 and min(load.samples) >= 3, load.report()

    # a new spec whose program does not exist: the roll stops at its first instance
    (d_dir / "srv.toml").write_text(server_unit(port, prefix, 'update = "rolling"\n',
                                                exec_='["/nonexistent/omnid-test-server"]'))
    r = omnid(d, "reload")
    print(r.stderr)
    assert r.returncode == 1, r.stdout + r.stderr + show(d)
    assert "rolling restart stopped: srv@0: rolling restart stopped here:" in r.stderr, r.stderr
    assert "/nonexistent/omnid-test-server" in r.stderr, r.stderr
    assert "still running as before: srv@1, srv@2, srv@3" in r.stderr, r.stderr
    units = d.units()
    assert units["srv@0"]["state"] == "failed" and "rolling restart stopped here" in units["srv@0"]["reason"], \
        show(d)
    assert not alive(mid["srv@0"][0])
    after = pids(d, SRV[1:] + ["front"])
    for n in SRV[1:] + ["front"]:
        assert after[n] == mid[n] and alive(mid[n][0]), f"{n} must keep running: {show(d)}"
    for i in range(1, 4):  # and they answer
        assert get(int(prefix + str(i)), "/health", 2) == mid[f"srv@{i}"][0]
    assert d.unit("srv@0")["gave_up"], show(d)  # the new spec is not retried by a policy


def test_a_program_that_exits_at_once_stops_the_roll_too(daemon_factory):
    port, prefix = free_port(), health_prefix()
    d_dir = make_stack({"srv": server_unit(port, prefix)})
    d = daemon_factory(d_dir)
    d.wait_all_active(60)
    before = pids(d, SRV)
    (d_dir / "srv.toml").write_text(server_unit(port, prefix, 'update = "rolling"\nrestart = "on-failure"\nrestart_sec = 0.2\n',
                                                exec_='["sh", "-c", "exit 3"]'))
    r = omnid(d, "reload")
    assert r.returncode == 1 and "rolling restart stopped: srv@0" in r.stderr, r.stdout + r.stderr + show(d)
    assert "code 3" in r.stderr or "status 3" in r.stderr, r.stderr
    for n in SRV[1:]:
        assert pids(d, [n])[n] == before[n], f"{n} must keep running: {show(d)}"
    # restart = "on-failure" with restart_sec = 0.2 does not retry the new spec: failed for 5x that
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        u = d.unit("srv@0")
        assert u["state"] == "failed" and u["pid"] is None, show(d)
        time.sleep(0.05)


def test_rolling_is_refused_for_a_worker_group_with_exit_2(daemon_factory):
    d_dir = make_stack({"ranks": 'exec = ["sleep", "1000"]\ninstances = 2\nworker_group = "tp"\nstop_timeout = 2\n'})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = {n: started(u["pid"]) for n, u in d.units().items()}
    r = omnid(d, "restart", "ranks", "--rolling")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "ranks@0 is a member of worker group tp" in r.stderr and "not rolled" in r.stderr, r.stderr
    assert {n: started(u["pid"]) for n, u in d.units().items()} == before


def test_rolling_is_refused_for_a_unit_with_one_instance(daemon_factory):
    d = daemon_factory(make_stack({"one": 'exec = ["sleep", "1000"]\nstop_timeout = 2\n'}))
    d.wait_all_active()
    pid = started(d.unit("one")["pid"])
    r = omnid(d, "restart", "one", "--rolling")
    assert r.returncode == 2 and "one has one instance" in r.stderr, r.stdout + r.stderr
    assert started(d.unit("one")["pid"]) == pid


@pytest.mark.fast
def test_update_and_max_unavailable_errors_name_file_and_key():
    bad = make_stack({
        "a": 'exec = ["true"]\ninstances = 3\nupdate = "roll"\n',
        "b": 'exec = ["true"]\ninstances = 3\nupdate = "rolling"\nmax_unavailable = 3\n',
        "c": 'exec = ["true"]\ninstances = 2\nupdate = "rolling"\nworker_group = "g"\n',
        "e": 'exec = ["true"]\nmax_unavailable = 0\n',
    })
    text = "\n".join(str(e) for e in check_stack(bad))
    for want in ('a.toml: update: expected one of "restart", "rolling"',
                 "b.toml: max_unavailable: expected fewer than instances (3)",
                 "c.toml: update: a worker group is one thing",
                 "e.toml: max_unavailable: expected"):
        assert want in text, f"missing {want!r} in:\n{text}"
    ok = make_stack({"w": 'exec = ["true"]\ninstances = 4\nupdate = "rolling"\nmax_unavailable = 2\n'})
    assert check_stack(ok) == ()
