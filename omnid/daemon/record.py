"""The re-exec record (`omnid reexec`, omnid(8) RE-EXEC): the one place its format is defined.

The old program of the daemon writes it into a memfd just before it execs the new one; the
new program reads it back before it takes anything over. This module owns:

- the schema (RECORD below): every field once, with its type; which fields a program may
  leave out (those added after format 1 began: an older program does not write them, and
  whoever takes the part over defaults them); FORMAT, the version;
- reading: `read(fd)` parses the record and checks all of it against the schema and the
  kernel (every fd it names is open), `check_against_stack` against the stack the new
  program loaded; anything wrong is a RecordError naming the field
  (`supervisor.units.api.proc.pid: expected an integer >= 0, got "x"`), never a traceback,
  and the caller falls back (omnid.daemon.handover: stop what is provably ours, start afresh);
- writing: `collect` assembles the record from what each part hands over, and `write` puts
  it in a memfd that survives exec.

Each part still collects its own state (`handover`/`to_json` of the spawner client, the
supervisor's units, their output, the cgroup root, ...) and takes it over; the names and
shapes they use are the ones declared here, and tests/test_reexecrecord.py checks a live
daemon's record against this schema strictly (a field not declared here fails it). The
cluster's part is the one exception: its records (omnid/cluster: SessionRecord, GroupRecord,
Generation, GroupDown) are typed and bounded where they are defined, and read by their own
`from_json`; here they are named by type.

After an upgrade in place, `collect` and `write` run in the OLD program but are this
module's code (omnid.daemon.handover imports it at the `reexec` request): they read only names of
the daemon that every program has (see omnid.daemon.handover).

Changing the record: a new field that a newer program needs is added to its part and
here as optional; a field renamed, removed or changed in shape or meaning bumps FORMAT
(a program refuses a format it does not know and falls back).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

from omnid.base import closer, testswitch
from omnid.core.lifecycle import Cause, Goal, Phase, UnitState
from omnid.base.jsonshape import (BOOL, COUNT, FD, INT, NUM, STR, DictOf, ListOf, Obj, OneOf, Opt, Record, ShapeError,
                             Str, Tuple)

FORMAT = 1  # the record's version: a new program refuses a format it does not know
MAX_BYTES = 1 << 30  # what the new program reads at most
FAULT_ENV = testswitch.FAULT_HANDOVER_ENV  # test switch (omnid(8)): "corrupt" writes an unreadable record


class RecordError(ShapeError):
    """The record cannot be taken over: names the field (dotted) and what is wrong with it
    (a ValueError: the caller falls back)."""


# ------------------------------------------------------------------ the schema
# Collected by: DaemonConfig (omnid.model.settings) and the daemon's --log-file.
SETTINGS = Obj({"units_dir": STR, "control": STR, "state_dir": STR, "health_listen": STR, "log_format": STR,
                "cgroup_root": Opt(STR), "sources": ListOf(Tuple(STR, STR)), "log_file": Opt(STR)})
# The stack's files as they were read (base64 of each file's bytes): the new program parses
# the same texts, not what the directory holds now.
STACK = Obj({"directory": STR, "sources": DictOf(STR)})
SPAWNER = Obj({"pid": COUNT, "pidfd": FD, "sock": FD, "start_time": INT},  # SpawnerClient.handover
              optional={"exec_path": Opt(STR)})
NOTIFY = Obj({"fd": FD, "counters": DictOf(INT)})
CGROUP = Obj({"path": STR, "source": STR, "units": DictOf(STR)})  # CgroupRoot.handover: unit -> its cgroup
PROCESS = Obj({"pid": COUNT, "pidfd": FD, "pgid": COUNT, "start_time": COUNT,  # ProcessHandle.to_json
               "exit_status": Opt(INT)})
STOP = Obj({"unit": STR, "signal": STR, "seconds": Opt(NUM), "escalated": BOOL,  # StopRecord.to_json
            "residue": ListOf(STR), "unkillable": ListOf(STR), "gpu_release_ms": Opt(NUM),
            "gpu_held": ListOf(STR), "was": STR},
           optional={"to": STR, "rest": STR, "main_seconds": Opt(NUM), "ipc_removed": ListOf(STR),
                     "cleanup_seconds": Opt(NUM), "tmp_entries": Opt(COUNT), "tmp_left": STR})
OUTPUT = Obj({"lines": ListOf(Tuple(NUM, STR, STR)),  # UnitOutput.handover: (time, stream, line)
              "lines_total": INT, "lines_truncated": INT, "echo_dropped": INT, "evicted_for_bytes": INT,
              "read_pauses": INT,
              "pipes": ListOf(Obj({"fd": FD, "stream": STR, "partial": STR}))})  # partial: latin-1
UNIT = Obj({  # UnitRuntime.to_json, with the book's key and the output beside it (omnid.core.takeover)
    "name": STR, "state": OneOf(UnitState), "phase": OneOf(Phase), "goal": OneOf(Goal),
    "cause": Opt(OneOf(Cause)), "proc": Opt(PROCESS), "last_stop": Opt(STOP),
    "reason": STR, "since": NUM, "last_pgid": INT, "ready": BOOL, "restarts": INT, "deaths": INT,
    "last_exit": STR, "last_exit_code": Opt(INT), "last_signal": Opt(INT), "cause_text": STR, "stop_reason": STR,
    "active_since": NUM, "status_text": STR, "stopping_notified": BOOL, "notified_ready": BOOL,
    "watchdog_last": NUM, "ready_deadline": NUM, "death_detect_ms": Opt(NUM), "gpu_release_ms": Opt(NUM),
    "gpu_held": ListOf(STR), "goal_seq": INT, "goal_by": STR, "epoch": INT, "spawn_errno": Opt(INT),
    "capture_summary": STR, "last_exit_what": STR,
    "book": STR, "output": OUTPUT,
}, optional={"start_requested": BOOL, "private_tmp": STR, "ipc_removed": ListOf(STR), "rolling": BOOL})
BOOK = Obj({"start_times": ListOf(NUM), "consecutive_failures": INT, "restart_at": NUM,  # RestartBook.to_json
            "restart_pending": BOOL, "gave_up": BOOL, "generation": INT, "up": BOOL, "down_reason": Opt(STR),
            "failure_counted": BOOL, "ever_up": BOOL})
HELD_SOCKET = Obj({"fd": FD, "listen": Str(empty=False), "backlog": INT, "mode": INT,  # HeldSockets.handover
                   "reuseport": BOOL, "owner": ListOf(INT)})
STORED_FD = Obj({"fd": FD, "name": Str(empty=False), "poll": BOOL})  # FdStore.to_json: unit -> its fds
SUPERVISOR = Obj({  # omnid.core.takeover.handover
    "units": DictOf(UNIT),
    "books": DictOf(BOOK),  # "unit:NAME", or "group:NAME" shared by a worker group's members
    "started_at": NUM, "invariant_violations": ListOf(STR),
}, optional={"sockets": Opt(DictOf(ListOf(HELD_SOCKET))), "fdstore": DictOf(ListOf(STORED_FD))})
METRICS = Obj({"series": DictOf(Tuple(ListOf(INT), ListOf(NUM))),  # DaemonMetrics.handover: (buckets, [sum])
               "deaths_seen": DictOf(INT)})
UNIT_IPC = Obj({"unit": STR, "uid": INT, "since": NUM, "pids": ListOf(INT),  # UnitIpc.to_json
                "shm": DictOf(INT), "dropped": INT})
TMPDIR = Obj({"unit": STR, "path": STR, "dev": INT, "ino": INT}, optional={"uid": INT})  # TmpDir.to_json
CLEANUP = Obj({  # UnitCleanup.handover
    "ipc": DictOf(UNIT_IPC),
    "tmp": DictOf(TMPDIR),
    "due": ListOf(STR)}, optional={
        "held": ListOf(UNIT_IPC),
        # removals under way (cleanup._Removing): the new program does each again from the start
        "removing": ListOf(Obj({"unit": STR, "tmp": Opt(TMPDIR), "remove_ipc": BOOL, "ipc": Opt(UNIT_IPC)}))})
CLUSTER = Obj({  # omnid.core.crosshost.CrossHost.handover; checked against the stack by read_handover
    "session": Record("omnid.cluster.session", "SessionRecord"),
    "groups": DictOf(Obj({"cluster": Record("omnid.cluster.group", "GroupRecord"),
                          "admitted": Opt(Record("omnid.cluster.group", "Generation")),
                          "running": Opt(Record("omnid.cluster.group", "Generation")),
                          "down": Opt(Record("omnid.cluster.group", "GroupDown")),
                          "counters": DictOf(INT)}))})

RECORD = Obj({
    "format": INT,
    "from_version": STR, "to_version": STR,
    "reexecs": INT,  # how many re-execs before this one
    "token": STR,  # the daemon's ownership token (OMNID_DAEMON in every unit's environment)
    "settings": SETTINGS,
    "stack": STACK,
    "systemd": DictOf(STR),  # ServiceNotifier.handover: NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID
    "spawner": SPAWNER,
    "notify": NOTIFY,
    "health": Obj({"fd": FD}),  # the health API's listening socket: never closed, so never refused
    "lock_fd": FD,  # the state directory's lock
    "cgroup": Opt(CGROUP),  # None: process groups
    "settled": BOOL,  # the stack's first start had settled (READY=1 was sent)
    "supervisor": SUPERVISOR,
    "metrics": METRICS,
    "exec_at": NUM,  # time.monotonic() just before the exec (the same clock after it): times the handover
}, optional={"cleanup": Opt(CLEANUP), "cluster": CLUSTER,
             # fds from outside still waiting to be closed (omnid.base.closer): the next program closes them
             "foreign_fds": ListOf(FD)})


def check(record: Any, strict: bool = False) -> None:
    """The whole record against the schema (and the kernel: its fds open); RecordError."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise RecordError(f"the handover's format is "
                          f"{record.get('format') if isinstance(record, dict) else '?'!r}, "
                          f"this program reads format {FORMAT}")
    try:
        RECORD.check(record, strict)
    except ShapeError as exc:
        raise RecordError(exc.why, exc.path) from None


# ------------------------------------------------------------------ writing (the old program)
def collect(daemon: Any, check: Any) -> tuple[dict[str, Any], list[int]]:
    """Everything the next program needs (less `exec_at`, stamped by the caller at the last
    moment) and the fds it must inherit. `daemon`: omnid.daemon.Daemon; `check`: the
    omnid.handover.ProgramCheck of the program it becomes."""
    from omnid.core import takeover as takeover_mod
    from omnid.version import version

    sup = daemon.sup
    cfg = daemon.cfg
    rec = {
        "format": FORMAT,
        "from_version": version(), "to_version": check.version, "reexecs": daemon.reexecs,
        "token": daemon.token,
        "settings": {"units_dir": cfg.units_dir, "control": cfg.control, "state_dir": cfg.state_dir,
                     "health_listen": cfg.health_listen, "log_format": cfg.log_format,
                     "cgroup_root": cfg.cgroup_root, "sources": [list(x) for x in cfg.sources],
                     "log_file": daemon.log_file},
        "stack": {"directory": str(daemon.stack.directory),
                  "sources": {name: base64.b64encode(data).decode() for name, data in daemon.stack.sources.items()}},
        "systemd": daemon.service.handover(),
        "spawner": daemon.spawner.handover(),
        "notify": {"fd": daemon.notify.sock.fileno(), "counters": dict(daemon.notify.counters)},
        "health": {"fd": daemon.health_fd},
        "lock_fd": daemon.lock_fd,
        "cgroup": daemon.cgroups.handover() if daemon.cgroups is not None else None,
        "settled": daemon.settled.is_set(),
        "supervisor": takeover_mod.handover(sup),
        "metrics": daemon.metrics.handover(),
        "cleanup": daemon.cleanup.handover() if daemon.cleanup is not None else None,
    }
    fds = [rec["spawner"]["pidfd"], rec["spawner"]["sock"], rec["notify"]["fd"], daemon.health_fd, daemon.lock_fd]
    if sup.crosshost is not None:  # [cluster]: the same lease, groups and heartbeat socket
        rec["cluster"] = sup.crosshost.handover()
        fds.append(rec["cluster"]["session"]["peers"]["fd"])
    rec["foreign_fds"] = closer.take_waiting()  # put back by the caller if the exec fails
    fds.extend(rec["foreign_fds"])
    fds.extend(sup.sockets.fds())  # units' listening sockets: never closed, so never refused
    fds.extend(sup.fdstore.fds())  # units' stored fds (omnid.process.fdstore)
    for rt in sup.units.values():
        if rt.proc is not None:
            fds.append(rt.proc.pidfd)
        fds.extend(rt.output.pipe_fds())
    return rec, fds


def write(record: dict[str, Any]) -> int:
    """The record in a memfd that survives exec (no close-on-exec); returns its fd."""
    data = json.dumps(record).encode()
    if testswitch.value(FAULT_ENV) == "corrupt":
        data = b"\x00{not json" + data[: len(data) // 3]
    fd = os.memfd_create("omnid-handover", 0)
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# ------------------------------------------------------------------ reading (the new program)
def read(fd: int) -> dict[str, Any]:
    """The record a previous program wrote in `fd` (closed here), checked against the schema
    and the kernel; RecordError saying what is wrong with it."""
    try:
        size = os.fstat(fd).st_size
        if size > MAX_BYTES:
            raise RecordError(f"handover of {size} bytes is over the {MAX_BYTES} bytes limit")
        chunks, left = [], size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise RecordError(f"cannot read the handover (fd {fd}): {exc}") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        record = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"the handover is not valid JSON: {exc}") from None
    check(record)
    return record


def check_against_stack(record: dict[str, Any], stack: Any) -> None:
    """What the schema cannot say: every unit handed over is in the stack the new program
    loaded (the record's own sources), its restart book is there, the cluster part matches
    the stack's [cluster]. Checked before anything is taken over: a handover that fails half
    way through being taken over must never happen. RecordError naming the field."""
    sup = record["supervisor"]
    for name, u in sup["units"].items():
        if name not in stack.units:
            raise RecordError(f"unit {name} was handed over but is not in the stack", ["supervisor", "units", name])
        if u["book"] not in sup["books"]:
            raise RecordError(f"restart book {u['book']!r} missing", ["supervisor", "units", name, "book"])
    if record.get("cluster") is not None:  # absent: a program without it, or no [cluster] (a fresh session)
        from omnid.core.crosshost import read_handover

        try:
            read_handover(record["cluster"], stack, {k[len("group:"):]: int(b["generation"])
                                                     for k, b in sup["books"].items() if k.startswith("group:")})
        except ValueError as exc:
            raise RecordError(str(exc)) from None


def daemon_config(record: dict[str, Any]) -> Any:
    """The settings the previous program ran with (omnid.settings.DaemonConfig)."""
    from omnid.model.settings import DaemonConfig

    st = record["settings"]
    return DaemonConfig(units_dir=st["units_dir"], control=st["control"], state_dir=st["state_dir"],
                        health_listen=st["health_listen"], log_format=st["log_format"],
                        cgroup_root=st["cgroup_root"], sources=tuple((k, v) for k, v in st["sources"]))


def stack_sources(record: dict[str, Any]) -> dict[str, bytes]:
    """The stack's files as the previous program read them."""
    try:
        return {name: base64.b64decode(text, validate=True) for name, text in record["stack"]["sources"].items()}
    except ValueError as exc:
        raise RecordError(f"not base64: {exc}", ["stack", "sources"]) from None
