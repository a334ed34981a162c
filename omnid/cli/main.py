"""The `omnid` command line (omnid(8)): the commands and
the parser. Talking to the daemon lives in omnid.cli.client, what is printed in
omnid.cli.render, where settings come from in omnid.model.settings.

Exit codes: 0 ok, and nothing to show (a note on stderr); 1 the operation failed
(reason printed), 2 usage or configuration error, 3 no daemon running (except
`omnid stop`, which, like `systemctl stop` of a stopped unit, exits 0 when there is
nothing to stop), 141 the reader of the output went away (omnid(8), EXIT STATUS).
Output is text wherever it goes; JSON only with --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from omnid.cli.client import EXIT_FAILED, EXIT_NO_DAEMON, EXIT_OK, EXIT_USAGE, CliError, Client, subscribe
from omnid.cli.render import (format_event, format_log_line, human_seconds, log_line_json, print_captures, print_gpu,
                          print_reload_plan, print_restart_plan, print_status, print_summary, print_unit_detail,
                          print_units)

DAEMON_LOG_MAX = 8 << 20  # bytes; daemon.log is rotated to daemon.log.1 beyond this


def control_of(a: argparse.Namespace) -> str:
    """The control socket for commands that talk to a running daemon: flag > env > default."""
    from omnid.model import settings

    return os.path.abspath(a.control or os.environ.get("OMNID_CONTROL") or settings.default_control())


# --------------------------------------------------------------------------- commands
def cmd_daemon(a: argparse.Namespace) -> int:
    # SIGHUP means reload once the loop runs; until then (the imports, the handover) it must
    # not kill the daemon and every unit with it. Set first thing, before the heavy imports;
    # a re-exec arrives with it ignored already (handover.exec_takeover).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from omnid.base import linux
    from omnid.process import spawnstart

    if a.takeover is not None:  # omnid reexec: the spawner runs on; the new program takes it over
        from omnid.daemon import command

        return _daemon_exit(command.run_daemon_command(a.units, a.control, a.state_dir, a.health_listen,
                                                       a.log_format, log_file=a.log_file, cgroup_root=a.cgroup_root,
                                                       takeover=a.takeover))
    # The spawner first, by exec, while this process is small and has no thread: its
    # interpreter starts while the daemon loads the rest of itself (the first unit waits for
    # the longer of the two, not for both). Inherited fds stay out of it.
    linux.mark_fds_non_inheritable()
    spawner = spawnstart.launch()
    try:
        from omnid.daemon import command

        code = command.run_daemon_command(a.units, a.control, a.state_dir, a.health_listen, a.log_format,
                                          log_file=a.log_file, cgroup_root=a.cgroup_root, spawner=spawner)
    finally:
        spawner.close()  # only when the daemon stopped before taking it over
    return _daemon_exit(code)


def _daemon_exit(code: int) -> NoReturn:
    """The daemon's end, once everything it ran is stopped, its spawner reaped, its sockets,
    state file and lock closed or removed (omnid.daemon.shutdown) and its event loop ended
    (omnid.base.runloop): the process exits now, its output flushed. The interpreter's own
    teardown (every module and object of the daemon freed one by one, the libraries' exit
    hooks) has nothing left to do for anyone and cost 40-60 ms of every daemon's exit here."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone: nothing more can be said
            pass
    os._exit(code)


def cmd_check(a: argparse.Namespace) -> int:
    from omnid.cli import preflight
    from omnid.model.settings import default_units_dir
    from omnid.model.units import check_stack, load_stack

    if a.directory and a.units and os.path.abspath(a.directory) != os.path.abspath(a.units):
        raise CliError(f"two stack directories given ({a.directory} and -u {a.units}); give one", EXIT_USAGE)
    directory = os.path.abspath(a.directory or a.units or default_units_dir())
    errors = check_stack(directory)
    if errors:
        print(f"{directory}: {len(errors)} error(s)", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return EXIT_USAGE
    stack = load_stack(directory)
    problems = preflight.check(stack, this_host=a.this_host)
    tiers = " -> ".join("[" + ", ".join(u.name for u in t) + "]" for t in stack.tiers())
    errors_here = [p for p in problems if p.severity == "error"]
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    if errors_here:
        print(f"{directory}: {len(errors_here)} unit(s) will fail at first start on this host", file=sys.stderr)
        return EXIT_USAGE
    warn = f", {len(problems)} warning(s)" if problems else ""
    print(f"{directory}: ok, {len(stack)} units; start order {tiers}{warn}")
    return EXIT_OK


def _daemon_cause(logfile: Path, offset: int) -> str:
    """The one line that says why the daemon stopped: the first error it logged in
    this run (JSON or console lines), else its last line."""
    try:
        with open(logfile, "rb") as f:
            f.seek(offset)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return "(its log cannot be read)"
    last = ""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        last = line
        try:
            ev = json.loads(line)
        except ValueError:
            ev = None
        if isinstance(ev, dict):
            if ev.get("level") in ("error", "critical"):
                extra = "; ".join(f"{k}: {v}" for k, v in ev.items()
                                  if k not in ("event", "level", "timestamp", "logger"))
                return f"{ev.get('event')}" + (f" ({extra})" if extra else "")
            continue
        if line.startswith("omnid: "):
            return line[len("omnid: "):]
        if " [error" in line or "[error]" in line:
            return re.sub(r"\x1b\[[0-9;]*m", "", line)
    return last or "(nothing in its log)"


def _rotate(logfile: Path) -> None:
    try:
        if logfile.stat().st_size > DAEMON_LOG_MAX:
            os.replace(logfile, logfile.with_name(logfile.name + ".1"))
    except FileNotFoundError:
        pass


def _launch_daemon(a: argparse.Namespace, cfg, t0: float) -> tuple[subprocess.Popen, Path, int]:
    """Start `omnid daemon` in the background with only the flags the operator gave
    (it resolves the rest from the same environment and omnid.toml as cfg did)."""
    logfile = Path(cfg.state_dir) / "daemon.log"
    try:
        Path(cfg.state_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        _rotate(logfile)
        fd = os.open(logfile, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CliError(f"cannot write the daemon's log {logfile}: {exc.strerror}") from None
    offset = os.fstat(fd).st_size
    argv = [sys.executable, "-m", "omnid", "--control", cfg.control, "daemon", "-u", cfg.units_dir,
            "--log-file", str(logfile)]
    for flag, value in (("--state-dir", a.state_dir), ("--health-listen", a.health_listen),
                        ("--log-format", a.log_format), ("--cgroup-root", a.cgroup_root)):
        if value:
            argv += [flag, value]
    try:
        # A new session: the daemon outlives this command and the terminal's Ctrl+C.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                                close_fds=True)
    finally:
        os.close(fd)
    print(f"omnid: daemon started (pid {proc.pid}), units {cfg.units_dir}, log {logfile}", flush=True)
    print(f"  [{time.monotonic() - t0:6.2f}s] daemon: starting (pid {proc.pid})", flush=True)
    from omnid.api.control import socket_is_live

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise CliError(f"the daemon exited with code {code}: {_daemon_cause(logfile, offset)} "
                           f"(full log: {logfile})", EXIT_USAGE if code == 2 else EXIT_FAILED)
        if os.path.exists(cfg.control) and socket_is_live(cfg.control):
            return proc, logfile, offset
        time.sleep(0.02)
    raise CliError(f"the daemon did not open {cfg.control} within 30 s (full log: {logfile})")


class _Progress:
    """`omnid start`'s progress: one line per change of a unit; the snapshot and an event
    that says the same are one line."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.shown: dict[str, tuple] = {}
        self.printed = 0

    def seen(self, unit: str, state: str, reason: str | None) -> None:
        """Known already, not worth a line (attached to a daemon where it was up)."""
        self.shown[unit] = (state, reason)

    def __call__(self, unit: str, state: str, reason: str | None) -> None:
        if self.shown.get(unit) == (state, reason):
            return
        self.shown[unit] = (state, reason)
        self.printed += 1
        print(f"  [{time.monotonic() - self.t0:6.2f}s] {unit}: {state}"
              + (f" ({reason})" if reason and state != "active" and reason != state else ""), flush=True)


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def cmd_start(a: argparse.Namespace) -> int:
    from omnid.model import settings
    from omnid.api.control import socket_is_live
    from omnid.model.units import StackInvalid

    t0 = time.monotonic()
    if a.unit_names and a.units:
        raise CliError("-u applies when starting a new daemon; name units or a directory, not both", EXIT_USAGE)
    launched = logfile = None
    offset = 0
    if a.unit_names:
        control = control_of(a)
    else:
        try:
            _stack, cfg = settings.load_and_resolve(units_dir=a.units, control=a.control, state_dir=a.state_dir,
                                                    health_listen=a.health_listen, log_format=a.log_format)
        except StackInvalid as exc:
            raise CliError(f"invalid stack in {os.path.abspath(a.units or settings.default_units_dir())}:\n"
                           + "\n".join(f"  {e}" for e in exc.errors), EXIT_USAGE) from None
        control = cfg.control
        if os.path.exists(control) and socket_is_live(control):
            st = Client(control).call("status", {}, timeout=10)["daemon"]
            running = st["units_dir"]
            # With or without -u: the stack this command would start is cfg.units_dir (the
            # demo stack by default); attaching to a daemon that serves another one would act
            # on a stack the operator did not name.
            if os.path.realpath(running) != os.path.realpath(cfg.units_dir):
                raise CliError(f"the daemon at {control} runs the stack in {running}, not {cfg.units_dir}; "
                               f"stop it first (omnid stop), give the new stack its own --control, or act on "
                               f"the running one by unit name (omnid start UNIT)", EXIT_USAGE)
            # Like `systemctl start` of a running service: say so, and what is running.
            up = human_seconds(max(0.0, time.time() - st["since"])) if st.get("since") else "?"
            print(f"omnid: the daemon was already running (pid {st.get('pid')}, up {up}), "
                  f"units {running}", flush=True)
        else:
            launched, logfile, offset = _launch_daemon(a, cfg, t0)
    client = Client(control)
    # Subscribe first, then take a snapshot, then follow: no change falls in between.
    sub = None
    try:
        sub = subscribe(control)  # the launched daemon may close its socket between its answer and this
        snap = client.call("status", {}, timeout=10)["units"]
    except CliError:
        if sub is not None:
            sub.close(linger=0)
        # The daemon this command launched closed its control socket: it is going away. Its exit
        # (a stop of what it started, bounded) took over 5 s at load 20, and the cause it logged
        # is the answer, not "no daemon running": waited for as long as its launch was.
        if launched is not None and _wait_exit(launched, 30) is not None:
            raise CliError(f"the daemon exited with code {launched.returncode}: "
                           f"{_daemon_cause(logfile, offset)} (full log: {logfile})") from None
        raise
    progress = _Progress(t0)
    before = {u["name"]: u for u in snap}
    for u in snap:
        if launched is None and u["state"] == "active":
            # Attached to a running daemon: what is up already is no progress of this command
            # (the final table shows it); only what is not up, and every change from now on.
            progress.seen(u["name"], u["state"], u.get("reason"))
            continue
        progress(u["name"], u["state"], u.get("reason"))
    timeout = a.timeout
    args: dict = {"timeout": timeout}
    if a.unit_names:
        args["units"] = a.unit_names
    # A daemon this command launched starts its stack by itself: wait for that start to
    # settle, never start again (a unit that failed with restart = "no" runs once).
    cmd = "wait" if launched is not None else "start"
    client.sock.send(json.dumps({"id": "start", "cmd": cmd, "args": args}).encode())
    deadline = t0 + timeout + 10
    reply = None
    import zmq

    poller = zmq.Poller()
    poller.register(client.sock, zmq.POLLIN)
    poller.register(sub, zmq.POLLIN)
    while time.monotonic() < deadline:
        ready = dict(poller.poll(250))
        if sub in ready:
            while True:
                try:
                    ev = json.loads(sub.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                progress(ev["unit"], ev["to"], ev.get("reason"))
        if client.sock in ready:
            reply = json.loads(client.sock.recv())
            break
        if launched is not None and launched.poll() is not None:
            raise CliError(f"the daemon exited with code {launched.returncode} during start: "
                           f"{_daemon_cause(logfile, offset)} (full log: {logfile})")
    sub.close(0)
    if reply is None:
        raise CliError(f"the stack was not ready within {timeout:g} s")
    if not reply.get("ok"):
        # The daemon this command launched closed its control socket: it is going away. Its exit
        # (a stop of what it started, bounded) took over 5 s at load 20, and the cause it logged
        # is the answer, not "no daemon running": waited for as long as its launch was.
        if launched is not None and _wait_exit(launched, 30) is not None:
            raise CliError(f"the daemon exited with code {launched.returncode}: "
                           f"{_daemon_cause(logfile, offset)} (full log: {logfile})")
        raise CliError(reply["error"]["message"], EXIT_USAGE if reply["error"]["code"] == "unknown_unit" else 1)
    result = reply["result"]
    units = result["units"]
    # The reply's states are final: a change whose event was lost still gets its line.
    for u in units:
        progress(u["name"], u["state"], u.get("reason"))
    if progress.printed:
        print()
    print_units(units)
    if not result["ok"]:
        bad = [u for u in units if u["state"] != "active"]
        because: dict = {}
        if any(not u["reason"] for u in bad):  # never started: the failed unit it requires says why
            try:
                because = client.call("status", {}, timeout=5)["daemon"].get("down_because") or {}
            except CliError:
                pass
        for u in bad:
            why = u["reason"] or (f"not started: requires {because[u['name']]}, which failed"
                                  if u["name"] in because else "no reason recorded")
            print(f"omnid: {u['name']} is {u['state']}: {why}", file=sys.stderr)
        return EXIT_FAILED
    untouched = [u["name"] for u in units if launched is None and before.get(u["name"], {}).get("state") == "active"
                 and before[u["name"]].get("pid") == u.get("pid")]
    if untouched and len(untouched) == len(units):
        print(f"\nomnid: already active, nothing started: {', '.join(untouched)}")
    else:
        print(f"\nomnid: ready in {time.monotonic() - t0:.1f} s")
    if not a.unit_names:
        _print_hints(client)
    return EXIT_OK


def _print_hints(client: Client) -> None:
    from omnid.model.settings import default_units_dir

    try:
        st = client.call("status", {}, timeout=5)
    except CliError:
        return
    units_dir = st["daemon"]["units_dir"]
    if os.path.abspath(units_dir) == os.path.abspath(default_units_dir()):
        port = os.environ.get("OMNID_DEMO_SERVE_PORT", "8000")
        print(f"try it:   curl -X POST http://127.0.0.1:{port}/v1/generate -d '{{\"prompt\": \"hi\"}}'")
    print("status:   omnid status        events: omnid events        stop: omnid stop")


def cmd_stop(a: argparse.Namespace) -> int:
    control = control_of(a)
    try:
        client = Client(control)
    except CliError as exc:
        if exc.code == EXIT_NO_DAEMON:
            # Like `systemctl stop` of a stopped unit: the wanted state holds; exit 0.
            print(f"omnid: no daemon running at {control}; nothing to stop", file=sys.stderr)
            return EXIT_OK
        raise
    if a.unit_names:
        result = client.call("stop", {"units": a.unit_names, "timeout": a.timeout}, timeout=a.timeout + 10)
        print_summary(result["summary"])
        return EXIT_FAILED if any(r.get("unkillable") for r in result["summary"]) else EXIT_OK
    result = client.call("shutdown", {}, timeout=a.timeout + 10)
    print_summary(result["summary"])
    # The daemon exits once it has answered: wait (bounded) until its socket is gone.
    deadline = time.monotonic() + 15
    while os.path.exists(control) and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.path.exists(control):
        print(f"omnid: warning: control socket {control} still present", file=sys.stderr)
    return EXIT_FAILED if any(r.get("unkillable") for r in result["summary"]) else EXIT_OK


def cmd_restart(a: argparse.Namespace) -> int:
    """Say what else restarts and why (worker group, units that require it), then do it."""
    client = Client(control_of(a))
    roll = {"rolling": True} if a.rolling else {}
    first = client.call("restart", {"units": a.unit_names, "dry_run": True, "timeout": a.timeout, **roll},
                        timeout=2 * a.timeout + 10)
    if "plan" not in first:  # a daemon older than the plan restarted already: its answer is the result
        print_units(first["units"])
        return EXIT_OK if first["ok"] else EXIT_FAILED
    if a.rolling:
        plan = first["plan"]
        print(f"rolling restart of {', '.join(p['unit'] for p in plan)}: {plan[0]['why']}")
    else:
        print_restart_plan(first["plan"])
    if a.dry_run:
        return EXIT_OK
    result = client.call("restart", {"units": a.unit_names, "timeout": a.timeout, **roll},
                         timeout=2 * a.timeout + 10)
    print()
    print_units(result["units"])
    if result.get("stopped"):
        print(f"omnid: {result['stopped']}", file=sys.stderr)
    return EXIT_OK if result["ok"] else EXIT_FAILED


def cmd_reload(a: argparse.Namespace) -> int:
    """Print the plan (a dry run), then apply it and wait like `restart`."""
    client = Client(control_of(a))
    plan = client.call("reload", {"dry_run": True}, timeout=60)
    print_reload_plan(plan)
    if a.dry_run:
        return EXIT_OK
    if not (plan["added"] or plan["removed"] or plan["restarted"] or plan["updated"]):
        return EXIT_OK
    result = client.call("reload", {"timeout": a.timeout}, timeout=2 * a.timeout + 10)
    if {k: result[k] for k in ("added", "removed", "restarted", "updated")} != \
            {k: plan[k] for k in ("added", "removed", "restarted", "updated")}:
        print("omnid: the stack directory changed after the plan above; applied instead:")
        print_reload_plan(result)
    if result.get("units"):
        print()
        print_units(result["units"])
    if result.get("stopped"):
        print(f"omnid: {result['stopped']}", file=sys.stderr)
    return EXIT_OK if result.get("ok", True) else EXIT_FAILED


def cmd_reexec(a: argparse.Namespace) -> int:
    """Hand the running daemon over to the omnid installed now; wait until the new program
    answers (the control socket is bound again by it) and say which versions."""
    control = control_of(a)
    reply = Client(control).call("reexec", {}, timeout=60)
    print(f"re-executing daemon pid {reply['pid']}: omnid {reply['old_version']} -> {reply['new_version']}")
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        try:
            # short: a request the closing program took in is lost, the next one is answered
            st = Client(control).call("status", {}, timeout=1)["daemon"]
        except CliError:
            time.sleep(0.05)  # the socket is closed while the program changes
            continue
        if st.get("program_since", 0) > reply["program_since"]:
            units = Client(control).call("status", {}, timeout=5)["units"]
            running = sum(1 for u in units if u.get("pid"))
            print(f"re-executed: omnid {st['version']} answers (pid {st['pid']}, re-exec {st['reexecs']}, "
                  f"{running} unit processes kept)")
            if st.get("handover_error"):
                print(f"omnid: the handover could not be used: {st['handover_error']}", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        time.sleep(0.05)
    raise CliError(f"the daemon did not answer as re-executed within {a.timeout:g} s (see its log)")


def cmd_status(a: argparse.Namespace) -> int:
    client = Client(control_of(a))
    args: dict = {"verify": a.verify}
    if a.unit_names:
        args["units"] = a.unit_names
    result = client.call("status", args, timeout=10)
    if a.json:
        out = {"units": result["units"], "daemon": result.get("daemon", {})}
        if a.verify:
            out["verify"] = result["verify"]
        print(json.dumps(out, indent=2))
    elif a.unit_names:
        for i, u in enumerate(result["units"]):
            if i:
                print()
            lines = client.call("logs", {"unit": u["name"], "n": a.lines}, timeout=10).get(u["name"], [])
            print_unit_detail(u, lines)
    else:
        print_status(result["units"], result.get("daemon", {}), full=a.full)
    if not a.json:
        print_gpu(result.get("daemon", {}).get("gpu"))
    if a.verify:
        v = result["verify"]
        if not v["ok"]:
            for p in v["problems"]:
                print(f"omnid: state and kernel disagree: {p}", file=sys.stderr)
            return EXIT_FAILED
        if not a.json:
            print("verify: every unit's state matches /proc")
    return EXIT_OK


def cmd_dump(a: argparse.Namespace) -> int:
    from omnid.forensics.capture import MAX_BUDGET_S

    client = Client(control_of(a))
    timeout = MAX_BUDGET_S + 30 if a.now else 30
    result = client.call("dump", {"unit": a.unit, "last": a.last, "now": a.now}, timeout=timeout)
    caps = result["captures"]
    if a.json:
        print(json.dumps([c["capture"] for c in caps], indent=2))
    else:
        print_captures(caps)
    if not caps:
        print(f"omnid: no capture of {a.unit} kept: omnid captures a unit when it kills it alive "
              f"(watchdog, liveness, ready_timeout, stop_timeout); `omnid dump {a.unit} --now` captures it now",
              file=sys.stderr)
    return EXIT_OK


def cmd_kill(a: argparse.Namespace) -> int:
    client = Client(control_of(a))
    # omnid-control(7) takes a name or a number: pass numbers through as numbers.
    sig: str | int = int(a.signal) if a.signal.isdigit() else a.signal
    result = client.call("kill", {"unit": a.unit, "signal": sig}, timeout=10)
    print(f"sent {result['signal']} to {', '.join(result['signalled'])}")
    return EXIT_OK


def cmd_events(a: argparse.Namespace) -> int:
    control = control_of(a)
    client = Client(control)  # exits 3 when no daemon runs
    # Subscribe first, then print the current state, then follow: nothing falls in between.
    sub = subscribe(control)
    snap = client.call("status", {}, timeout=10)["units"]
    client.close()
    now = time.time()
    for u in snap:
        # Stamped with the time of the change that led to the state, not of this request.
        ev = {"ts": u.get("since") or now, "unit": u["name"], "pid": u.get("pid"), "from": None, "to": u["state"],
              "reason": u.get("reason") or None, "current": True}
        print(json.dumps(ev) if a.json else format_event(ev), flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            if sub.poll(500):
                ev = json.loads(sub.recv())
                print(json.dumps(ev) if a.json else format_event(ev), flush=True)
            elif not os.path.exists(control):
                print("omnid: the daemon went away", file=sys.stderr)
                return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        sub.close(0)


def parse_since(text: str, now: float | None = None) -> float:
    """--since: seconds ago with a unit ("90s", "5m", "2h", "1d"), an epoch number, or an
    ISO 8601 time ("2026-01-02T15:04:05", local time unless it says otherwise)."""
    from datetime import datetime

    now = time.time() if now is None else now
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)\s*", text)
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a time such as 10m, 2h, 1d, an epoch number or 2026-01-02T15:04:05, got {text!r}") from None


def cmd_logs(a: argparse.Namespace) -> int:
    client = Client(control_of(a))
    # Text wherever it goes (a pipe to grep sees what a person saw), JSON only when asked:
    # as journalctl, kubectl logs and docker logs do.
    as_json = a.json
    n = 2000 if a.since is not None else a.n
    result = client.call("logs", {"unit": a.unit, "n": n}, timeout=10)
    multi = len(result) > 1

    def show(name: str, item: dict) -> None:
        print(log_line_json(item, name) if as_json else format_log_line(item, name if multi else None), flush=True)

    last: dict[str, float] = {}
    shown = 0
    for name, lines in result.items():
        if a.since is not None:
            lines = [i for i in lines if i["ts"] >= a.since][-a.n:] if a.n else []
        for item in lines:
            show(name, item)
        shown += len(lines)
        last[name] = result[name][-1]["ts"] if result[name] else 0.0
    if not shown and a.n:
        # Nothing to show is no failure (omnid(8), EXIT STATUS): exit 0, a note on stderr only.
        since = " since then" if a.since is not None else ""
        print(f"omnid: no output of {a.unit} kept{since}", file=sys.stderr)
    if not a.follow:
        return EXIT_OK
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            time.sleep(0.25)
            result = client.call("logs", {"unit": a.unit, "n": 2000}, timeout=10)
            for name, lines in result.items():
                for item in lines:
                    if item["ts"] > last.get(name, 0.0):
                        show(name, item)
                        last[name] = item["ts"]
    except KeyboardInterrupt:
        return EXIT_OK

def cmd_example(a: argparse.Namespace) -> int:
    """Write a working stack for a real engine (omnid.cli.examples); nothing is started."""
    import shutil

    from omnid.cli import examples

    python = a.python if os.path.isabs(a.python) else shutil.which(a.python)
    if python is None or not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise CliError(f"--python {a.python}: not an executable file (give vLLM's interpreter, e.g. "
                       "/opt/vllm/.venv/bin/python)", EXIT_USAGE)
    model = a.model
    if os.path.isdir(model):
        model = os.path.abspath(model)  # a unit's cwd is not this shell's
    stack = examples.VllmStack(python=os.path.abspath(python), model=model, port=a.port, instances=a.instances,
                               served_name=a.served_model_name or "", engine_args=tuple(a.engine_args))
    try:
        written = examples.write_vllm(a.directory, stack)
    except examples.ExampleError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    for path in written:
        print(path)
    print(f"check it with: omnid check {written[0].parent}; start it with: omnid start -u {written[0].parent}",
          file=sys.stderr)
    return EXIT_OK


def cmd_completion(a: argparse.Namespace) -> int:
    from omnid.cli import completion

    parser = build_parser()
    print(completion.bash_script(parser) if a.shell == "bash" else completion.zsh_script(parser), end="")
    return EXIT_OK


def cmd_complete(a: argparse.Namespace) -> int:
    """Hidden: what the completion script asks while a shell waits (unit names, quietly)."""
    from omnid.cli import completion

    return completion.print_units(control_of(a))


# --------------------------------------------------------------------------- parser
def _version() -> str:
    from omnid.version import version

    return version()


class _Parser(argparse.ArgumentParser):
    """argparse, saying which choice was meant: `omnid stauts` -> did you mean status?"""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices and isinstance(value, str):
            import difflib

            choices = [str(c) for c in action.choices if not str(c).startswith("__")]  # hidden ones
            close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
            what = "command" if isinstance(action, argparse._SubParsersAction) else "choice"
            hint = f"; did you mean {close[0]}?" if close else ""
            raise argparse.ArgumentError(action, f"invalid {what} {value!r}{hint} (choose from "
                                                 f"{', '.join(choices)})")
        super()._check_value(action, value)


MAN_PAGES = {"omnid": "8", "omnid.unit": "5", "omnid-control": "7"}


def man_page(page: str) -> Path | None:
    """Where a manual page is: installed under the interpreter's prefix (pip install puts it in
    share/man), else in the checkout an editable install runs from."""
    sect = MAN_PAGES[page]
    for candidate in (Path(sys.prefix) / "share" / "man" / f"man{sect}" / f"{page}.{sect}",
                      Path(__file__).resolve().parents[2] / "man" / f"{page}.{sect}"):
        if candidate.is_file():
            return candidate
    return None


def cmd_man(a: argparse.Namespace) -> int:
    path = man_page(a.page)
    if path is None:
        raise CliError(f"the {a.page}({MAN_PAGES[a.page]}) page is not installed with this omnid "
                       f"(looked in {sys.prefix}/share/man and beside the omnid package)")
    if a.path:
        print(path)
        return EXIT_OK
    import shutil

    if shutil.which("man") is None:
        raise CliError(f"man is not installed; the page is {path} (mandoc -a {path}, or read it as text)")
    os.execvp("man", ["man", "-l", str(path)])
    return EXIT_FAILED  # not reached: exec replaced this process


class _VersionAction(argparse.Action):
    """--version, looked up only when asked: importlib.metadata costs every other command ~10 ms."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object) -> None:
        print(f"omnid {_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnid", description="process supervisor for GPU inference stacks",
                epilog="exit codes: 0 ok; nothing to show: 0 (a note on stderr, nothing on stdout); 1 the "
                       "operation failed; 2 usage or configuration error; 3 no daemon running (omnid stop: 0); "
                       "141 the reader of the output went away (| head), quietly. Output is text wherever it "
                       "goes, JSON only with --json. See omnid(8).")
    p.add_argument("--version", action=_VersionAction)
    p.add_argument("--control", default=None, metavar="PATH",
                   help="control socket path (default: $OMNID_CONTROL, then omnid.toml's control for start, "
                        "then /run/omnid/control.sock as root)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def timeout_arg(sp: argparse.ArgumentParser, default: float, what: str) -> None:
        sp.add_argument("--timeout", type=_positive, default=default, metavar="SECONDS",
                        help=f"how long to wait for {what} (default {default:g})")

    def daemon_settings(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--state-dir", metavar="DIR",
                        help="state file, lock and daemon.log (default: $OMNID_STATE_DIR, omnid.toml, "
                             "/var/lib/omnid as root)")
        sp.add_argument("--health-listen", type=_host_port, metavar="HOST:PORT",
                        help="health API address, numeric host (default: $OMNID_HEALTH_LISTEN, omnid.toml, "
                             "127.0.0.1:9321)")
        sp.add_argument("--log-format", choices=["json", "console"],
                        help="daemon log lines (default: $OMNID_LOG_FORMAT, omnid.toml, console on a "
                             "terminal, else json)")
        sp.add_argument("--cgroup-root", metavar="DIR",
                        help="writable cgroup v2 directory for the units' cgroups (default: $OMNID_CGROUP_ROOT, "
                             "omnid.toml, the delegated service cgroup under systemd, else process groups only)")

    d = sub.add_parser("daemon", help="run the daemon in the foreground (systemd's ExecStart)")
    d.add_argument("-u", "--units", metavar="DIR", help="stack directory (default: the built-in demo stack)")
    daemon_settings(d)
    d.add_argument("--log-file", metavar="PATH",
                   help="the file stderr goes to, rotated to PATH.1 beyond 8 MiB (omnid start sets it)")
    # omnid reexec: the fd of what the previous program of this daemon handed over.
    d.add_argument("--takeover", type=int, metavar="FD", help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_daemon)

    s = sub.add_parser("start", help="start the daemon and the stack, or units of a running daemon")
    s.add_argument("unit_names", nargs="*", metavar="UNIT", help="units of the running daemon to start")
    s.add_argument("-u", "--units", metavar="DIR",
                   help="stack directory for a new daemon (default: the demo stack); refused (exit 2) when "
                        "a daemon already runs another stack on the same control socket")
    daemon_settings(s)
    timeout_arg(s, 600, "the stack to be ready")
    s.set_defaults(func=cmd_start)

    st = sub.add_parser("stop", help="stop units, or the whole stack and the daemon (exit 0 if none runs)")
    st.add_argument("unit_names", nargs="*", metavar="UNIT", help="units to stop (default: all, and the daemon)")
    timeout_arg(st, 600, "the stop")
    st.set_defaults(func=cmd_stop)

    r = sub.add_parser("restart", help="restart units (and their worker group, and the units that require them)",
                       description="Stop the units and start them again. A member of a worker group restarts its "
                                   "whole group (its ranks are one job); units that require a restarted unit, "
                                   "directly or through others, and are up are stopped before it and started "
                                   "after it. Every unit this pulls in is listed, with why, before anything is "
                                   "done. RESTARTS in omnid status counts automatic restarts only; this one is "
                                   "not counted.")
    r.add_argument("unit_names", nargs="+", metavar="UNIT", help="units to restart")
    r.add_argument("--dry-run", action="store_true", help="list what would restart, and why; change nothing")
    r.add_argument("--rolling", action="store_true",
                   help="replace the instances max_unavailable at a time, each next one once the new one is "
                        "ready; units that require it keep running; a failing new instance stops the roll "
                        "(not for worker groups)")
    timeout_arg(r, 600, "the units to be back")
    r.set_defaults(func=cmd_restart)

    rx = sub.add_parser("reexec", help="replace the daemon's program with the omnid installed now; units keep running")
    rx.add_argument("--timeout", type=float, default=60.0, metavar="S",
                    help="how long to wait for the new program to answer (default 60)")
    rx.set_defaults(func=cmd_reexec)

    rl = sub.add_parser("reload", help="re-read the stack directory and apply only what changed (SIGHUP too)")
    rl.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    timeout_arg(rl, 600, "the changed units to be back")
    rl.set_defaults(func=cmd_reload)

    stat = sub.add_parser("status", help="show units; with UNIT, one unit in detail and its last log lines")
    stat.add_argument("unit_names", nargs="*", metavar="UNIT", help="units to show in detail")
    stat.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    stat.add_argument("--verify", action="store_true", help="check every unit's state against /proc")
    stat.add_argument("-l", "--full", action="store_true",
                      help="on a terminal, do not cut table rows at its width (into a pipe they never are)")
    stat.add_argument("-n", "--lines", type=_non_negative_int, default=10, metavar="N",
                      help="log lines in the detail view (default 10)")
    stat.set_defaults(func=cmd_status)

    k = sub.add_parser("kill", help="signal a unit's process group")
    k.add_argument("unit", metavar="UNIT", help="the unit to signal")
    k.add_argument("--signal", "-s", default="SIGTERM", metavar="SIGNAL",
                   help="name (SIGTERM, TERM) or number (15); default SIGTERM")
    k.set_defaults(func=cmd_kill)

    dp = sub.add_parser("dump", help="what a unit's processes were doing when omnid last killed it alive "
                                     "(state, wchan, kernel and Python stacks)")
    dp.add_argument("unit", metavar="UNIT", help="the unit (a template name covers every instance)")
    dp.add_argument("--last", type=_positive_int, default=1, metavar="N", help="the last N captures (default 1)")
    dp.add_argument("--now", action="store_true", help="capture the running unit now (and keep it)")
    dp.add_argument("--json", action="store_true", help="the captures as JSON")
    dp.set_defaults(func=cmd_dump)

    e = sub.add_parser("events", help="print every unit's current state, then follow state changes")
    e.add_argument("--json", action="store_true", help="one JSON object a line")
    e.set_defaults(func=cmd_events)

    lg = sub.add_parser("logs", help="recent output of a unit, with timestamps and stream")
    lg.add_argument("unit", metavar="UNIT", help="the unit (a template name covers every instance)")
    lg.add_argument("-n", "--lines", dest="n", type=_non_negative_int, default=50, metavar="N",
                    help="how many of the last lines (default 50)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    lg.add_argument("--since", type=parse_since, metavar="TIME",
                    help="only lines since TIME: 10m, 2h, 1d, epoch seconds or 2026-01-02T15:04:05")
    fmt = lg.add_mutually_exclusive_group()
    fmt.add_argument("--json", dest="json", action="store_true", default=False,
                     help="one JSON object a line (ts, unit, stream, line); without it, text wherever "
                          "it goes, a pipe too")
    # Text is the default now; --text stays accepted for scripts written when a pipe got JSON.
    fmt.add_argument("--text", dest="json", action="store_false", help=argparse.SUPPRESS)
    lg.set_defaults(func=cmd_logs)

    c = sub.add_parser("check", help="validate a stack directory and what its units need on this host")
    c.add_argument("directory", nargs="?", metavar="DIR", help="stack directory (default: the demo stack)")
    c.add_argument("-u", "--units", metavar="DIR", help="the same, as start and daemon take it")
    c.add_argument("--this-host", action="store_true",
                   help="the stack runs on this host: a missing executable, user, group or cwd is an error "
                        "(exit 2), not a warning")
    c.set_defaults(func=cmd_check)

    ex = sub.add_parser("example", usage="omnid example vllm DIR --python PY --model MODEL --port PORT [--instances N] "
                                         "[--served-model-name NAME] [-- VLLM_ARG ...]", help="write a working stack for a real engine into DIR (vllm: one unit on a "
                                        "socket omnid holds, with its launcher)",
                        description="Write DIR/vllm.toml, the unit the test suite runs against real vLLM (probes, "
                                    "kill_mode, drain and restart settings, each with a comment saying why), and "
                                    "DIR/vllm_listenfd.py, the launcher that serves vLLM's API server on the "
                                    "socket omnid holds, so a crash or restart refuses no connection. Arguments "
                                    "after -- go to vLLM unchanged. Nothing is started: omnid check DIR, then "
                                    "omnid start -u DIR.")
    ex.add_argument("engine", choices=["vllm"], help="the engine")
    ex.add_argument("directory", metavar="DIR", help="where to write the stack (made if missing)")
    ex.add_argument("--python", required=True, metavar="PY", help="the interpreter of vLLM's environment")
    ex.add_argument("--model", required=True, metavar="MODEL", help="a model name or directory (--model of vLLM)")
    ex.add_argument("--port", required=True, type=_port, metavar="PORT", help="the API's port on 127.0.0.1")
    ex.add_argument("--instances", type=_positive_int, default=1, metavar="N",
                    help="N engines sharing one socket on PORT, each probed on its own port (PORT's tens + 1, "
                         "then its number): one engine's crash leaves the others serving (default 1)")
    ex.add_argument("--served-model-name", metavar="NAME", help="the name clients ask for (default: MODEL)")
    ex.set_defaults(func=cmd_example, engine_args=[])

    cp = sub.add_parser("completion", help="print a shell completion script (commands, options, unit names "
                                           "of the running stack)",
                        description="Print a completion script for bash or zsh: source <(omnid completion bash), "
                                    "or save it as /usr/share/bash-completion/completions/omnid (bash) or as "
                                    "_omnid in a directory of $fpath (zsh). Unit names are asked of the running "
                                    "daemon when completing, quietly.")
    cp.add_argument("shell", choices=["bash", "zsh"], help="the shell")
    cp.set_defaults(func=cmd_completion)

    hidden = sub.add_parser("__complete")  # no help=: not listed, not offered for completion
    hidden.add_argument("what", choices=["units"], help="units: the running stack's unit names, one a line")
    hidden.set_defaults(func=cmd_complete)

    m = sub.add_parser("man", help="show a manual page: omnid(8), omnid.unit(5) or omnid-control(7)")
    m.add_argument("page", nargs="?", default="omnid", choices=list(MAN_PAGES),
                   help="which page (default omnid)")
    m.add_argument("--path", action="store_true", help="print where the page is instead of showing it")
    m.set_defaults(func=cmd_man)
    return p


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    v = _non_negative_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a number from 1 up, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return v


def _port(text: str) -> int:
    v = _non_negative_int(text)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {text!r}")
    return v


def _host_port(text: str) -> str:
    from omnid.model.units import parse_host_port

    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


EXIT_READER_GONE = 128 + signal.SIGPIPE  # what a shell reports for a tool that SIGPIPE ended


def _reader_gone() -> int:
    """The reader of our output went away (`omnid status | head -1`): stop quietly, as a
    Unix tool killed by SIGPIPE does. stdout is pointed at /dev/null so that the flush at
    interpreter exit does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_READER_GONE


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        return _reader_gone()


def _main(argv: list[str] | None) -> int:
    # The cyclic GC is off while the command's modules load: they allocate objects that live as
    # long as the process, and the collections they set off walked them again and again (with
    # an ldconfig fork gone too, a one-unit daemon's first child 117 -> 110 ms here). The daemon
    # turns it on once its first tier is out and the rest is loaded (omnid.daemon.main: frozen
    # first); every other command once its arguments are read.
    gc.disable()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    passed: list[str] | None = None
    if "--" in argv and "example" in argv[:argv.index("--")]:
        # omnid example ... -- VLLM_ARG...: what follows goes to the engine as given (argparse
        # would take an engine's --option for one of ours).
        at = argv.index("--")
        argv, passed = argv[:at], argv[at + 1:]
    a = parser.parse_args(argv)
    if getattr(a, "func", None) is not cmd_daemon:
        gc.enable()
    if passed is not None:
        a.engine_args = passed
    if a.control:
        a.control = os.path.abspath(a.control)
    try:
        return a.func(a)
    except CliError as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130

if __name__ == "__main__":
    sys.exit(main())
