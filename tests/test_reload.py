"""`omnid reload` (and SIGHUP): an edited stack directory is applied to a running daemon,
changing only what changed. Every check of "kept running" is a pid that /proc still
shows with the same start time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from omnid.base import linux
from omnid.core.reload import plan
from omnid.model.units import load_stack
from tests.harness import REPO, alive, cgroup2_for_tests, make_stack, repo_pythonpath, wait_for

CGROUP2, CGROUP2_MISSING = cgroup2_for_tests()  # the same condition as tests/test_cgroup.py

PY = sys.executable
SLEEP = 'exec = ["sleep", "1000"]\nstop_timeout = 2\n'


def started(pid: int) -> tuple[int, int]:
    """(pid, start time): the same process, not a new one with a recycled pid."""
    return pid, linux.start_time_of(pid) or -1


def write(d, name: str, text: str) -> None:
    (d / f"{name}.toml").write_text(textwrap.dedent(text))


def omnid(d, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "omnid", "--control", d.control, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=repo_pythonpath()))


def ids(d) -> dict[str, tuple[int, int]]:
    return {n: started(u["pid"]) for n, u in d.units().items() if u["pid"]}


def show(d) -> str:
    return json.dumps({n: (u["state"], u["reason"]) for n, u in d.units().items()}) + "\n" + d.log()[-3000:]


# ------------------------------------------------------------------ the plan, pure
@pytest.mark.fast
def test_plan_sorts_each_instance_into_added_removed_restarted_updated_unchanged(tmp_path):
    old = make_stack({"serve": SLEEP + 'requires = ["engine"]\n', "engine": SLEEP + 'requires = ["worker"]\n',
                      "worker": SLEEP + "instances = 3\n", "gone": SLEEP})
    new = make_stack({"serve": SLEEP + 'requires = ["engine"]\ndescription = "edited"\n',
                      "engine": SLEEP.replace("1000", "2000") + 'requires = ["worker"]\n',
                      "worker": SLEEP + "instances = 2\n", "fresh": SLEEP})
    p = plan(load_stack(old), load_stack(new))
    assert p.added == ["fresh"] and p.removed == ["gone", "worker@2"], p
    assert p.restarted == {"engine": ["exec", "requires"]}, p.restarted  # worker@2 is gone from its requires
    assert p.updated == {"serve": ["description"]}, p.updated
    assert sorted(p.unchanged) == ["worker@0", "worker@1"], p.unchanged  # OMNID_INSTANCES is not a key


@pytest.mark.fast
def test_plan_restarts_a_whole_worker_group_when_its_membership_changes(tmp_path):
    old = make_stack({"ranks": SLEEP + 'instances = 2\nworker_group = "tp"\n'})
    new = make_stack({"ranks": SLEEP + 'instances = 3\nworker_group = "tp"\n'})
    p = plan(load_stack(old), load_stack(new))
    assert p.added == ["ranks@2"] and sorted(p.restarted) == ["ranks@0", "ranks@1"], p
    assert "worker_group members" in p.restarted["ranks@0"]


@pytest.mark.fast
def test_plan_reports_omnid_toml_settings_a_running_daemon_cannot_change(tmp_path):
    old = make_stack({"a": SLEEP}, settings='health_listen = "127.0.0.1:9400"\n')
    new = make_stack({"a": SLEEP}, settings='health_listen = "127.0.0.1:9401"\n')
    p = plan(load_stack(old), load_stack(new))
    assert p.settings == [{"key": "health_listen", "from": "127.0.0.1:9400", "to": "127.0.0.1:9401",
                           "applies": p.settings[0]["applies"]}], p.settings
    assert "restart of the daemon" in p.settings[0]["applies"]
    p = plan(load_stack(old), load_stack(new), {"health_listen": "flag"})
    assert p.settings[0]["applies"] == "no effect: set by the flag", p.settings


# ------------------------------------------------------------------ a running daemon
def test_reload_restarts_only_the_edited_unit_and_its_dependents_keep_every_other_pid(daemon_factory):
    d_dir = make_stack({"worker": SLEEP, "engine": SLEEP + 'requires = ["worker"]\n',
                        "serve": SLEEP + 'requires = ["engine"]\n', "side": SLEEP})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "engine", SLEEP.replace("1000", "1001") + 'requires = ["worker"]\n')
    write(d_dir, "side", SLEEP + 'description = "now described"\nrestart = "on-failure"\n')
    r = omnid(d, "reload")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    assert "restarted  engine  (exec)" in r.stdout and "updated    side  (description, restart)" in r.stdout, r.stdout
    after = ids(d)
    assert after["worker"] == before["worker"], "worker was not edited: same process"
    assert after["side"] == before["side"], "side's supervision settings changed: same process"
    assert after["engine"] != before["engine"] and after["serve"] != before["serve"], "engine restarted, serve follows"
    assert not alive(before["engine"][0]) and not alive(before["serve"][0])
    assert d.unit("side")["reason"] in ("started", "ready")
    assert d.http("/health")[0] == 200, show(d)
    # the updated restart policy is in force at once: side restarts by itself now
    os.kill(after["side"][0], signal.SIGKILL)  # the daemon's own unit, pid + start time just read
    wait_for(lambda: d.unit("side")["state"] == "active" and d.unit("side")["pid"] != after["side"][0], 10,
             "side restarted by its new restart policy")


def test_reload_adds_and_removes_instances_only_and_stops_removed_units_in_reverse_order(daemon_factory):
    d_dir = make_stack({"worker": SLEEP + "instances = 3\n", "helper": SLEEP + 'requires = ["base"]\n',
                        "base": SLEEP})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "worker", SLEEP + "instances = 2\n")
    (d_dir / "helper.toml").unlink()
    (d_dir / "base.toml").unlink()
    write(d_dir, "extra", SLEEP)
    r = omnid(d, "reload")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    units = d.units()
    assert set(units) == {"worker@0", "worker@1", "extra"}, units
    assert ids(d)["worker@0"] == before["worker@0"] and ids(d)["worker@1"] == before["worker@1"]
    for n in ("worker@2", "helper", "base"):
        assert not alive(before[n][0]), n
    stops = [e["unit"] for e in d.log_events() if e.get("event") == "unit state" and e.get("to") == "stopping"]
    assert stops.index("helper") < stops.index("base"), stops  # reverse dependency order
    assert units["extra"]["state"] == "active"


def test_an_invalid_stack_changes_nothing_and_names_every_error(daemon_factory):
    d_dir = make_stack({"a": SLEEP, "b": SLEEP})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "a", 'exec = "not a list"\n')
    write(d_dir, "b", SLEEP + 'requires = ["ghost"]\n')
    r = omnid(d, "reload")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "a.toml: exec:" in r.stderr and "ghost" in r.stderr and "nothing changed" in r.stderr, r.stderr
    assert ids(d) == before


def test_dry_run_prints_the_plan_and_changes_nothing(daemon_factory):
    d_dir = make_stack({"a": SLEEP, "b": SLEEP})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "a", SLEEP.replace("1000", "999"))
    r = omnid(d, "reload", "--dry-run")
    assert r.returncode == 0 and "restarted  a  (exec)" in r.stdout and "unchanged  1 units" in r.stdout, r.stdout
    assert ids(d) == before


def test_sighup_reloads_instead_of_killing_the_daemon(daemon_factory):
    """Tried as a new user would: `kill -HUP` of the daemon used to kill it and every unit."""
    d_dir = make_stack({"a": SLEEP, "b": SLEEP})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "b", SLEEP.replace("1000", "998"))
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: ids(d).get("b", before["b"]) != before["b"] and d.unit("b")["state"] == "active", 15,
             "b restarted by the SIGHUP reload")
    assert d.proc.poll() is None and ids(d)["a"] == before["a"]
    assert any(e.get("event") == "reload done" for e in d.log_events())


def _a_control_reload_under_way(daemon_factory):
    """A daemon whose unit `slow` (TERM ignored; it exits once a file exists) was changed, and
    `omnid reload` started in the background: it stops slow until the test calls release(),
    which makes the file, so nothing the test does next races a timeout on a loaded machine.
    The changed slow is a plain sleep with stop_timeout 2. Returns (daemon, its stack directory,
    the reload's process, release)."""
    d_dir = make_stack({})
    gate = d_dir / "release-slow"
    write(d_dir, "slow", f'exec = ["sh", "-c", "trap \'\' TERM; while [ ! -e {gate} ]; do sleep 0.2; done"]\n'
                         'stop_timeout = 600\n')
    d = daemon_factory(d_dir)
    d.wait_all_active()
    write(d_dir, "slow", 'exec = ["sleep", "999"]\nstop_timeout = 2\n')
    first = subprocess.Popen([PY, "-m", "omnid", "--control", d.control, "reload"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                             env=dict(os.environ, PYTHONPATH=repo_pythonpath()))
    return d, d_dir, first, gate.touch


def test_a_second_reload_while_one_runs_is_refused_with_a_clear_error(daemon_factory):
    d, d_dir, first, release = _a_control_reload_under_way(daemon_factory)
    try:
        wait_for(lambda: d.unit("slow")["state"] == "stopping", 30, "the first reload stopping slow")
        r = omnid(d, "reload")
        assert r.returncode == 1 and "a reload is already being applied" in r.stderr, r.stdout + r.stderr
    finally:
        release()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, out + err
    wait_for(lambda: d.unit("slow")["state"] == "active", 30, lambda: f"slow active again: {d.unit('slow')}")


def test_a_sighup_during_a_control_reload_runs_after_it_and_reads_the_newest_files(daemon_factory):
    """A SIGHUP while a reload asked over the control socket is being applied (which read the
    files before this change) is not refused as busy, which dropped it: its reload runs once
    that one is done, and sees the unit written just before the signal."""
    d, d_dir, first, release = _a_control_reload_under_way(daemon_factory)
    try:
        wait_for(lambda: d.unit("slow")["state"] == "stopping", 30, "the control reload stopping slow")
        write(d_dir, "late", SLEEP)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: waiting for the reload under way to end first"
                 in [e.get("event") for e in d.log_events()], 30, lambda: d.log()[-2000:])
        release()
        wait_for(lambda: "late" in d.units() and d.unit("late")["state"] == "active", 30,
                 lambda: f"unit late, written before the SIGHUP: {sorted(d.units())}\n{d.log()[-2000:]}")
    finally:
        release()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, out + err
    events = [e.get("event") for e in d.log_events()]
    assert "reload refused" not in events, d.log()[-2000:]


def test_reload_while_the_stack_stops_is_refused(daemon_factory):
    """The stack's stop is held (slow ignores TERM and exits once a file exists) until the
    refused reload has answered: a 3 s stop_timeout was raced by the CLI's start at load 20."""
    d_dir = make_stack({})
    gate = d_dir / "release-slow"
    slow = (f'exec = ["sh", "-c", "trap \'\' TERM; while [ ! -e {gate} ]; do sleep 0.2; done"]\n'
            'stop_timeout = 600\n')
    write(d_dir, "slow", slow)
    d = daemon_factory(d_dir)
    d.wait_all_active()
    write(d_dir, "slow", slow.replace("0.2", "0.3"))
    d.proc.send_signal(signal.SIGTERM)
    try:
        wait_for(lambda: d.unit("slow")["state"] == "stopping", 30, "the stack stopping")
        r = omnid(d, "reload")
        assert r.returncode == 1 and "stopping" in r.stderr, r.stdout + r.stderr
    finally:
        gate.touch()
    assert d.wait_exit(30) == 0


def test_reload_of_an_updated_requirement_list_does_not_stop_the_unit_that_dropped_it(daemon_factory):
    d_dir = make_stack({"base": SLEEP, "app": SLEEP + 'requires = ["base"]\n'})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    write(d_dir, "app", SLEEP)  # no longer requires base ...
    (d_dir / "base.toml").unlink()  # ... which is removed
    r = omnid(d, "reload")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    assert "updated    app  (requires)" in r.stdout and "removed    base" in r.stdout, r.stdout
    assert ids(d)["app"] == before["app"], "app was taken down with the unit it no longer requires"
    assert not alive(before["base"][0])


def test_reload_of_a_stack_with_worker_groups_and_templates_restarts_the_group_as_one(daemon_factory):
    d_dir = make_stack({"ranks": SLEEP + 'instances = 2\nworker_group = "tp"\nrestart = "on-failure"\n',
                        "other": SLEEP + "instances = 2\n"})
    d = daemon_factory(d_dir)
    d.wait_all_active()
    before = ids(d)
    gen = d.unit("ranks@0")["generation"]
    write(d_dir, "ranks", SLEEP + 'instances = 2\nworker_group = "tp"\nrestart = "on-failure"\nenv = { X = "1" }\n')
    r = omnid(d, "reload")
    assert r.returncode == 0, r.stdout + r.stderr + show(d)
    after = ids(d)
    assert after["ranks@0"] != before["ranks@0"] and after["ranks@1"] != before["ranks@1"]
    assert after["other@0"] == before["other@0"] and after["other@1"] == before["other@1"]
    assert d.unit("ranks@0")["generation"] == d.unit("ranks@1")["generation"] == gen + 1


def test_reload_of_a_256_unit_stack_changing_one_unit_keeps_255_pids(daemon_factory):
    units = {f"u{i:03d}": SLEEP for i in range(256)}
    d_dir = make_stack(units)
    d = daemon_factory(d_dir)
    wait_for(lambda: all(u["state"] == "active" for u in d.units().values()), 120, "256 units active")
    before = ids(d)
    write(d_dir, "u100", SLEEP.replace("1000", "1002"))
    t0 = time.monotonic()
    r = omnid(d, "reload")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    after = ids(d)
    changed = sorted(n for n in before if after.get(n) != before[n])
    assert changed == ["u100"], changed
    print(f"\nreload of a 256-unit stack changing one unit: {took:.2f} s (CLI, plan + apply)")


@pytest.mark.skipif(CGROUP2 is None, reason=CGROUP2_MISSING)
def test_reload_under_the_cgroup_backend_moves_only_the_changed_units_cgroups(daemon_factory):
    from tests.harness import remove_cgroup_tree

    root = os.path.join(CGROUP2, f"omnid-rl-{os.getpid()}-{time.monotonic_ns()}")
    d_dir = make_stack({"keep": SLEEP, "edit": SLEEP, "gone": SLEEP})
    d = daemon_factory(d_dir, cgroup_root=root)
    try:
        d.wait_all_active()
        before = ids(d)
        write(d_dir, "edit", SLEEP.replace("1000", "1003"))
        (d_dir / "gone.toml").unlink()
        r = omnid(d, "reload")
        assert r.returncode == 0, r.stdout + r.stderr + show(d)
        after = ids(d)
        assert after["keep"] == before["keep"] and after["edit"] != before["edit"] and "gone" not in after
        for name in ("keep", "edit"):
            cg = open(f"/proc/{after[name][0]}/cgroup").read().strip()
            assert cg.endswith(f"/{name}"), cg
        wait_for(lambda: not os.path.exists(os.path.join(root, "gone")), 10, "the removed unit's cgroup removed")
    finally:
        d.close()
        remove_cgroup_tree(root)


def test_a_sighup_storm_folds_into_back_to_back_reloads_and_the_last_one_reads_the_newest_files(daemon_factory):
    """SIGHUP every millisecond for 3 s at a running daemon. Each signal used to start a reload
    of its own: the backlog grew faster than reloads ended, the control socket went silent for
    over a minute after the storm, and once asyncio's signal wakeup socket filled, signals were
    lost (the daemon then outlived its SIGTERM). Now the SIGHUPs that arrive during a reload
    ask for one more reload after it: the daemon answers all along, the reloads stop with the
    storm, and the last one sees a unit written just before the last SIGHUP."""
    import threading

    units_dir = make_stack({"a": SLEEP})
    d = daemon_factory(units_dir)
    d.wait_all_active()
    stop = threading.Event()
    sent = [0]

    def storm() -> None:
        while not stop.is_set():
            d.proc.send_signal(signal.SIGHUP)
            sent[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=storm)
    t.start()
    try:
        slowest = 0.0
        end = time.monotonic() + 3
        while time.monotonic() < end:
            asked = time.monotonic()
            d.ok("status", timeout=10)
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.1)
        (units_dir / "b.toml").write_text(SLEEP)
        d.proc.send_signal(signal.SIGHUP)
    finally:
        stop.set()
        t.join(10)
    wait_for(lambda: "b" in d.units(), 20, lambda: f"unit b, written before the last SIGHUP: {sorted(d.units())}")
    done = lambda: sum(1 for e in d.log_events() if e.get("event") == "reload done")  # noqa: E731

    def steady() -> int:
        n = done()
        time.sleep(0.3)
        return done() == n and n

    settled = wait_for(steady, 10, "the reloads to stop with the storm")
    assert settled <= sent[0] + 1, (settled, sent[0])
    folded = sum(e.get("signals", 1) for e in d.log_events() if e.get("event") == "SIGHUP: reloading the stack directory")
    lost = d.log().count("Exception ignored when trying to write to the signal wakeup fd")
    print(f"SIGHUPs sent {sent[0] + 1}, reloads {settled}, signals counted {folded}, lost {lost}, "
          f"slowest status {slowest * 1000:.0f} ms")
    assert lost == 0 and d.proc.poll() is None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0, d.log()[-3000:]


def _sighup_taken(pid: int) -> bool:
    """The kernel's word that the process ignores or handles SIGHUP (bit 0 of SigIgn/SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    return any(int(fields[k].strip(), 16) & 1 for k in ("SigIgn", "SigCgt"))


def test_sighup_storm_while_the_daemon_starts_or_re_executes_never_kills_it():
    """SIGHUP every millisecond from the moment omnid's own code runs (after the Python
    interpreter's start, ~30 ms, which no program can cover; systemd sends ExecReload only
    once the daemon said READY) through the start, then through a re-exec: ignored until
    the loop runs, refused with a log line until the control handlers are loaded, a reload
    after that; never a crash, never a dead daemon, no unit lost."""
    import threading

    from tests.harness import Daemon

    d = Daemon(make_stack({"a": SLEEP, "b": SLEEP}))
    d.start(wait=False)
    stop = threading.Event()
    sent = [0]

    def storm() -> None:
        while not stop.is_set() and d.proc.poll() is None:
            d.proc.send_signal(signal.SIGHUP)
            sent[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=storm)
    try:
        wait_for(lambda: _sighup_taken(d.pid) or d.proc.poll() is not None, 20, "omnid's code running")
        t.start()
        wait_for(lambda: os.path.exists(d.control) or d.proc.poll() is not None, 20, "the control socket")
        assert d.proc.poll() is None, d.log()[-3000:]
        d.wait_all_active()
        pids = {n: u["pid"] for n, u in d.units().items()}
        d.reexec()
        stop.set()
        t.join(10)
        assert d.proc.poll() is None, d.log()[-3000:]
        assert {n: u["pid"] for n, u in d.units().items()} == pids
        wait_for(lambda: any(e.get("event") == "reload done" for e in d.log_events()), 15, "a reload")
        crashed = [e for e in d.log_events() if "crash" in str(e.get("event", "")) or e.get("exception")]
        assert not crashed and sent[0] > 100, (sent[0], crashed[:3])
    finally:
        stop.set()
        if t.is_alive():
            t.join(10)
        d.close()
