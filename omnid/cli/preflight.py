"""`omnid check`'s host checks: what a valid stack still needs from the host it runs
on (omnid(8)). A unit file can be perfect and fail at its first
start because its executable is not installed, its user or group does not exist,
or its working directory is missing: say so before starting.

The answers are about *this* host. `omnid check` prints them as warnings (the
stack may be meant for another host); `omnid check --this-host` makes them
errors (exit 2). NUMA placement (omnid.process.numa) adds notes: the unit's own numactl or
thread-pinning env (always), and, with --this-host, GPUs whose NUMA node cannot be read
here (a warning: the unit still starts, unplaced) and a `numa = N` this host has no
node N for (an error: that spawn would fail).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import sys
from dataclasses import dataclass

from omnid.process import numa
from omnid.process import sockets


@dataclass(frozen=True)
class HostProblem:
    unit: str
    file: str
    key: str
    message: str
    severity: str  # "error" (--this-host) or "warning"

    def __str__(self) -> str:
        return f"{self.severity}: {self.file}: {self.key}: {self.message} (unit {self.unit})"


def _unit_path(u) -> str:
    """The PATH the unit's exec is looked up in: its own env, else the daemon's with
    the interpreter's directory first (as the supervisor builds it)."""
    if "PATH" in u.env:
        return u.env["PATH"]
    return os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")


def _user_exists(name: str) -> bool:
    if name.isdigit():
        return True  # a numeric uid needs no passwd entry
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _group_exists(name: str) -> bool:
    if name.isdigit():
        return True
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


def check(stack, this_host: bool = False) -> list[HostProblem]:
    severity = "error" if this_host else "warning"
    out: list[HostProblem] = []
    seen: set[tuple[str, str]] = set()  # one report per template file and key, not per instance
    for u in stack:
        f = str(u.file)

        def add(key: str, message: str) -> None:
            if (f, key) not in seen:
                seen.add((f, key))
                out.append(HostProblem(u.name, f, key, message, severity))

        prog = u.exec[0]
        if os.sep in prog:
            base = prog if os.path.isabs(prog) else os.path.join(u.cwd or os.getcwd(), prog)
            if not os.path.exists(base):
                add("exec", f"{prog} does not exist on this host")
            elif not os.access(base, os.X_OK) or os.path.isdir(base):
                add("exec", f"{prog} is not an executable file")
        elif shutil.which(prog, path=_unit_path(u)) is None:
            add("exec", f"{prog!r} is not found in the unit's PATH on this host")
        if u.user is not None and not _user_exists(u.user):
            add("user", f"no user {u.user!r} on this host")
        if u.group is not None and not _group_exists(u.group):
            add("group", f"no group {u.group!r} on this host")
        if u.cwd is not None and not os.path.isdir(u.cwd):
            add("cwd", f"directory {u.cwd} does not exist on this host")
        for i, why in sockets.probe(u):
            add(f"sockets[{i}]", why + " (a daemon running this stack holds its own sockets: check it stopped, "
                "or read `omnid status`)")
        for key, note, fails in numa.unit_notes(u, this_host):
            if (f, "numa:" + key) not in seen:
                seen.add((f, "numa:" + key))
                out.append(HostProblem(u.name, f, key, note, severity if fails else "warning"))
    return out
