"""The `omnid` command line (DESIGN.md "Command line").

Exit codes: 0 ok, 1 the operation failed (reason printed), 2 usage or
configuration error, 3 no daemon running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DAEMON = 0, 1, 2, 3


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- client
class Client:
    """One request at a time over a DEALER socket, each reply awaited with a deadline."""

    def __init__(self, control: str) -> None:
        from omnid.control import ControlError, check_control_dir, socket_is_live
        from omnid.ownership import trusted_uids

        self.control = control
        try:  # issue #9: never talk to a socket another user could have planted
            check_control_dir(control, trusted_uids())
        except ControlError as exc:
            if os.path.lexists(os.path.dirname(os.path.abspath(control))):
                raise CliError(exc.message, EXIT_FAILED) from None
        if not os.path.exists(control) or not socket_is_live(control):
            raise CliError(f"no omnid daemon running (no control socket answering at {control})", EXIT_NO_DAEMON)
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{control}")
        self._n = 0

    def call(self, cmd: str, args: dict | None = None, timeout: float = 30.0):
        self._n += 1
        rid = f"{os.getpid()}-{self._n}"
        self.sock.send(json.dumps({"id": rid, "cmd": cmd, "args": args or {}}).encode())
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CliError(f"no answer to {cmd!r} from the daemon within {timeout:g} s")
            if self.sock.poll(min(left, 0.5) * 1000):
                reply = json.loads(self.sock.recv())
                if reply.get("id") != rid:
                    continue
                if not reply.get("ok"):
                    err = reply.get("error") or {}
                    code = EXIT_USAGE if err.get("code") in ("unknown_unit", "bad_request") else EXIT_FAILED
                    raise CliError(err.get("message") or "the daemon refused the request", code)
                return reply.get("result")
            if not os.path.exists(self.control):
                raise CliError(f"the daemon went away while answering {cmd!r}")

    def close(self) -> None:
        self.sock.close(0)


def subscribe(control: str):
    import zmq

    from omnid.control import events_path

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{events_path(control)}")
    return sub


# --------------------------------------------------------------------------- output
def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 120:
        return f"{s:.1f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def print_units(units: list[dict]) -> None:
    rows = [("UNIT", "ROLE", "STATE", "PID", "RESTARTS", "SINCE", "REASON")]
    for u in units:
        state = u["state"] + ("" if u["state"] != "active" or u.get("ready") else " (not ready)")
        rows.append((u["name"], u.get("role") or "-", state, str(u["pid"] or "-"), str(u["restarts"]),
                     _ago(u.get("since")), u.get("reason") or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:6])) + "  " + r[6])


def print_summary(summary: list[dict]) -> None:
    if not summary:
        print("nothing was running")
        return
    rows = [("UNIT", "SIGNAL", "EXIT", "ESCALATED", "GPU RELEASE", "RESIDUE")]
    for r in summary:
        secs = f"{r['seconds']:.3f}s" if r.get("seconds") is not None else "-"
        gpu = f"{r['gpu_release_ms']:.0f}ms" if r.get("gpu_release_ms") is not None else "-"
        residue = "none"
        if r.get("unkillable"):
            residue = "UNKILLABLE: " + "; ".join(r["unkillable"])
        elif r.get("residue"):
            residue = f"{len(r['residue'])} killed: " + "; ".join(r["residue"])
        rows.append((r["unit"], r["signal"], secs, "SIGKILL" if r["escalated"] else "no", gpu, residue))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:5])) + "  " + row[5])


def format_event(ev: dict) -> str:
    ts = datetime.fromtimestamp(ev.get("ts") or time.time()).strftime("%H:%M:%S.%f")[:-3]
    pid = f" pid {ev['pid']}" if ev.get("pid") else ""
    reason = f" — {ev['reason']}" if ev.get("reason") else ""
    return f"{ts} {ev.get('unit')}{pid}: {ev.get('from')} -> {ev.get('to')}{reason}"


# --------------------------------------------------------------------------- commands
def cmd_daemon(a: argparse.Namespace) -> int:
    from omnid import daemon

    return daemon.run(a.units, a.control, a.state_dir, a.health_listen, a.log_format)


def cmd_check(a: argparse.Namespace) -> int:
    from omnid.daemon import default_units_dir
    from omnid.units import check_stack, load_stack

    directory = os.path.abspath(a.units or default_units_dir())
    errors = check_stack(directory)
    if errors:
        print(f"{directory}: {len(errors)} error(s)", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
        return EXIT_USAGE
    stack = load_stack(directory)
    tiers = " -> ".join("[" + ", ".join(u.name for u in t) + "]" for t in stack.tiers())
    print(f"{directory}: ok, {len(stack)} units; start order {tiers}")
    return EXIT_OK


def _launch_daemon(a: argparse.Namespace, control: str) -> subprocess.Popen:
    from omnid.daemon import default_state_dir, default_units_dir
    from omnid.units import StackInvalid, load_stack

    units = os.path.abspath(a.units or default_units_dir())
    try:
        load_stack(units)
    except StackInvalid as exc:
        raise CliError(f"invalid stack in {units}:\n" + "\n".join(f"  {e}" for e in exc.errors), EXIT_USAGE) from None
    state_dir = a.state_dir or os.environ.get("OMNID_STATE_DIR") or default_state_dir()
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    logfile = Path(state_dir) / "daemon.log"
    argv = [sys.executable, "-m", "omnid", "--control", control, "daemon", "-u", units, "--state-dir", state_dir,
            "--log-format", a.log_format or "json"]
    if a.health_listen:
        argv += ["--health-listen", a.health_listen]
    with open(logfile, "ab") as log:
        # A new session: the daemon outlives this command and the terminal's Ctrl+C.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                close_fds=True)
    print(f"omnid: daemon started (pid {proc.pid}), units {units}, log {logfile}")
    from omnid.control import socket_is_live

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if os.path.exists(control) and socket_is_live(control):
            return proc
        code = proc.poll()
        if code is not None:
            tail = logfile.read_text(errors="replace").splitlines()[-15:]
            raise CliError(f"the daemon exited with code {code} before answering; last log lines:\n  "
                           + "\n  ".join(tail), EXIT_USAGE if code == 2 else EXIT_FAILED)
        time.sleep(0.05)
    raise CliError(f"the daemon did not open {control} within 30 s (log: {logfile})")


def cmd_start(a: argparse.Namespace) -> int:
    from omnid.control import socket_is_live

    control = a.control
    launched = None
    if not a.unit_names and not (os.path.exists(control) and socket_is_live(control)):
        launched = _launch_daemon(a, control)
    elif a.units and a.unit_names:
        raise CliError("-u applies when starting a new daemon; name units or a directory, not both", EXIT_USAGE)
    client = Client(control)
    sub = subscribe(control)
    t0 = time.monotonic()
    timeout = a.timeout
    args: dict = {"timeout": timeout}
    if a.unit_names:
        args["units"] = a.unit_names
    client.sock.send(json.dumps({"id": "start", "cmd": "start", "args": args}).encode())
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
                print(f"  [{time.monotonic() - t0:6.2f}s] {ev['unit']}: {ev['to']}"
                      + (f" ({ev['reason']})" if ev.get("reason") and ev["to"] != "active" else ""))
        if client.sock in ready:
            reply = json.loads(client.sock.recv())
            break
        if launched is not None and launched.poll() is not None:
            raise CliError(f"the daemon exited with code {launched.returncode} during start")
    if reply is None:
        raise CliError(f"the stack was not ready within {timeout:g} s")
    if not reply.get("ok"):
        raise CliError(reply["error"]["message"], EXIT_USAGE if reply["error"]["code"] == "unknown_unit" else 1)
    result = reply["result"]
    units = result["units"]
    print()
    print_units(units)
    if not result["ok"]:
        bad = [u for u in units if u["state"] != "active"]
        for u in bad:
            print(f"omnid: {u['name']} is {u['state']}: {u['reason'] or 'no reason recorded'}", file=sys.stderr)
        return EXIT_FAILED
    print(f"\nomnid: ready in {time.monotonic() - t0:.1f} s")
    if not a.unit_names:
        _print_hints(control)
    return EXIT_OK


def _print_hints(control: str) -> None:
    from omnid.daemon import default_units_dir

    try:
        st = Client(control).call("status", {}, timeout=5)
    except CliError:
        return
    units_dir = st["daemon"]["units_dir"]
    if os.path.abspath(units_dir) == os.path.abspath(default_units_dir()):
        port = os.environ.get("OMNID_DEMO_SERVE_PORT", "8000")
        print(f"try it:   curl -X POST http://127.0.0.1:{port}/v1/generate -d '{{\"prompt\": \"hi\"}}'")
    print("status:   omnid status        events: omnid events        stop: omnid stop")


def cmd_stop(a: argparse.Namespace) -> int:
    client = Client(a.control)
    if a.unit_names:
        result = client.call("stop", {"units": a.unit_names, "timeout": a.timeout}, timeout=a.timeout + 10)
        print_summary(result["summary"])
        return EXIT_FAILED if any(r.get("unkillable") for r in result["summary"]) else EXIT_OK
    result = client.call("shutdown", {}, timeout=a.timeout + 10)
    print_summary(result["summary"])
    # The daemon exits once it has answered: wait (bounded) until its socket is gone.
    deadline = time.monotonic() + 15
    while os.path.exists(a.control) and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.path.exists(a.control):
        print(f"omnid: warning: control socket {a.control} still present", file=sys.stderr)
    return EXIT_FAILED if any(r.get("unkillable") for r in result["summary"]) else EXIT_OK


def cmd_restart(a: argparse.Namespace) -> int:
    client = Client(a.control)
    result = client.call("restart", {"units": a.unit_names, "timeout": a.timeout}, timeout=2 * a.timeout + 10)
    print_units(result["units"])
    return EXIT_OK if result["ok"] else EXIT_FAILED


def cmd_status(a: argparse.Namespace) -> int:
    client = Client(a.control)
    args: dict = {"verify": a.verify}
    if a.unit_names:
        args["units"] = a.unit_names
    result = client.call("status", args, timeout=10)
    if a.json:
        out = {"units": result["units"]}
        if a.verify:
            out["verify"] = result["verify"]
        print(json.dumps(out, indent=2))
    else:
        print_units(result["units"])
    if a.verify:
        v = result["verify"]
        if not v["ok"]:
            for p in v["problems"]:
                print(f"omnid: state and kernel disagree: {p}", file=sys.stderr)
            return EXIT_FAILED
        if not a.json:
            print("verify: every unit's state matches /proc")
    return EXIT_OK


def cmd_kill(a: argparse.Namespace) -> int:
    client = Client(a.control)
    result = client.call("kill", {"unit": a.unit, "signal": a.signal}, timeout=10)
    print(f"sent {result['signal']} to {', '.join(result['signalled'])}")
    return EXIT_OK


def cmd_events(a: argparse.Namespace) -> int:
    Client(a.control).close()  # exits 3 when no daemon runs
    sub = subscribe(a.control)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            if sub.poll(500):
                ev = json.loads(sub.recv())
                print(json.dumps(ev) if a.json else format_event(ev), flush=True)
            elif not os.path.exists(a.control):
                print("omnid: the daemon went away", file=sys.stderr)
                return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_logs(a: argparse.Namespace) -> int:
    client = Client(a.control)
    result = client.call("logs", {"unit": a.unit, "n": a.n}, timeout=10)
    last: dict[str, float] = {}
    multi = len(result) > 1
    for name, lines in result.items():
        for item in lines:
            print(f"{name}: {item['line']}" if multi else item["line"])
        last[name] = lines[-1]["ts"] if lines else 0.0
    if not a.follow:
        return EXIT_OK
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            time.sleep(0.25)
            result = client.call("logs", {"unit": a.unit, "n": 500}, timeout=10)
            for name, lines in result.items():
                for item in lines:
                    if item["ts"] > last.get(name, 0.0):
                        print(f"{name}: {item['line']}" if multi else item["line"], flush=True)
                        last[name] = item["ts"]
    except KeyboardInterrupt:
        return EXIT_OK


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from omnid.daemon import default_control

    p = argparse.ArgumentParser(prog="omnid", description="process supervisor for GPU inference stacks")
    p.add_argument("--control", default=os.environ.get("OMNID_CONTROL") or default_control(),
                   help="control socket path (env OMNID_CONTROL)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def timeout_arg(sp: argparse.ArgumentParser, default: float) -> None:
        sp.add_argument("--timeout", type=_positive, default=default, help=f"seconds (default {default:g})")

    d = sub.add_parser("daemon", help="run the daemon in the foreground")
    d.add_argument("-u", "--units", help="stack directory (default: the built-in demo stack)")
    d.add_argument("--state-dir")
    d.add_argument("--health-listen", type=_host_port)
    d.add_argument("--log-format", choices=["json", "console"])
    d.set_defaults(func=cmd_daemon)

    s = sub.add_parser("start", help="start the daemon and the stack, or units of a running daemon")
    s.add_argument("unit_names", nargs="*", metavar="UNIT")
    s.add_argument("-u", "--units", help="stack directory for a new daemon (default: the demo stack)")
    s.add_argument("--state-dir")
    s.add_argument("--health-listen", type=_host_port)
    s.add_argument("--log-format", choices=["json", "console"])
    timeout_arg(s, 600)
    s.set_defaults(func=cmd_start)

    st = sub.add_parser("stop", help="stop units, or the whole stack and the daemon")
    st.add_argument("unit_names", nargs="*", metavar="UNIT")
    timeout_arg(st, 600)
    st.set_defaults(func=cmd_stop)

    r = sub.add_parser("restart", help="restart units")
    r.add_argument("unit_names", nargs="+", metavar="UNIT")
    timeout_arg(r, 600)
    r.set_defaults(func=cmd_restart)

    stat = sub.add_parser("status", help="show units")
    stat.add_argument("unit_names", nargs="*", metavar="UNIT")
    stat.add_argument("--json", action="store_true")
    stat.add_argument("--verify", action="store_true", help="check every unit's state against /proc")
    stat.set_defaults(func=cmd_status)

    k = sub.add_parser("kill", help="signal a unit's process group")
    k.add_argument("unit")
    k.add_argument("--signal", "-s", default="SIGTERM")
    k.set_defaults(func=cmd_kill)

    e = sub.add_parser("events", help="follow state changes")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_events)

    lg = sub.add_parser("logs", help="recent output of a unit")
    lg.add_argument("unit")
    lg.add_argument("-n", type=_non_negative_int, default=50)
    lg.add_argument("-f", "--follow", action="store_true")
    lg.set_defaults(func=cmd_logs)

    c = sub.add_parser("check", help="validate a stack directory")
    c.add_argument("-u", "--units", help="stack directory (default: the demo stack)")
    c.set_defaults(func=cmd_check)
    return p


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return v


def _host_port(text: str) -> str:
    from omnid.units import parse_host_port

    try:
        parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
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
