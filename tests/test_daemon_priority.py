"""The daemon's own priority (omnid.toml `daemon_nice`; unset, 10 steps ahead of the nice value
omnid was started with): every thread of the daemon at that nice value, read from /proc, the
spawner and the units at the nice value omnid was started with, kept across a re-exec; where
raising is not allowed (no CAP_SYS_NICE) the daemon says why and goes on at its own value."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from omnid.model.units import StackInvalid, load_stack
from tests.harness import Daemon, make_stack, wait_for

SLEEP = 'exec = ["sleep", "1000"]\n'
DEFAULT = {"OMNID_DAEMON_NICE": ""}  # the harness runs its daemons at 0: here, omnid.toml and its default


def nice_of(pid: int, tid: int | None = None) -> int:
    """Field 19 of /proc/PID[/task/TID]/stat, counted after the command's closing ')' (a
    process title has spaces)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def threads_nice(pid: int) -> dict[int, int]:
    return {int(t): nice_of(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def started_at() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
@pytest.mark.parametrize("setting, expect", [(None, -10), ("daemon_nice = -4", -4), ("daemon_nice = 0", 0)])
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the expected values are for a suite run at nice 0")
def test_daemon_threads_take_daemon_nice_units_keep_ours_across_reexec(setting, expect) -> None:
    d = Daemon(make_stack({"s": SLEEP}, settings=setting), env=DEFAULT).start()
    try:
        d.wait_all_active()
        ours = started_at()

        def seen() -> str:
            return (f"daemon threads {threads_nice(d.pid)}, spawner {nice_of(spawner)}, unit {nice_of(unit)}, "
                    f"we run at {ours}\n{d.log()[-2000:]}")

        for round_ in ("started", "after a re-exec"):
            st = d.ok("status")
            spawner, unit = _spawner(d.pid), d.unit("s")["pid"]
            assert st["daemon"]["nice"] == expect, (round_, st["daemon"])
            assert set(threads_nice(d.pid).values()) == {expect}, (round_, seen())
            assert nice_of(spawner) == ours and nice_of(unit) == ours, (round_, seen())
            if round_ == "started":
                d.reexec()
        # A unit started after the re-exec (a restart) forks from the same spawner: ours too.
        d.ok("restart", {"units": ["s"]})
        pid = wait_for(lambda: (u := d.unit("s"))["state"] == "active" and u["pid"] != unit and u["pid"], 15,
                       lambda: f"s restarted: {d.unit('s')}")
        assert nice_of(pid) == ours, seen()
    finally:
        d.close()


def _spawner(daemon_pid: int) -> int:
    """The spawner: the daemon's child whose title says so."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == daemon_pid and "spawner" in stat:
                return int(entry)
    raise AssertionError(f"no spawner under daemon {daemon_pid}")


class DaemonWithoutCapSysNice(Daemon):
    """The daemon exec'd by setpriv(1) with CAP_SYS_NICE out of its bounding set: root
    otherwise, the kernel refuses a lower nice value (RLIMIT_NICE is 0)."""

    def argv(self) -> list[str]:
        return ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice", "--", *super().argv()]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) (util-linux) to take CAP_SYS_NICE away")
def test_without_cap_sys_nice_the_daemon_says_why_and_runs_at_its_own_value() -> None:
    d = DaemonWithoutCapSysNice(make_stack({"s": SLEEP}), env=DEFAULT).start()
    try:
        d.wait_all_active()
        ours = started_at()
        assert d.ok("status")["daemon"]["nice"] == ours
        assert set(threads_nice(d.pid).values()) == {ours}, threads_nice(d.pid)
        said = [e for e in d.log_events() if e.get("event") == "the daemon's priority is not raised"]
        assert said and said[0]["daemon_nice"] == ours - 10 and "needs CAP_SYS_NICE" in said[0]["why"], d.log()[-2000:]
    finally:
        d.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
def test_the_environment_overrides_omnid_toml() -> None:
    d = Daemon(make_stack({"s": SLEEP}, settings="daemon_nice = -4"), env={"OMNID_DAEMON_NICE": "-7"}).start()
    try:
        d.wait_all_active()
        assert d.ok("status")["daemon"]["nice"] == -7 and set(threads_nice(d.pid).values()) == {-7}
    finally:
        d.close()


@pytest.mark.parametrize("value", ["-21", "high", "1.5"])
def test_a_bad_environment_value_is_refused_by_name(value: str) -> None:
    d = Daemon(make_stack({"s": SLEEP}), env={"OMNID_DAEMON_NICE": value}).start(wait=False)
    try:
        assert d.wait_exit(30) == 2, d.log()
        assert f"omnid: OMNID_DAEMON_NICE: expected an integer from -20 to 19, got {value!r}" in d.log(), d.log()
    finally:
        d.close()


class NicedDaemon(Daemon):
    """omnid started by nice(1) at `by`: as a service manager's Nice= starts it."""

    def __init__(self, units_dir: Path, by: int, **kw) -> None:
        super().__init__(units_dir, **kw)
        self.by = by

    def argv(self) -> list[str]:
        return ["nice", "-n", str(self.by), *super().argv()]


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (CAP_SYS_NICE)")
@pytest.mark.parametrize("by", [5, -15])
def test_unset_the_daemon_runs_ten_steps_ahead_of_the_value_it_was_started_with(by: int) -> None:
    """Started at 5 it runs at -5; started at -15 (a unit file's Nice=-15) at -20, not at -10
    behind its own units. After a re-exec the base is still the units' value, not its own."""
    ours = started_at()
    d = NicedDaemon(make_stack({"s": SLEEP}), ours + by, env=DEFAULT).start()
    try:
        d.wait_all_active()
        for round_ in ("started", "after a re-exec"):
            unit = d.unit("s")["pid"]
            want = max(-20, ours + by - 10)
            assert d.ok("status")["daemon"]["nice"] == want, (round_, d.ok("status")["daemon"])
            assert set(threads_nice(d.pid).values()) == {want}, (round_, threads_nice(d.pid))
            assert nice_of(_spawner(d.pid)) == ours + by and nice_of(unit) == ours + by, round_
            if round_ == "started":
                d.reexec()
    finally:
        d.close()


@pytest.mark.fast
def test_unset_daemon_nice_is_ten_steps_ahead_never_past_minus_20() -> None:
    from omnid.base.priority import daemon_nice_for

    assert [daemon_nice_for(None, u) for u in (0, 5, -15, 19, -20)] == [-10, -5, -20, 9, -20]
    assert daemon_nice_for(3, -15) == 3 and daemon_nice_for(-20, 0) == -20  # a setting is a value, as given


@pytest.mark.fast
@pytest.mark.parametrize("value, says", [
    ("-21", "expected an integer >= -20 and <= 19, got -21"),
    ("20", "expected an integer >= -20 and <= 19, got 20"),
    ('"high"', "expected an integer >= -20 and <= 19, got"),
    ("true", "expected an integer >= -20 and <= 19, got"),
])
def test_daemon_nice_out_of_range_names_the_file_and_key(tmp_path: Path, value: str, says: str) -> None:
    (tmp_path / "s.toml").write_text(SLEEP)
    (tmp_path / "omnid.toml").write_text(f"daemon_nice = {value}\n")
    with pytest.raises(StackInvalid) as caught:
        load_stack(tmp_path)
    text = "\n".join(map(str, caught.value.errors))
    assert "omnid.toml" in text and "daemon_nice" in text and says in text, text


@pytest.mark.fast
def test_daemon_nice_default_and_set(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(SLEEP)
    assert load_stack(tmp_path).settings.daemon_nice is None  # unset: ahead of the units
    (tmp_path / "omnid.toml").write_text("daemon_nice = 5\n")
    assert load_stack(tmp_path).settings.daemon_nice == 5

