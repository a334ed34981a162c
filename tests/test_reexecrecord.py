"""The re-exec record's one schema (omnid/daemon/record.py): what a live daemon writes fits it
exactly (no field undeclared, none of another type), and a record that is truncated, foreign
or wrong in one field is refused with an error naming the field, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap

import pytest

from omnid.daemon import record as reexecrecord
from omnid.base.jsonshape import ShapeError
from tests.harness import alive, make_stack, repo_pythonpath, temp_dir, wait_for

SLEEP = 'exec = ["sleep", "1000"]\nstop_timeout = 2\n'


def memfd_of(data: bytes) -> int:
    fd = os.memfd_create("test-record", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@pytest.mark.parametrize("data, words", [
    (b"", "not valid JSON"),
    (b'{"format": 1, "token": "ab', "not valid JSON"),  # truncated
    (b"\x00{not json", "not valid JSON"),
    (b"[1, 2]", "format is '?', this program reads format 1"),
    (b'{"format": 2, "token": "x"}', "format is 2, this program reads format 1"),
    (b'{"format": 1}', "from_version: missing"),
])
@pytest.mark.fast
def test_a_truncated_or_foreign_record_is_a_named_error(data, words):
    fd = memfd_of(data)
    with pytest.raises(reexecrecord.RecordError) as err:
        reexecrecord.read(fd)
    assert words in str(err.value), str(err.value)
    with pytest.raises(OSError):
        os.fstat(fd)  # read closed it


@pytest.mark.fast
def test_a_wrong_field_is_named_by_its_path():
    r, w = os.pipe()
    try:
        good = {"pid": 5, "pidfd": r, "pgid": 5, "start_time": 7, "exit_status": None}
        reexecrecord.PROCESS.check(good, True)
        for change, words in (({"pid": "5"}, 'pid: expected an integer >= 0, got "5"'),
                              ({"pidfd": 9999}, "pidfd: fd 9999 is not open"),
                              ({"exit_status": 1.5}, "exit_status: expected an integer, got 1.5"),
                              ({"extra": 1}, "extra: not in the schema")):
            with pytest.raises(ShapeError) as err:
                reexecrecord.PROCESS.check({**good, **change}, True)
            assert str(err.value) == words, str(err.value)
        lines = {"lines": [[1.0, "stdout", "a"], [2.0, "stdout", 3]], "lines_total": 2, "lines_truncated": 0,
                 "echo_dropped": 0, "evicted_for_bytes": 0, "read_pauses": 0, "pipes": []}
        with pytest.raises(ValueError) as err:
            reexecrecord.OUTPUT.check(lines, False)
        assert str(err.value) == "lines[1][2]: expected a string, got 3", str(err.value)
    finally:
        os.close(r)
        os.close(w)


SITE = textwrap.dedent("""
    import os
    if os.environ.get("OMNID_TEST_RECORD_OUT"):
        import json
        from omnid.daemon import record as reexecrecord
        _read = reexecrecord.read
        def read(fd):
            rec = _read(fd)
            reexecrecord.check(rec, strict=True)  # a field the schema does not declare fails the takeover
            with open(os.environ["OMNID_TEST_RECORD_OUT"], "w") as f:
                json.dump(rec, f)
            return rec
        reexecrecord.read = read
""")


def test_a_live_daemons_record_fits_the_schema_exactly(daemon_factory, tmp_path):
    """Every part the record has (a worker group's shared book, a held socket, a stopped unit's
    stop record, output lines and pipes, restart books, metrics, cleanup) is read back by the
    new program with the strict check: an undeclared field or a value of another type would
    make the takeover fall back, and the daemon would say so in `status`."""
    site = temp_dir("omsite-")
    (site / "sitecustomize.py").write_text(SITE)
    out = tmp_path / "record.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack = make_stack({
        "web": 'exec = ["python3", "-c", "import time; print(\'up\', flush=True); time.sleep(1000)"]\n'
               f'stop_timeout = 2\nsockets = [{{ listen = "127.0.0.1:{port}", name = "web" }}]\n',
        "ranks": SLEEP + 'instances = 2\nworker_group = "tp"\nrestart = "on-failure"\n',
        "bad": 'exec = ["sh", "-c", "echo bye; exit 3"]\nrestart = "no"\n',
        "stopped": SLEEP,
    })
    d = daemon_factory(stack, env={"PYTHONPATH": os.pathsep.join((str(site), repo_pythonpath())),
                                   "OMNID_TEST_RECORD_OUT": str(out)})
    wait_for(lambda: d.unit("bad")["state"] == "failed" and all(
        d.unit(n)["state"] == "active" for n in ("web", "ranks@0", "ranks@1", "stopped")), 30, "the stack up")
    d.ok("stop", {"units": ["stopped"]}, timeout=30)
    wait_for(lambda: d.unit("stopped")["state"] == "inactive", 15, "`stopped` stopped")
    before = {n: d.unit(n)["pid"] for n in ("web", "ranks@0", "ranks@1")}
    d.reexec()
    st = d.ok("status")["daemon"]
    assert st["reexecs"] == 1 and "handover_error" not in st, st
    assert {n: d.unit(n)["pid"] for n in before} == before
    rec = json.loads(out.read_text())
    units = rec["supervisor"]["units"]
    assert units["stopped"]["last_stop"] is not None and units["stopped"]["proc"] is None, units["stopped"]
    assert units["bad"]["state"] == "failed" and units["bad"]["last_exit_code"] == 3, units["bad"]
    assert units["ranks@0"]["book"] == units["ranks@1"]["book"] == "group:tp"
    assert [h["listen"] for h in rec["supervisor"]["sockets"]["web"]] == [f"127.0.0.1:{port}"]
    assert any(line[2] == "up" for line in units["web"]["output"]["lines"]), units["web"]["output"]
    assert units["web"]["output"]["pipes"], "the running unit's pipes were handed over"
    os.kill(before["ranks@1"], signal.SIGKILL)
    wait_for(lambda: not alive(before["ranks@0"]), 15, "the group stopped as one after the re-exec")
