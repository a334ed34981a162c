"""The spawner protocol's messages as typed values, and their encoding (omnid/process/spawner.py
documents the protocol).

Typed on both edges: the daemon's `SpawnRequest` goes out through `spawn_wire` and
`batch_datagrams` (a turn's spawns in as few datagrams as the kernel's fd limit allows, their
common environment once), and every datagram from the spawner is decoded once, by `decode`,
into one of the frozen dataclasses here; nothing downstream reads a raw dict. The spawner
itself does not import this module (it stays light: no dataclasses), so a field changed here
is changed in omnid/process/spawner.py and omnid/process/spawnexec.py too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from omnid.model import accounts
from omnid.process.numa import Placement

MAX_MESSAGE = 1 << 20
MAX_BATCH_FDS = 250  # fds in one datagram (the kernel's SCM_MAX_FD is 253)
MAX_BATCH_BYTES = MAX_MESSAGE // 2


# -- daemon -> spawner ------------------------------------------------------------------
@dataclass(frozen=True)
class SpawnRequest:
    unit: str
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None = None
    user: str | None = None
    group: str | None = None
    rlimits: tuple[tuple[int, int, int], ...] = ()
    cgroup: str | None = None
    # CPU affinity and memory policy set before exec (omnid.numa.placement_for); None = none.
    placement: Placement | None = None
    # The program to execve, found in the unit's PATH by the daemon (argv[0] stays as the
    # unit wrote it); None: the child looks argv[0] up itself.
    path: str | None = None
    # Listening sockets (omnid.process.sockets) and stored fds the child gets as fds 3, 4, ... with
    # LISTEN_PID set to its own pid; LISTEN_FDS and LISTEN_FDNAMES are in `env`.
    listen_fds: tuple[int, ...] = ()


def spawn_wire(rid: int, req: SpawnRequest) -> dict:
    """The spawn request as the spawner reads it (see omnid/process/spawner.py)."""
    return {"op": "spawn", "id": rid, "unit": req.unit, "argv": list(req.argv), "env": req.env, "cwd": req.cwd,
            "user": req.user, "group": req.group, "rlimits": [list(r) for r in req.rlimits], "cgroup": req.cgroup,
            "placement": req.placement.to_wire() if req.placement is not None else None, "path": req.path,
            "nlisten": len(req.listen_fds), "ids": _ids(req)}


def _ids(req: SpawnRequest) -> dict | None:
    """The request's user and group as resolved when the stack was read (omnid.model.accounts),
    so that the spawner asks NSS nothing (a hung LDAP would stall every spawn and reap)."""
    if not req.user and not req.group:
        return None
    a = accounts.of(req.user, req.group)
    return {"uid": a.uid, "gid": a.gid, "groups": None if a.groups is None else list(a.groups), "error": a.error}


@dataclass
class QueuedSpawn:
    """A spawn waiting for the end of this turn of the loop."""

    rid: int
    wire: dict  # spawn_wire without its env
    env: dict[str, str]
    fds: list[int]  # the caller's, which it keeps open until its spawn() returns


def batch_datagrams(queued: list[QueuedSpawn]) -> list[tuple[bytes, list[int], list[QueuedSpawn]]]:
    """The queued spawns as datagrams: each with the first spawn's environment as the base
    and, per spawn, only what differs; within the kernel's fd limit and MAX_BATCH_BYTES."""
    out: list[tuple[bytes, list[int], list[QueuedSpawn]]] = []
    i = 0
    while i < len(queued):
        base = queued[i].env
        head = b'{"op": "spawn", "env": ' + json.dumps(base).encode() + b', "batch": ['
        items: list[bytes] = []
        fds: list[int] = []
        taken: list[QueuedSpawn] = []
        size = len(head)
        while i < len(queued):
            q = queued[i]
            delta = {k: v for k, v in q.env.items() if base.get(k) != v} if q.env is not base else {}
            unset = [k for k in base if k not in q.env] if q.env is not base else []
            item = json.dumps({**q.wire, "env": delta, "unset": unset, "nfds": len(q.fds)}).encode()
            if taken and (len(fds) + len(q.fds) > MAX_BATCH_FDS or size + len(item) > MAX_BATCH_BYTES):
                break
            items.append(item)
            fds.extend(q.fds)
            taken.append(q)
            size += len(item) + 2
            i += 1
        out.append((head + b", ".join(items) + b"]}", fds, taken))
    return out


# -- spawner -> daemon ------------------------------------------------------------------
@dataclass(frozen=True)
class ExitReport:
    pid: int
    status: int
    adopted: bool


class ProtocolError(ValueError):
    """A spawner message that does not have the shape this module expects."""


@dataclass(frozen=True)
class Hello:
    pid: int
    exec_path: str | None = None  # "compiled" (omnid.process._spawnc) or "python": how children are set up


@dataclass(frozen=True)
class SpawnedMsg:
    id: int
    pid: int
    start_time: int


@dataclass(frozen=True)
class SpawnFailedMsg:
    id: int
    error: str
    errno: int = 0  # exec(2)'s errno when exec failed, else 0


SpawnerMessage = Hello | SpawnedMsg | SpawnFailedMsg | ExitReport

_FIELDS: dict[str, tuple[type, tuple[tuple[str, type], ...]]] = {
    "hello": (Hello, (("pid", int),)),
    "spawned": (SpawnedMsg, (("id", int), ("pid", int), ("start_time", int))),
    "spawn_failed": (SpawnFailedMsg, (("id", int), ("error", str), ("errno", int))),
    "exit": (ExitReport, (("pid", int), ("status", int), ("adopted", bool))),
}


def decode(msg: object) -> SpawnerMessage:
    """One spawner datagram (parsed JSON) as its typed message; ProtocolError names the op and field."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, not an object")
    op = msg.get("op")
    if op not in _FIELDS:
        raise ProtocolError(f"unknown op {op!r}")
    cls, fields = _FIELDS[op]
    values = []
    for name, typ in fields:
        v = msg.get(name)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ProtocolError(f"{op}: field {name!r} must be {typ.__name__}, got {v!r}")
        values.append(v)
    if op == "hello" and isinstance(msg.get("exec_path"), str):  # optional: older spawners lack it
        values.append(msg["exec_path"][:32])
    return cls(*values)
