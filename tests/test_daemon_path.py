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
    return sorted(d["path"] for d in json.loads(rec.path.read_text())) if rec.path.exists() else []


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

    asyncio.run(main())


@pytest.mark.fast
def test_tmp_record_without_a_loop_is_written_at_once(tmp_path):
    rec = privatetmp.Record(tmp_path)
    rec.add(_dir(tmp_path, 0))
    assert rec.writes == 1 and len(_on_disk(rec)) == 1


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
