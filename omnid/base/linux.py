"""Linux process primitives: prctl, pidfds, /proc reads (ARCHITECTURE.md, "Processes and how they are held").

Everything kernel-specific that the daemon and the spawner share lives here, so
the rest of omnid speaks of processes, not of syscalls. The spawner imports this
and must stay small: fork copies page tables, so every module it imports makes
every spawn slower (no dataclasses, no ctypes.util).
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import os
from collections.abc import Callable
import select
import signal
import socket
import struct
from typing import NamedTuple

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)  # the interpreter already links libc
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.prctl.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long

# set_mempolicy(2) has no glibc wrapper (libnuma has one): the syscall by number.
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "ppc64": 261, "s390x": 270,
                      "riscv64": 237, "loongarch64": 237}.get(os.uname().machine)
MPOL_PREFERRED = 1
MPOL_PREFERRED_MANY = 5  # Linux 5.15

CLK_TCK = os.sysconf("SC_CLK_TCK")


def prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}): {os.strerror(err)}")


def set_pdeathsig(sig: int) -> None:
    prctl(PR_SET_PDEATHSIG, sig)


def set_child_subreaper() -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def nodemask(nodes) -> tuple[ctypes.Array, int]:
    """(a C nodemask with `nodes` set, maxnode) for set_mempolicy. maxnode is one more than the
    mask's bits: the kernel drops the last bit, as libnuma knows."""
    words = max(nodes, default=0) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask, words * 64 + 1


def set_mempolicy(mode: int, mask: ctypes.Array, maxnode: int, many_fallback: bool = False) -> None:
    """The calling thread's memory policy (inherited by children and kept across exec).
    With many_fallback, a kernel older than 5.15 (no MPOL_PREFERRED_MANY) keeps its default
    policy instead of failing: the CPU affinity already makes first touches local."""
    if _SYS_SET_MEMPOLICY is None:
        raise OSError(0, f"set_mempolicy: syscall number unknown on {os.uname().machine}")
    if _libc.syscall(ctypes.c_long(_SYS_SET_MEMPOLICY), ctypes.c_long(mode), mask, ctypes.c_ulong(maxnode)) != 0:
        err = ctypes.get_errno()
        if many_fallback and mode == MPOL_PREFERRED_MANY and err == 22:  # EINVAL: mode unknown here
            return
        raise OSError(err, f"set_mempolicy: {os.strerror(err)}")


# openat2(2) (Linux 5.6): one number on every architecture (it came after the tables were unified).
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_SYMLINKS = 0x04


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_same_mount(name: str, flags: int, dir_fd: int) -> int:
    """Open `name` relative to `dir_fd` without leaving dir_fd's mount and without following a
    symbolic link: a file system mounted on `name` (a FUSE mount a unit's user made on a
    directory it owns) gives OSError EXDEV before anything is asked of it, so a mount whose
    server never answers cannot hold the caller. Close-on-exec. Without openat2 (a kernel
    before 5.6: ENOSYS; an older container seccomp profile: EPERM, which path resolution itself
    never gives), a plain openat with O_NOFOLLOW (which cannot tell a mount point)."""
    how = _OpenHow(flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0, RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(name), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):
        return os.open(name, flags | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    if err == errno.EXDEV:
        raise OSError(err, "a file system is mounted on it", name)
    raise OSError(err, os.strerror(err), name)


def stat_same_mount(name: str, dir_fd: int, flags: int = 0) -> os.stat_result:
    """lstat of `name` relative to `dir_fd`, never of a file system mounted on it (OSError
    EXDEV, open_same_mount): an lstat of a mount point asks the mounted file system, whose
    server may never answer. `flags` adds to O_PATH (O_DIRECTORY: only a directory)."""
    fd = open_same_mount(name, os.O_PATH | flags, dir_fd)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
    """One datagram and the fds that came with it, received close-on-exec (socket.recv_fds
    leaves them inheritable: a fork before they are handed on would leak them to a unit)."""
    return recvmsg_fds(sock, bufsize, maxfds)[:2]


def recvmsg_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """recv_fds and the flags recvmsg returned: MSG_CTRUNC says some fds were lost (the
    receiver's fd table was full, or more came than `maxfds`), MSG_TRUNC that the data was cut."""
    fds = array.array("i")
    data, anc, flags, _addr = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize),
                                           socket.MSG_CMSG_CLOEXEC)
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
    return data, list(fds), flags


def pidfd_open(pid: int) -> int:
    return os.pidfd_open(pid)


def fd_readable(fd: int, timeout: float = 0.0) -> bool:
    """Whether `fd` polls readable within `timeout` seconds. poll, not select: select refuses
    fds from 1024 on, which a daemon holding a pidfd and two pipes per unit reaches at ~340 units."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout * 1000))))


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (its pidfd polls readable)."""
    return fd_readable(pidfd)


async def any_readable(fds: list[int], timeout: float) -> bool:
    """Wait on the event loop until one of `fds` (pidfds: readable once their process exited)
    turns readable, at most `timeout` seconds: True if one did. The fds must not be watched
    by the loop already (add_reader would replace that watch)."""
    import asyncio

    if timeout <= 0:
        p = select.poll()  # not select(): it refuses fds from 1024 on
        for fd in fds:
            p.register(fd, select.POLLIN)
        return bool(fds) and bool(p.poll(0))
    loop = asyncio.get_running_loop()
    woke = loop.create_future()

    def wake() -> None:
        if not woke.done():
            woke.set_result(True)

    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        done, _ = await asyncio.wait([woke], timeout=timeout)
        return bool(done)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        woke.cancel()


# ioctl(PIDFD_GET_INFO) (Linux 6.13): _IOWR(0xFF, 11, struct pidfd_info) at its first size, 64
# bytes; exit_code at offset 60 once PIDFD_INFO_EXIT (Linux 6.15) is in the mask it returns.
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_EXIT = 1 << 3
_pidfd_info = True  # until the kernel says it has no PIDFD_GET_INFO


def pidfd_exit_status(pidfd: int) -> int | None:
    """The wait status of the process behind `pidfd` once its parent has reaped it (the kernel
    keeps it with the pid), read by anyone holding the pidfd; None while it is not reaped, or
    where the kernel cannot tell (before 6.15: asked once, then never again)."""
    global _pidfd_info
    if not _pidfd_info:
        return None
    buf = bytearray(64)
    struct.pack_into("Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError as exc:
        if exc.errno in (25, 22, 95):  # ENOTTY, EINVAL, EOPNOTSUPP: no PIDFD_GET_INFO here
            _pidfd_info = False
        return None
    if not struct.unpack_from("Q", buf, 0)[0] & PIDFD_INFO_EXIT:
        return None  # not reaped yet
    return struct.unpack_from("i", buf, 60)[0]


def pidfd_if(pid: int, proof: Callable[[], bool]) -> int | None:
    """A pidfd for `pid` if `proof()` holds once it is open and the process is still running
    after it, else None. A pidfd does not pin a pid number: once the process exits and is
    reaped, the number can name a stranger while the fd is still open (signals through the fd
    then fail with ESRCH, so they never reach the stranger). A proof read from /proc is about
    the process behind the fd only if that process had not exited when the read was over:
    its pid cannot be reused before it exits. So the fd is checked after the proof, never
    before. The one way omnid turns a pid it read somewhere into something it signals.
    The caller closes the fd."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # ProcessLookupError: gone already; EMFILE and friends: cannot hold it
        return None
    try:
        ok = proof() and not pidfd_exited(fd)
    except Exception:
        os.close(fd)
        raise
    if not ok:
        os.close(fd)
        return None
    return fd


def open_checked_pidfd(pid: int, start_time: int) -> int | None:
    """A pidfd for `pid` if it is still the process that started at `start_time` (pid +
    start time name a process uniquely)."""
    return pidfd_if(pid, lambda: start_time_of(pid) == start_time)


def signal_checked(pid: int, start_time: int, sig: int) -> bool:
    """Signal a process named by pid + start time, through a checked pidfd."""
    fd = open_checked_pidfd(pid, start_time)
    if fd is None:
        return False
    try:
        return pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def pidfd_send_signal(pidfd: int, sig: int) -> bool:
    """Signal through a pidfd; False when the process has already exited."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def describe_wait_status(status: int) -> tuple[int | None, int | None, str]:
    """(exit code, signal, human reason) from a waitpid status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        core = " (core dumped)" if os.WCOREDUMP(status) else ""
        return None, sig, f"killed by {signal_name(sig)}{core}"
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        return code, None, f"exited with code {code}"
    return None, None, f"unknown wait status {status:#x}"


class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat that supervision needs."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int
    start_time: int  # clock ticks since boot; with pid it names a process uniquely


def _read_raw_stat(pid: int) -> bytes:
    """/proc/PID/stat's bytes, b"" when the process is gone. os-level I/O: no file object, on
    the spawner's path for every child."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


def read_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after "(comm)" (fields[0] is the state), or None."""
    raw = _read_raw_stat(pid)
    return raw[raw.rindex(b")") + 2 :].split() if raw else None


def read_stat(pid: int) -> ProcStat | None:
    raw = _read_raw_stat(pid)
    if not raw:
        return None
    # comm may contain spaces and parentheses: split on the last ')'.
    lpar = raw.index(b"(")
    rpar = raw.rindex(b")")
    comm = raw[lpar + 1 : rpar].decode(errors="replace")
    fields = raw[rpar + 2 :].split()
    return ProcStat(
        pid=pid,
        comm=comm,
        state=fields[0].decode(),
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start_time=int(fields[19]),
    )


def start_time_of(pid: int) -> int | None:
    st = read_stat(pid)
    return st.start_time if st else None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def scan() -> list[ProcStat]:
    """Every process on the host, one /proc pass."""
    out = []
    for pid in all_pids():
        st = read_stat(pid)
        if st is not None:
            out.append(st)
    return out


def _has_proc_children() -> bool:
    """Whether the kernel lists children in /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)."""
    pid = os.getpid()
    return os.path.exists(f"/proc/{pid}/task/{pid}/children")


# Read once: without it, every children file is missing and a live tree would read as empty.
PROC_CHILDREN = _has_proc_children()


def proc_children_note() -> str | None:
    """What the daemon says once at start where the kernel has no children lists, else None."""
    if PROC_CHILDREN:
        return None
    return ("the kernel has no /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN is off): a process's children "
            "are found by reading every process's parent in /proc, which costs in proportion to the host")


def children_of(pid: int) -> list[int]:
    """Direct children of a process, from /proc/PID/task/*/children (no full /proc scan); where
    the kernel has no such lists, from every process's parent (a full /proc scan)."""
    if not PROC_CHILDREN:
        return [p.pid for p in scan() if p.ppid == pid]
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def descendants(root: int, skip: frozenset[int] = frozenset()) -> list[ProcStat]:
    """Every descendant of `root` (zombies included), from /proc/PID/task/*/children, but the
    subtrees of `skip` (the units' live main processes: what is below one is in its session,
    and no other unit's group can be): the cost is the orphans' number, whatever else the
    host or the stack runs. With `root` gone (the spawner died: what it left was re-parented
    elsewhere), every process on the host."""
    if not os.path.isdir(f"/proc/{root}/task"):
        return scan()
    out: list[ProcStat] = []
    seen: set[int] = set(skip)
    stack = children_of(root)
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        st = read_stat(pid)
        if st is not None:
            out.append(st)
            stack.extend(children_of(pid))
    return out


def read_environ_var(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    prefix = name.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read().strip() or "0"
    except OSError:
        return "?"


def thread_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


# What a unit holds of the daemon's fd table, about: its output pipes' read ends, its pidfd,
# its held sockets and stored fds, a connection or two of its clients' health checks.
FDS_PER_UNIT = 8
FD_TABLE_BASE = 256  # the daemon's own: its sockets, the spawner's, threads' pipes, a re-exec's


def fd_table_size_for(units: int, soft_limit: int) -> int:
    """The fd table a daemon of `units` units should start with: a power of two (the kernel
    grows it by doubling anyway), within the soft RLIMIT_NOFILE."""
    want = FD_TABLE_BASE + FDS_PER_UNIT * max(0, units)
    return max(0, min(1 << (want - 1).bit_length(), soft_limit))


def grow_fd_table(size: int) -> bool:
    """Make the kernel's fd table hold `size` fds now, while the process has one thread.

    Growing the table of a process whose threads share it waits for an RCU grace period
    (expand_fdtable's synchronize_rcu): 7-19 ms each time here, on the thread that opened the
    fd, which is the event loop. A daemon starting 256 units opened ~1,300 fds after libzmq's
    and the removal threads existed and paid three of them (~40 ms) on the way to its last
    spawn; a flood of connections would pay the next on the loop that sees deaths. One fd
    duplicated at `size - 1` or above (F_DUPFD: the lowest free number from there, never one
    in use) and closed grows it once, cheaply; the kernel never shrinks it. True when it did."""
    if size <= 1:
        return False
    try:
        src = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, size - 1)
    except OSError:  # EINVAL / EMFILE: past the soft limit
        return False
    finally:
        os.close(src)
    os.close(fd)
    return True


def mark_fds_non_inheritable(keep: tuple[int, ...] = (0, 1, 2)) -> None:
    """A daemon started from a shell may inherit fds: never pass them to units."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass  # the fd of the listdir itself, already closed


# -- a datagram's sender, named by the kernel (SO_PASSPIDFD / SCM_PIDFD, Linux 6.5) --------
# Python's socket module may lack the names. The values are asm-generic's (socket.h: 76, and
# linux/socket.h: 0x04), which x86_64, aarch64, riscv64, powerpc and s390 use; alpha, mips,
# parisc and sparc number the option apart, so there an unnamed option is not tried.
_GENERIC_SOCKET_H = ("x86_64", "aarch64", "riscv64", "ppc64le", "ppc64", "s390x", "i686", "armv7l")
SO_PASSPIDFD: int | None = getattr(socket, "SO_PASSPIDFD", 76 if os.uname().machine in _GENERIC_SOCKET_H else None)
SCM_PIDFD: int | None = getattr(socket, "SCM_PIDFD", 0x04 if SO_PASSPIDFD is not None else None)


def pass_pidfd(sock: socket.socket) -> str | None:
    """Ask the kernel to attach the sender's pidfd (SCM_PIDFD) to every message `sock`
    receives. None when it will, else why not (for a log line: the caller falls back)."""
    if SO_PASSPIDFD is None:
        return f"SO_PASSPIDFD has no known number on {os.uname().machine}"
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSPIDFD, 1)
    except OSError as exc:  # ENOPROTOOPT before Linux 6.5
        return f"SO_PASSPIDFD refused: {os.strerror(exc.errno or 0)}"
    return None


def pidfd_pid(pidfd: int) -> int | None:
    """The pid, in our namespace, of the process a pidfd refers to; None once it is reaped
    (the kernel says -1), outside our namespace (0) or unreadable. Reads our own fdinfo:
    no lock of the other process is taken."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            for line in f.read().splitlines():
                if line.startswith(b"Pid:"):
                    pid = int(line.split()[1])
                    return pid if pid > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


_pidfd_inodes_unique: bool | None = None


def pidfd_inodes_unique() -> bool:
    """Does a pidfd's inode name one process (pidfs, Linux 6.9: one inode per process for the
    system's life), so that two pidfds with one inode are one process, even after it is
    reaped? Before pidfs every pidfd shared the one anonymous inode with eventfds."""
    global _pidfd_inodes_unique
    if _pidfd_inodes_unique is None:
        pidfd, efd = os.pidfd_open(os.getpid()), os.eventfd(0)
        try:
            _pidfd_inodes_unique = os.fstat(pidfd).st_ino != os.fstat(efd).st_ino
        finally:
            os.close(pidfd)
            os.close(efd)
    return _pidfd_inodes_unique


def same_process(pidfd_a: int, pidfd_b: int) -> bool:
    """Do two pidfds refer to one process (alive, dead or reaped)? False where the kernel
    cannot tell (no pidfs) or a pidfd is closed."""
    if not pidfd_inodes_unique():
        return False
    try:
        return os.fstat(pidfd_a).st_ino == os.fstat(pidfd_b).st_ino
    except OSError:
        return False


def pidfd_inode(pidfd: int) -> int:
    """The pidfd's inode: under pidfs, one number per process for the system's life."""
    return os.fstat(pidfd).st_ino
