"""What keeps the per-unit preparation off the daemon's start and exit paths (issue 36):
the private tmp record written once for a batch, before the batch's spawns are sent, and
the inherited environment decoded once while os.environ stays the same."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from omnid.core import spawning
from omnid.process import privatetmp


def _dir(tmp_path, i: int) -> privatetmp.TmpDir:
    return privatetmp.TmpDir(f"w@{i}", f"/tmp/omnid-w@{i}-{i:012x}", 1, 1000 + i, 0)


def _on_disk(rec: privatetmp.Record) -> list[str]:
    """What a daemon after a SIGKILL would read from the record: its lines replayed."""
    return sorted(d.path for d in privatetmp.parse_record(rec.path.read_bytes(), "test")) if rec.path.exists() else []


@pytest.mark.fast
def test_tmp_record_is_written_once_for_a_batch_and_on_disk_before_the_send(tmp_path):
    rec = privatetmp.Record(tmp_path)

    async def main() -> None:
        dirs = [_dir(tmp_path, i) for i in range(3)]
        for d in dirs:
            rec.add(d)
        assert rec.writes == 0 and not rec.path.exists()  # nothing yet: three adds in one turn
        rec.flush()  # what the spawner client calls before it sends the batch
        assert rec.writes == 1 and _on_disk(rec) == sorted(d.path for d in dirs)
        await asyncio.sleep(0.01)
        assert rec.writes == 1  # the end of the turn finds nothing left to write

        rec.add(_dir(tmp_path, 3))  # not flushed by a send: written at the end of the turn
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert rec.writes == 2 and len(_on_disk(rec)) == 4
        rec.close()

    asyncio.run(main())


@pytest.mark.fast
def test_tmp_record_removals_are_written_together_a_moment_later_or_at_a_flush(tmp_path):
    rec = privatetmp.Record(tmp_path)

    async def main() -> None:
        dirs = [_dir(tmp_path, i) for i in range(4)]
        for d in dirs:
            rec.add(d)
        rec.flush()
        rec.drop(dirs[0])
        rec.drop(dirs[1])
        assert rec.writes == 1 and len(_on_disk(rec)) == 4  # not at each removal
        deadline = asyncio.get_running_loop().time() + 5
        while rec.writes < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert rec.writes == 2 and _on_disk(rec) == sorted(d.path for d in dirs[2:])
        rec.drop(dirs[2])
        rec.flush()  # the daemon's end, a re-exec's handover
        assert rec.writes == 3 and _on_disk(rec) == [dirs[3].path]
        rec.close()

    asyncio.run(main())


@pytest.mark.fast
def test_tmp_record_without_a_loop_is_written_at_once(tmp_path):
    rec = privatetmp.Record(tmp_path)
    rec.add(_dir(tmp_path, 0))
    assert rec.writes == 1 and len(_on_disk(rec)) == 1
    rec.close()


@pytest.mark.fast
def test_tmp_record_appends_before_a_send_and_rewrites_only_from_a_delayed_write(tmp_path):
    """A spawn's directory goes on disk by an append to the file the first write made (the
    same inode: no rename on the spawn path); 300 restarts of one unit (a drop and an add
    each) keep the file bounded by rewrites made from the delayed writes, and what a reader
    replays is always the live set."""
    rec = privatetmp.Record(tmp_path)

    async def main() -> None:
        live = _dir(tmp_path, 0)
        rec.add(live)
        rec.flush()
        ino = rec.path.stat().st_ino
        assert rec.rewrites == 1 and _on_disk(rec) == [live.path]
        rec.add(_dir(tmp_path, 1))
        rec.flush()  # a send: an append, not a rewrite
        assert rec.rewrites == 1 and rec.path.stat().st_ino == ino and len(_on_disk(rec)) == 2
        for i in range(2, 302):
            rec.drop(live)
            live = _dir(tmp_path, i)
            rec.add(live)
            rec.flush()  # the restart's spawn: never a rename
            assert rec.path.stat().st_ino == ino or rec.rewrites > 1
            await asyncio.sleep(0)
        assert rec.rewrites == 1, "a flush rewrote the file"
        assert _on_disk(rec) == sorted([live.path, _dir(tmp_path, 1).path])
        rec.drop(_dir(tmp_path, 1))  # a delayed write: the file has outgrown its bound
        deadline = asyncio.get_running_loop().time() + 5
        while rec.rewrites < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert rec.rewrites == 2 and rec.path.read_bytes().count(b"\n") == 1, rec.path.read_text()
        assert _on_disk(rec) == [live.path]
        rec.close()

    asyncio.run(main())


@pytest.mark.fast
def test_tmp_record_of_an_older_omnid_and_hostile_lines_are_read_safely(tmp_path):
    """The one JSON list an older omnid wrote is still read; lines that are not one of ours
    (not JSON, a path outside the pattern, a drop of what was never added) are skipped."""
    good = _dir(tmp_path, 7).to_json()
    (tmp_path / privatetmp.RECORD_NAME).write_text(json.dumps([good]))
    assert [d.path for d in privatetmp.Record(tmp_path).previous()] == [good["path"]]
    lines = [json.dumps({"add": good}), "not json", json.dumps({"add": {**good, "path": "/etc"}}),
             json.dumps({"drop": "/tmp/omnid-x-000000000000"}), json.dumps([1, 2]), ""]
    (tmp_path / privatetmp.RECORD_NAME).write_text("\n".join(lines))
    assert [d.path for d in privatetmp.Record(tmp_path).previous()] == [good["path"]]


@pytest.mark.fast
def test_inherited_environment_follows_a_change_of_os_environ(monkeypatch):
    first = spawning._inherited()
    assert spawning._inherited() is first  # decoded once
    monkeypatch.setenv("OMNID_TEST_INHERITED", "1")
    changed = spawning._inherited()
    assert changed["OMNID_TEST_INHERITED"] == "1"
    monkeypatch.delenv("OMNID_TEST_INHERITED")
    assert "OMNID_TEST_INHERITED" not in spawning._inherited()
    assert spawning._inherited()["PATH"].startswith(os.path.dirname(sys.executable))


def test_the_daemons_garbage_collector_is_on_once_it_is_up_with_its_start_frozen_out_of_it(daemon_factory, tmp_path):
    """The cyclic GC is off from the command's first line until the first tier is out and the
    rest loaded (the start's collections walked the same long-lived objects again and again:
    first child 117 -> 110 ms with the ldconfig below gone too); a daemon left with it off
    would grow with every cycle it makes. Read from /metrics, what an operator sees."""
    from tests.harness import make_stack, wait_for

    d = daemon_factory(make_stack({"w": f'exec = ["{sys.executable}", "-c", "import time; time.sleep(60)"]\n'}))

    def metrics() -> dict[str, float]:
        _, m = d.http("/metrics")
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in m.splitlines()
                                         if line.startswith("omnid_daemon_gc"))}

    seen = wait_for(lambda: (m := metrics()).get("omnid_daemon_gc_enabled") == 1 and m, 10,
                    lambda: f"the GC on; /metrics: {metrics()}; log:\n{d.log()[-2000:]}")
    assert seen["omnid_daemon_gc_frozen_objects"] > 10_000, seen
    assert 'omnid_daemon_gc_collections_total{generation="0"}' in seen, seen


@pytest.mark.fast
def test_the_daemons_imports_never_run_a_program(tmp_path):
    """ctypes.util.find_library("c") ran /sbin/ldconfig in a subprocess: a fork by the daemon
    (the spawner alone forks) and ~2.5 ms on its way to its first spawn. Every module the
    daemon loads before its first spawn is imported here with subprocess and os.posix_spawn
    watched (audit hooks)."""
    code = ("import sys\nseen = []\n"
            "sys.addaudithook(lambda ev, a: seen.append((ev, str(a[0])[:80])) "
            "if ev in ('subprocess.Popen', 'os.posix_spawn', 'os.fork', 'os.exec') else None)\n"
            "import omnid.daemon.command, omnid.daemon.main, omnid.core.cleanup, omnid.process.ipc\n"
            "print(seen)\n")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
