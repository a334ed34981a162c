"""The daemon's own CPU priority (omnid.toml `daemon_nice`; omnid(8), "The daemon's priority").

A GPU host's units keep every core busy: vLLM's CPU workers spin in sched_yield between
batches, a model load imports for minutes on every core. The supervisor among them must still
see a death within milliseconds, answer /health and renew its cluster lease on time (a lease
renewed late fences every rank of a group on every host). So the daemon runs at a lower nice
value than its units: the scheduler (EEVDF) then gives it the CPU soon after it wakes, and it
asks for little.

Linux keeps a nice value per thread (setpriority(PRIO_PROCESS, tid)); a new thread takes its
creator's. So every thread that exists is set, and the ones created later (the executor's,
libzmq's, the cleanup's) take the main thread's. The units do not: the spawner, which forks
them, was exec'd before this is called and keeps the nice value omnid was started with.
"""

from __future__ import annotations

import os

# Unless daemon_nice says otherwise, the daemon runs this many nice steps ahead of its units (of the
# value omnid was started with), at most at -20: omnid started at 0 runs at -10, omnid started at
# -15 (a service manager's Nice=-15) at -20, never behind its units.
DAEMON_NICE_AHEAD = 10


def daemon_nice_for(setting: int | None, units_nice: int) -> int:
    """The value the daemon takes: the setting, else DAEMON_NICE_AHEAD steps ahead of the
    units' value (never behind them when omnid itself was started at a raised priority)."""
    if setting is not None:
        return setting
    return max(-20, units_nice - DAEMON_NICE_AHEAD)


def raise_daemon_priority(nice: int) -> tuple[int, str | None]:
    """Set every thread of this process to `nice`. Returns (the main thread's nice value now,
    why it is not `nice`, or None). Raising priority needs CAP_SYS_NICE or RLIMIT_NICE room:
    without it the value stays, and the reason says so (not an error: omnid still works)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before == nice:
        return nice, None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError as exc:
        return before, f"cannot list this process's threads: {exc.strerror}"
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            return os.getpriority(os.PRIO_PROCESS, 0), (
                f"nice {nice} needs CAP_SYS_NICE (or RLIMIT_NICE); the daemon stays at nice {before}")
        except OSError as exc:
            return os.getpriority(os.PRIO_PROCESS, 0), f"setpriority(nice {nice}) failed: {exc.strerror}"
    return os.getpriority(os.PRIO_PROCESS, 0), None
