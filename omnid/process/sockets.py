"""Listening sockets the daemon holds for its units (omnid.unit(5) `sockets`).

A unit's sockets are bound and listening before its first start and stay open in the
daemon for as long as the unit is in the stack: across its restarts, failures, stops and
starts, `omnid reload` (an unchanged socket is kept, a changed one is a new socket) and
`omnid reexec` (the fds are inherited and listed in the handover). The unit gets them as
systemd passes a socket unit's sockets: fds 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES, and
LISTEN_PID set by the spawner's child to its own pid between fork and exec. A client that
connects while the unit restarts waits in the socket's backlog instead of being refused.

Every bind error is a sentence naming the unit, the key and the address (address in use,
permission), never a traceback: at the unit's start (its failure reason) and in `omnid
check` (`probe`).

A Unix socket's file is made by root in a directory the unit's file names, so the directory is
checked first (omnid.base.ownership.open_directory: it and every directory above it owned by
root, writable by no one else, or sticky): where another user could write, they could put a
link where the file's mode and owner are then set. The mode is set on the socket before the
bind, so the file is never made wider than asked (the umask can only narrow it; no
process-wide umask change: the daemon has threads), and then set exactly, with the owner,
through an O_PATH fd of the name opened without following a link and checked to be a socket
we made.

A socket file is removed only when omnid.process.proof.unit_socket proves it the one omnid
bound: its device, inode and change time, recorded at the bind in the state directory
(`sockets.json`), so the daemon after a SIGKILL or a re-exec knows its predecessor's. A socket
file nobody listens on is not proof: another service's reads the same while that service is
down, and it is refused with a reason, never removed.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import structlog

from omnid.base import ownership
from omnid.model import accounts
from omnid.model.unitmodel import ListenSocket, Unit
from omnid.model.units import parse_host_port
from omnid.process import proof
from omnid.process.proof import MadeSocket

log = structlog.get_logger("omnid.process.sockets")

RECORD_NAME = "sockets.json"
MAX_RECORD_BYTES = 1 << 20


class BindError(Exception):
    """A socket of a unit cannot be bound or listened on; the message says which and why."""


@dataclass
class Held:
    spec: ListenSocket
    sock: socket.socket
    owner: tuple[int, int] = (-1, -1)  # a Unix socket's file owner, as set at bind
    made: MadeSocket | None = None  # a Unix socket's file as bound (None: not one, or not known)

    @property
    def key(self) -> tuple:
        """What makes it the same socket across a reload: its address and how it was bound
        (a Unix socket's owner included); its name travels in LISTEN_FDNAMES only."""
        s = self.spec
        return (s.listen, s.backlog, s.mode if s.unix else 0, s.reuseport, self.owner)


def _owner(unit: Unit) -> tuple[int, int]:
    """The uid/gid a unit's Unix socket file gets: the unit's user and group (it runs as them),
    as resolved when the stack was read (omnid.model.accounts: no NSS lookup here, on the loop).
    An unknown user or group: (-1, -1), the spawn names it."""
    account = accounts.of(unit.user, unit.group)
    return (account.uid, account.gid) if not account.error else (-1, -1)


def _why(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "address in use (another process listens there)"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied ({exc.strerror})"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "address not available on this host"
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{code}: {exc.strerror}"


class Bound(NamedTuple):
    sock: socket.socket
    made: MadeSocket | None  # a Unix socket's file, as bound


def _unlink_stale(path: str, made: MadeSocket | None, remove: bool = True) -> None:
    """A socket file omnid bound (`made`, its record) that nothing listens on any more is
    removed (`remove`); a live one (something accepts on it), one omnid cannot prove it bound
    (omnid.process.proof.unit_socket) or a file that is not a socket is an error, never removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, "a file that is not a socket is there")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        if remove:
            _remove_made(path, made)
        return
    except OSError:
        return  # let bind say what is wrong
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "address in use")


def _remove_made(path: str, made: MadeSocket | None) -> None:
    """Nothing listens on `path`: removed if it is the socket file omnid bound, else EEXIST
    naming why not (read again now: the probe's connect took its time)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not (verdict := proof.unit_socket(path, st, made)):
        raise OSError(errno.EEXIST, f"nothing listens there, but {verdict.reason}: not removed (another "
                                    "program's, or older than omnid's record of its sockets; remove it by hand)")
    os.unlink(path)


def bind(spec: ListenSocket, owner: tuple[int, int] = (-1, -1), made: MadeSocket | None = None) -> Bound:
    """A listening, non-blocking, close-on-exec socket for `spec`, and a Unix socket's file as
    bound; `made`: the record of the file omnid bound there before (a leftover it may replace).
    OSError from the kernel, ownership.UnsafePath for a Unix socket's directory that another
    user could write."""
    if spec.unix:
        dfd, where = ownership.open_directory(os.path.dirname(spec.listen), "the socket's directory")
        try:
            path = os.path.join(where, os.path.basename(spec.listen))  # the checked directory, no link
            _unlink_stale(path, made)
            out: list[MadeSocket] = []
            sock = _listening(socket.AF_UNIX, lambda sock: out.append(_bind_unix(sock, path, dfd, spec.mode, owner)),
                              spec.backlog)
            return Bound(sock, out[0])
        finally:
            os.close(dfd)
    host, port = parse_host_port(spec.listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bind_inet(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT of a past run is no clash
        if spec.reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "[::]" is IPv6 only, as written
        sock.bind((host, port))

    return Bound(_listening(family, bind_inet, spec.backlog), None)


def _bind_unix(sock: socket.socket, path: str, dfd: int, mode: int, owner: tuple[int, int]) -> MadeSocket:
    """Bind `path` (in the checked directory `dfd`) with exactly `mode` and `owner`; the file
    as made, for the record that later proves it omnid's."""
    # The kernel makes the file with the socket's own mode less the umask: never wider than
    # `mode`, whatever the umask, and without changing it for the daemon's other threads.
    os.fchmod(sock.fileno(), mode)
    sock.bind(path)
    fd = os.open(os.path.basename(path), os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        if not proof.bound_now(path, os.fstat(fd), os.geteuid()):
            raise OSError(errno.EEXIST, "the socket's file was replaced right after the bind")
        # fchmod/fchown refuse an O_PATH fd; through /proc/self/fd they act on its inode (the
        # socket just checked), never on where a link points.
        os.chmod(f"/proc/self/fd/{fd}", mode)
        if owner != (-1, -1):
            os.chown(f"/proc/self/fd/{fd}", *owner)
        st = os.fstat(fd)  # the change time the mode and owner gave it: the record's
        return MadeSocket(st.st_dev, st.st_ino, st.st_ctime_ns)
    finally:
        os.close(fd)


def _listening(family: int, bind_it: Callable[[socket.socket], None], backlog: int) -> socket.socket:
    """A new socket of `family`, bound by `bind_it`, listening; closed again if either fails."""
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        bind_it(sock)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def describe(unit: Unit, index: int, exc: OSError | ownership.UnsafePath) -> str:
    spec = unit.sockets[index]
    if isinstance(exc, ownership.UnsafePath):
        return f"unit {unit.name}, sockets[{index}]: will not listen on {spec.listen}: {exc}"
    return f"sockets[{index}]: cannot listen on {spec.listen}: {_why(exc)}"


class HeldSockets:
    """The sockets the daemon holds, per unit instance, in the unit's `sockets` order."""

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self.units: dict[str, list[Held]] = {}
        # Listen path -> the socket file omnid bound there: what proves a leftover its own.
        self.record = SocketRecord(state_dir)

    def keep_record(self, state_dir: str | Path | None) -> None:
        """Record the socket files in the state directory (`sockets.json`), and take what a
        previous program of this daemon recorded (before any bind or take-over)."""
        self.record = SocketRecord(state_dir)

    def fds_for(self, unit: Unit) -> tuple[list[int], list[str]]:
        """The unit's listening fds and their names, bound now where not held yet (a changed
        socket replaces the old one). BindError names the socket that cannot be bound; the
        ones already held stay held."""
        held = self.units.get(unit.name, [])
        owner = _owner(unit)
        by_key = {h.key: h for h in held}
        out: list[Held] = []
        try:
            for i, spec in enumerate(unit.sockets):
                want = Held(spec, None, owner if spec.unix else (-1, -1))  # type: ignore[arg-type]
                h = by_key.pop(want.key, None) or self._sibling_socket(unit, want.key)
                if h is None:
                    # A changed address that is the same as an old one's (a mode changed) is
                    # bound only once the old one is closed.
                    for k, old in list(by_key.items()):
                        if old.spec.listen == spec.listen:
                            self._close(unit.name, by_key.pop(k))
                    try:
                        want.sock, want.made = bind(spec, want.owner, self.record.made.get(spec.listen))
                    except (OSError, ownership.UnsafePath) as exc:
                        raise BindError(describe(unit, i, exc)) from None
                    if want.made is not None:
                        self.record.add(spec.listen, want.made)
                    log.info("listening for a unit", unit=unit.name, listen=spec.listen, fd=want.sock.fileno())
                    h = want
                h.spec = spec  # the name may have changed: it is not part of the socket
                out.append(h)
        except BindError:
            self.units[unit.name] = out + list(by_key.values())
            raise
        for old in by_key.values():
            self._close(unit.name, old)
        self.units[unit.name] = out
        return [h.sock.fileno() for h in out], [h.spec.name for h in out]

    def _sibling_socket(self, unit: Unit, key: tuple) -> Held | None:
        """The socket another instance of `unit` holds on the same TCP address, bound the same
        way without reuseport: one socket for the instances, as a prefork server's workers
        accept on one (a connection waits in it for whichever instance accepts first; one that
        dies leaves the connections still waiting to the others)."""
        if unit.instances < 2 or key[3] or key[0].startswith("/"):
            return None
        for name, held in self.units.items():
            if name != unit.name and name.partition("@")[0] == unit.template:
                for h in held:
                    if h.key == key:
                        return h
        return None

    def _shared(self, unit: str, h: Held) -> bool:
        """Whether another instance still holds `h` (a shared socket is closed with its last)."""
        return any(name != unit and any(o is h for o in held) for name, held in self.units.items())

    def keep_only(self, units: Iterable[Unit]) -> None:
        """After a reload: a unit no longer in the stack, or no longer declaring a socket,
        has it closed now (its Unix socket file removed); changed ones are replaced at the
        unit's next start."""
        wanted = {u.name: {s.listen for s in u.sockets} for u in units}
        for name in list(self.units):
            keep = []
            for h in self.units[name]:
                if h.spec.listen in wanted.get(name, ()):
                    keep.append(h)
                else:
                    self._close(name, h)
            if keep:
                self.units[name] = keep
            else:
                del self.units[name]

    def fds(self) -> list[int]:
        return [h.sock.fileno() for held in self.units.values() for h in held]

    def close_all(self) -> None:
        for name in list(self.units):
            for h in self.units.pop(name):
                self._close(name, h)

    def _close(self, unit: str, h: Held) -> None:
        if self._shared(unit, h):
            return  # another instance's too: closed with the last
        if h.spec.unix:
            path = h.spec.listen
            try:
                st = os.lstat(path)
                if verdict := proof.unit_socket(path, st, h.made):
                    os.unlink(path)
                else:
                    log.warning("a unit's socket file not removed", unit=unit, path=path, why=verdict.reason)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove a unit's socket file", unit=unit, path=path, error=str(exc))
            if h.made is not None:
                self.record.drop(path, h.made)
        log.info("closed a unit's listening socket", unit=unit, listen=h.spec.listen)
        h.sock.close()

    # -- omnid reexec --------------------------------------------------------------------
    def handover(self) -> dict:
        return {name: [{"fd": h.sock.fileno(), "listen": h.spec.listen, "backlog": h.spec.backlog,
                        "mode": h.spec.mode, "reuseport": h.spec.reuseport, "owner": list(h.owner)}
                       for h in held] for name, held in self.units.items()}

    def take_over(self, d: dict, units: dict[str, Unit]) -> None:
        """The sockets a previous program of this daemon held, inherited as fds. One of a unit
        no longer in the stack is closed; the rest are matched to the unit's sockets at its
        next start as after a reload. ValueError/KeyError/TypeError on a malformed record."""
        by_fd: dict[int, Held] = {}  # a socket the instances share is listed under each
        for name, items in d.items():
            for it in items:
                fd = int(it["fd"])
                if fd in by_fd:
                    self.units.setdefault(name, []).append(by_fd[fd])
                    continue
                os.set_inheritable(fd, False)
                sock = socket.socket(fileno=fd)
                if sock.type != socket.SOCK_STREAM or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
                    sock.detach()
                    raise ValueError(f"unit {name}: fd {fd} is not a listening stream socket")
                sock.setblocking(False)
                spec = ListenSocket(listen=str(it["listen"]), name="", backlog=int(it["backlog"]),
                                    mode=int(it["mode"]), reuseport=bool(it["reuseport"]))
                made = (self.record.made.get(spec.listen) or _adopt(spec.listen, sock)) if spec.unix else None
                if made is not None and self.record.made.get(spec.listen) != made:
                    self.record.add(spec.listen, made)
                by_fd[fd] = Held(spec, sock, tuple(int(x) for x in it["owner"]), made)
                self.units.setdefault(name, []).append(by_fd[fd])
        self.keep_only(units.values())


def probe(unit: Unit) -> list[tuple[int, str]]:
    """`omnid check`: each socket of `unit` that cannot be bound now (address in use,
    permission, no such directory), as (index, why); each is bound and closed at once."""
    problems: list[tuple[int, str]] = []
    for i, spec in enumerate(unit.sockets):
        try:
            if spec.unix and not os.path.isdir(os.path.dirname(spec.listen)):
                raise OSError(errno.ENOENT, f"the directory {os.path.dirname(spec.listen)} does not exist")
            if spec.unix and os.path.lexists(spec.listen):
                _unlink_stale(spec.listen, None, remove=False)  # raises on a live one or a non-socket
                continue  # a leftover: the daemon replaces it at start if its record proves it omnid's
            sock, made = bind(spec)
        except ownership.UnsafePath as exc:
            problems.append((i, f"will not listen on {spec.listen}: {exc}"))
            continue
        except OSError as exc:
            problems.append((i, f"cannot listen on {spec.listen}: {_why(exc)}"))
            continue
        sock.close()
        if spec.unix and made is not None:
            _remove_made(spec.listen, made)  # the file this probe just bound
    return problems


def _adopt(path: str, sock: socket.socket) -> MadeSocket | None:
    """An inherited socket no record names (the previous program kept none: an upgrade by
    `omnid reexec`): its file, if the kernel says that file is the one this socket was bound
    to (omnid.process.proof.bound_by), as the record would have had it; else None (the file
    is then never removed)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    verdict = proof.bound_by(path, st, _bound_file(sock))
    if not verdict:
        log.warning("an inherited socket's file is not proven omnid's; it will not be removed", path=path,
                    why=verdict.reason)
        return None
    return MadeSocket(st.st_dev, st.st_ino, st.st_ctime_ns)


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, UDIAG_SHOW_VFS, UNIX_DIAG_VFS = 4, 20, 0x2, 1
NLM_F_REQUEST, NLMSG_ERROR = 0x1, 0x2


def _bound_file(sock: socket.socket) -> tuple[int, int] | None:
    """(device, inode) of the file a bound Unix socket was bound to, as the kernel keeps it
    (sock_diag, UNIX_DIAG_VFS; the inode's low 32 bits), or None when it does not say."""
    try:
        ino = os.fstat(sock.fileno()).st_ino  # the socket's own inode (sockfs): how sock_diag names it
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino & 0xFFFFFFFF, UDIAG_SHOW_VFS,
                          0xFFFFFFFF, 0xFFFFFFFF)
        msg = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)  # the kernel answers at once; a bound, never a hang
            nl.sendto(msg, (0, 0))
            data = nl.recv(65536)
    except OSError:
        return None
    if len(data) < 32:
        return None
    length, kind = struct.unpack_from("=IH", data, 0)
    if kind == NLMSG_ERROR:
        return None
    off = 16 + 16  # nlmsghdr, unix_diag_msg
    while off + 4 <= min(length, len(data)):
        alen, atype = struct.unpack_from("=HH", data, off)
        if alen < 4:
            return None
        if atype == UNIX_DIAG_VFS and alen >= 12:
            vfs_ino, kdev = struct.unpack_from("=II", data, off + 4)
            return os.makedev(kdev >> 20, kdev & 0xFFFFF), vfs_ino  # the kernel's dev_t, as stat gives it
        off += (alen + 3) & ~3
    return None


class SocketRecord:
    """sockets.json in the daemon's state directory (only the daemon can write there, checked
    at start): listen path -> the socket file omnid bound there (device, inode, change time),
    written at each bind and removal, so that a daemon after a SIGKILL or a re-exec proves its
    predecessor's leftovers its own -- and only those. Without a state directory (tests, a
    daemon without one) it is kept in memory: this program's own sockets only."""

    def __init__(self, state_dir: str | Path | None) -> None:
        self.path = Path(state_dir) / RECORD_NAME if state_dir else None
        self.made: dict[str, MadeSocket] = self._read()

    def add(self, listen: str, made: MadeSocket) -> None:
        self.made[listen] = made
        self._write()

    def drop(self, listen: str, made: MadeSocket) -> None:
        if self.made.get(listen) == made:
            del self.made[listen]
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        data = json.dumps({k: [m.dev, m.ino, m.ctime_ns] for k, m in self.made.items()}).encode()
        try:
            proof.replace_daemon_file(self.path, data)
        except OSError as exc:
            log.error("cannot write the unit sockets record", path=str(self.path), error=str(exc))

    def _read(self) -> dict[str, MadeSocket]:
        """What a previous program recorded (untrusted: a small regular file of ours)."""
        if self.path is None:
            return {}
        try:
            raw = proof.read_daemon_file(self.path, MAX_RECORD_BYTES)
        except OSError as exc:
            log.warning("unit sockets record unreadable; ignoring it", path=str(self.path), error=str(exc))
            return {}
        except ValueError:
            log.warning("unit sockets record is not a small file of ours; ignoring it", path=str(self.path))
            return {}
        if raw is None:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            log.warning("unit sockets record is not a JSON object; ignoring it", path=str(self.path))
            return {}
        return {k: MadeSocket(*v) for k, v in data.items() if isinstance(k, str) and _three_ints(v)}


def _three_ints(v: object) -> bool:
    return isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
