"""The `omnid daemon` command: one process from its command line to its exit code. It owns
what happens before the event loop runs, on each of the two ways in:

- a fresh start: the stack loaded and checked, the settings resolved, the state directory
  made private and locked, the cgroup root checked, leftovers of a previous daemon killed,
  the spawner started by exec while this process has no thread; then
  omnid.daemon.Daemon.start_fresh;
- after `omnid reexec` (`--takeover FD`): the record the previous program handed over read
  and checked (omnid.daemon.record), the same settings, stack, token, lock and cgroups; then
  Daemon.continue_after_reexec. A record that cannot be used falls back: what is provably
  this daemon's is stopped (omnid.daemon.handover), and the stack starts afresh.
"""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import structlog

from omnid.process import cgroup as cgroup_mod
from omnid.base import linux
from omnid.base import logconfig
from omnid.base import runloop
from omnid.daemon import record as reexecrecord
from omnid.model import settings
from omnid.api.control import ControlError, prepare_socket_dir
from omnid.daemon.main import Daemon
from omnid.base.ownership import UnsafePath, check_private_dir, raise_nofile_limit
from omnid.base.priority import daemon_nice_for, raise_daemon_priority
from omnid.model.settings import DaemonConfig
from omnid.process.spawnclient import SpawnerGone
from omnid.process.spawnstart import SpawnerProcess
from omnid.daemon.statefile import find_leftovers, kill_leftovers
from omnid.api.systemd import ServiceNotifier
from omnid.model.units import StackInvalid, load_stack

log = structlog.get_logger("omnid.daemon.main")

SWITCH_INTERVAL_S = 0.001  # the GIL's switch interval in the daemon (Python's default: 5 ms)


def run_daemon_command(units_dir: str | None, control: str | None, state_dir: str | None,
                       health_listen: str | None, log_format: str | None, log_file: str | None = None,
                       cgroup_root: str | None = None, takeover: int | None = None,
                       spawner: SpawnerProcess | None = None) -> int:
    """The `omnid daemon` command. Returns the process exit code. `takeover`: the fd of the
    record a previous program of this daemon left (omnid reexec). `spawner`: one already
    started (omnid.process.spawnstart), taken over; else one is started here."""
    # A thread running Python (a reload's parse, a capture's listing, the health API's
    # import) keeps the GIL for the switch interval at a time, and the loop that sees deaths
    # waits for it: 1 ms instead of Python's 5. Measured beside a thread spinning in Python: a
    # death seen in 1.25 ms instead of 5.3 (a reload's parse of 256 files, mostly I/O, showed
    # no difference: bench/gil_numbers.py).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    udir = os.path.abspath(units_dir or settings.default_units_dir())
    handover_error = None
    if takeover is not None:
        try:
            code = _continue_after_reexec(reexecrecord.read(takeover))
            if code is not None:
                return code
            handover_error = "the handed-over units could not be taken over (see the log)"
        except (ValueError, KeyError, TypeError, StackInvalid) as exc:
            handover_error = f"{type(exc).__name__}: {exc}"
        cfg = settings.resolve(units_dir=udir, control=control, state_dir=state_dir, health_listen=health_listen,
                               log_format=log_format, cgroup_root=cgroup_root)
        logconfig.configure(cfg.log_format, log_file=log_file)
        _forget_the_previous_program(cfg, udir, handover_error)
    return _start_fresh(udir, control, state_dir, health_listen, log_format, log_file, cgroup_root, spawner,
                        handover_error)


def _start_fresh(udir: str, control: str | None, state_dir: str | None, health_listen: str | None,
                 log_format: str | None, log_file: str | None, cgroup_root: str | None,
                 spawner: SpawnerProcess | None, handover_error: str | None) -> int:
    try:
        stack = load_stack(udir)
    except StackInvalid as exc:
        print(f"omnid: invalid stack in {udir}:", file=sys.stderr)
        for err in exc.errors:
            print(f"  {err}", file=sys.stderr)
        return 2
    cfg = settings.resolve(units_dir=udir, control=control, state_dir=state_dir, health_listen=health_listen,
                           log_format=log_format, cgroup_root=cgroup_root, stack_settings=stack.settings)
    try:
        nice = settings.daemon_nice(stack.settings)
    except ValueError as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return 2
    logconfig.configure(cfg.log_format, log_file=log_file)
    linux.mark_fds_non_inheritable()
    _set_title(cfg)
    lock_fd = _lock_state_dir(cfg)
    if lock_fd < 0:
        return 1
    try:
        prepare_socket_dir(cfg.control)
    except ControlError as exc:
        print(f"omnid: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omnid: cannot create control socket directory for {cfg.control}: {exc}", file=sys.stderr)
        return 1
    # Taken out of the environment before the spawner is exec'd: units never see systemd's socket.
    daemon = Daemon(cfg, stack, ServiceNotifier())
    daemon.lock_fd, daemon.log_file, daemon.handover_error = lock_fd, log_file, handover_error
    # The cgroup root (resolved like every setting, else systemd delegation): check memory_max /
    # tasks_max against it, and kill a previous daemon's unit cgroups.
    try:
        daemon.cgroups = cgroup_mod.start(cfg.cgroup_root, cfg.source("cgroup_root"), stack,
                                          companions=(spawner.pid,) if spawner else ())
    except cgroup_mod.CgroupError as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return 2
    previous = daemon.state.read()
    if previous:
        leftovers = find_leftovers(previous)
        if leftovers:
            log.warning("killing leftovers of a previous daemon", count=len(leftovers),
                        processes=[lo.describe() for lo in leftovers])
            alive = kill_leftovers(leftovers)
            if alive:
                log.error("leftovers of a previous daemon survived SIGKILL", processes=alive)
    # Start the spawner by exec while this process has no threads yet.
    daemon.spawner.launch(spawner)
    # After the spawner's exec, so units keep the usual soft limit: health connections,
    # pidfds and pipes must not run libzmq out of fds (it aborts on EMFILE).
    soft, _hard = raise_nofile_limit()
    # Before the first thread (libzmq's, the loop's to_thread): see linux.grow_fd_table.
    linux.grow_fd_table(linux.fd_table_size_for(len(stack.units), soft))
    _take_priority(daemon, nice, daemon.spawner.pid)
    try:
        return runloop.run(daemon.start_fresh())
    except SpawnerGone as exc:
        log.error("spawner failed to start", error=str(exc))
        return 1
    finally:
        os.close(lock_fd)


def _continue_after_reexec(rec: dict) -> int | None:
    """Go on from a handover: the same units, processes, fds and settings. None when it turned
    out unusable before anything was taken over (the caller falls back)."""
    cfg = reexecrecord.daemon_config(rec)
    stack = load_stack(rec["stack"]["directory"], reexecrecord.stack_sources(rec))
    reexecrecord.check_against_stack(rec, stack)
    log_file = rec["settings"]["log_file"]
    logconfig.configure(cfg.log_format, log_file=log_file)
    _set_title(cfg)
    daemon = Daemon(cfg, stack, ServiceNotifier(dict(rec["systemd"])))
    daemon.token = rec["token"]
    daemon.reexecs = rec["reexecs"] + 1
    daemon.lock_fd, daemon.log_file = rec["lock_fd"], log_file
    os.set_inheritable(daemon.lock_fd, False)
    if rec["cgroup"] is not None:
        daemon.cgroups = cgroup_mod.CgroupRoot.take_over(rec["cgroup"])
    soft, _hard = raise_nofile_limit()
    linux.grow_fd_table(linux.fd_table_size_for(len(stack.units), soft))  # the exec left one thread
    try:
        nice = settings.daemon_nice(stack.settings)
    except ValueError as exc:
        nice = stack.settings.daemon_nice
        log.error("the daemon's priority: the environment's value is not used", error=str(exc), daemon_nice=nice)
    _take_priority(daemon, nice, rec["spawner"]["pid"])  # kept across the exec; set again if daemon_nice changed
    log.info("taking over from the previous program", from_version=rec["from_version"],
             to_version=rec["to_version"], reexecs=daemon.reexecs)
    try:
        return runloop.run(daemon.continue_after_reexec(rec))
    finally:
        os.close(daemon.lock_fd)


def _take_priority(daemon: Daemon, setting: int | None, spawner_pid: int) -> None:
    """After the spawner's exec (so the units keep the nice value omnid was started with) and
    before the loop's threads: the daemon's own nice value (settings.daemon_nice), unset ahead
    of the units' (the spawner's: after a re-exec this program's own is already raised)."""
    try:
        units_nice = os.getpriority(os.PRIO_PROCESS, spawner_pid)
    except OSError:
        units_nice = os.getpriority(os.PRIO_PROCESS, 0)
    want = daemon_nice_for(setting, units_nice)
    daemon.nice, why = raise_daemon_priority(want)
    if why:
        log.warning("the daemon's priority is not raised", nice=daemon.nice, daemon_nice=want, why=why)


def _forget_the_previous_program(cfg: DaemonConfig, udir: str, why: str) -> None:
    """The record could not be used: stop the units provably ours, close what the previous
    program left open, reap its children (omnid.daemon.handover); the stack then starts afresh."""
    from omnid.daemon import handover

    survivors = handover.stop_what_is_provably_ours(cfg.state_dir, udir, why)
    if survivors:
        log.error("units of the previous program survived SIGKILL", processes=survivors)
    handover.forget_inherited_fds()
    handover.reap_old_children()


def _set_title(cfg: DaemonConfig) -> None:
    try:
        from setproctitle import setproctitle

        setproctitle(f"omnid: daemon {cfg.units_dir}")
    except ImportError:
        pass


def _lock_state_dir(cfg: DaemonConfig) -> int:
    """The state directory, made private, and its lock held for the daemon's life; -1 (said
    why) when another daemon holds it or the directory is not safe."""
    state_dir_path = Path(cfg.state_dir)
    try:
        if not os.path.lexists(state_dir_path):
            state_dir_path.mkdir(parents=True, mode=0o700)
            os.chmod(state_dir_path, 0o700)
        # A state directory another user can write would let them list pids for us to kill.
        check_private_dir(state_dir_path, "state directory")
        lock_fd = os.open(state_dir_path / "daemon.lock",
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except UnsafePath as exc:
        print(f"omnid: {exc}", file=sys.stderr)
        return -1
    except OSError as exc:
        print(f"omnid: cannot use state dir {cfg.state_dir}: {exc}", file=sys.stderr)
        return -1
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"omnid: another daemon holds {cfg.state_dir}/daemon.lock", file=sys.stderr)
        os.close(lock_fd)
        return -1
    return lock_fd
