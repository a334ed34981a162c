"""The one gate for omnid's test switches: environment variables that make the daemon do what
production must never do (raise in an action, corrupt its re-exec record, read GPUs or the
NUMA topology from files). Each is obeyed only when omnid's own test harness started the daemon -- it sets
OPT_IN_ENV -- and the daemon is not a systemd service, a Kubernetes container or a Slurm
job, where a variable set by mistake (an inherited environment, a copied manifest) would
otherwise decide what a production host does.

A switch that is set but refused is ignored, not obeyed, and said once at start as an error
naming the variable and why (`refused_at_start`). Ignored rather than refusing to start:
a daemon that will not start takes its whole stack down, and the next `omnid reexec` or
restart of a daemon running with a stray variable would be that outage; ignoring makes the
switch have no effect at all, which is what matters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OPT_IN_ENV = "OMNID_TEST_SUITE"  # "1": set by tests/harness.py, never by anything shipped

INJECT_FAULT_ENV = "OMNID_TEST_INJECT_FAULT"  # omnid.core.faults: one action raises once
FAULT_HANDOVER_ENV = "OMNID_FAULT_HANDOVER"  # omnid.daemon.record: "corrupt" writes an unreadable record
FAKE_GPU_ENV = "OMNID_DEVELOPER_FAKE_GPU"  # omnid.gpu.fake: GPUs read from a JSON file
SYSFS_ROOT_ENV = "OMNID_SYSFS_ROOT"  # omnid.process.numa: the NUMA topology read from a fake tree

# Every switch, and what it would do if obeyed (for the refusal's log line).
SWITCHES = {
    INJECT_FAULT_ENV: "makes an action of the supervisor raise",
    FAULT_HANDOVER_ENV: "corrupts the re-exec record",
    FAKE_GPU_ENV: "replaces the real GPUs with a file",
    SYSFS_ROOT_ENV: "reads the NUMA topology from a fake tree",
}


def refusal(environ: Mapping[str, str] | None = None) -> str | None:
    """Why test switches are not obeyed in this process, or None where they are."""
    env = os.environ if environ is None else environ
    # systemd sets SYSTEMD_EXEC_PID to the pid of the service's main process; a test daemon
    # started under a CI runner that is itself a service inherits it with another pid.
    # Before systemd 248 (no SYSTEMD_EXEC_PID): a service's main process is a child of pid 1.
    if env.get("SYSTEMD_EXEC_PID") == str(os.getpid()) or (env.get("INVOCATION_ID") and os.getppid() == 1):
        return "omnid runs as a systemd service (a production host); unset it in the service's environment"
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "omnid runs in a Kubernetes pod (KUBERNETES_SERVICE_HOST is set); unset it in the pod's spec"
    if env.get("SLURM_JOB_ID"):
        return "omnid runs in a Slurm job (SLURM_JOB_ID is set); unset it in the job's environment"
    if env.get(OPT_IN_ENV) != "1":
        return (f"test switches are obeyed only in omnid's own test suite ({OPT_IN_ENV}=1, which its "
                "harness sets); unset it")
    return None


def value(name: str) -> str | None:
    """The switch's value where it is set and obeyed, else None."""
    assert name in SWITCHES, name
    raw = os.environ.get(name)
    if not raw or refusal() is not None:
        return None
    return raw


def refused_at_start() -> list[tuple[str, str]]:
    """(variable, why it is ignored) for each switch set in the environment and not obeyed:
    what the daemon logs once at start, as an error."""
    why = refusal()
    if why is None:
        return []
    return [(name, f"{name} ({does}) ignored: {why}") for name, does in SWITCHES.items() if os.environ.get(name)]
