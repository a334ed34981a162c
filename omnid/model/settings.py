"""The one settings resolver of `omnid start` and `omnid daemon`.

Every daemon setting is taken from, in this order: the command-line flag, the
environment (OMNID_CONTROL, OMNID_STATE_DIR, OMNID_HEALTH_LISTEN,
OMNID_LOG_FORMAT, OMNID_CGROUP_ROOT), the stack's omnid.toml, the built-in default. `omnid start`
resolves with this same function (to know where the daemon will put its socket
and log) and hands the daemon only the flags the operator gave, so the daemon
resolves to the same answer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DEFAULT_HEALTH = "127.0.0.1:9321"
LOG_FORMATS = ("json", "console")


def default_control() -> str:
    if os.getuid() == 0:
        return "/run/omnid/control.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "omnid", "control.sock")
    return f"/tmp/omnid-{os.getuid()}/control.sock"


def default_state_dir() -> str:
    if os.getuid() == 0:
        return "/var/lib/omnid"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "omnid")


def default_cache_root() -> str:
    """Where units' `cache_dir` directories live unless omnid.toml says `cache_root`: systemd's
    CacheDirectory= places (/var/cache for root, the user's XDG cache directory otherwise)."""
    if os.geteuid() == 0:
        return "/var/cache/omnid"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "omnid")


def default_units_dir() -> str:
    """The built-in reference stack: units/demo of the checkout, or the copy shipped in the package."""
    here = Path(__file__).resolve().parent.parent  # omnid/, from omnid/model/settings.py
    for candidate in (here.parent / "units" / "demo", here / "demo" / "units"):
        if candidate.is_dir():
            return str(candidate)
    return str(here.parent / "units" / "demo")


def default_log_format() -> str:
    """Console lines for a person at a terminal, JSON lines for journald, files and pipes."""
    return "console" if sys.stderr.isatty() else "json"


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT, parsed in one place (omnid.units.parse_host_port)."""
    from omnid.model.units import parse_host_port

    return parse_host_port(text)


@dataclass(frozen=True)
class DaemonConfig:
    units_dir: str
    control: str
    state_dir: str
    health_listen: str
    log_format: str
    cgroup_root: str | None = None  # None: delegation under systemd, else process groups (omnid.process.cgroup)
    # Where each value came from ("flag", "env", "omnid.toml", "default"): shown by
    # `omnid start` when it refuses, and checked by the tests.
    sources: tuple[tuple[str, str], ...] = ()

    def source(self, key: str) -> str:
        return dict(self.sources).get(key, "default")


def resolve(*, units_dir: str | None = None, control: str | None = None, state_dir: str | None = None,
            health_listen: str | None = None, log_format: str | None = None, cgroup_root: str | None = None,
            stack_settings=None,
            env: Mapping[str, str] | None = None) -> DaemonConfig:
    """Flags > environment > omnid.toml (``stack_settings``: a Stack's ``settings``) > defaults."""
    env = os.environ if env is None else env
    st = stack_settings
    sources: list[tuple[str, str]] = []

    def pick(key: str, flag, env_name: str, toml_value, default):
        for origin, value in (("flag", flag), ("env", env.get(env_name)), ("omnid.toml", toml_value)):
            if value:
                sources.append((key, origin))
                return str(value)
        sources.append((key, "default"))
        return default()

    cfg = DaemonConfig(
        units_dir=os.path.abspath(units_dir or default_units_dir()),
        control=os.path.abspath(pick("control", control, "OMNID_CONTROL", st and st.control, default_control)),
        state_dir=os.path.abspath(pick("state_dir", state_dir, "OMNID_STATE_DIR", st and st.state_dir,
                                       default_state_dir)),
        health_listen=pick("health_listen", health_listen, "OMNID_HEALTH_LISTEN", st and st.health_listen,
                           lambda: DEFAULT_HEALTH),
        log_format=pick("log_format", log_format, "OMNID_LOG_FORMAT", st and st.log_format, default_log_format),
        cgroup_root=pick("cgroup_root", cgroup_root, "OMNID_CGROUP_ROOT", st and getattr(st, "cgroup_root", None),
                         lambda: None),
        sources=(),
    )
    return DaemonConfig(cfg.units_dir, cfg.control, cfg.state_dir, cfg.health_listen, cfg.log_format,
                        cfg.cgroup_root, tuple(sources))


NICE_ENV = "OMNID_DAEMON_NICE"


def daemon_nice(stack_settings, env: Mapping[str, str] | None = None) -> int | None:
    """The daemon's own nice value: $OMNID_DAEMON_NICE, else omnid.toml `daemon_nice`; None when
    neither says (omnid.base.priority.daemon_nice_for: ahead of the units). ValueError naming the
    variable when it is not an integer from -20 to 19."""
    env = os.environ if env is None else env
    text = env.get(NICE_ENV)
    if text is None or text == "":
        return stack_settings.daemon_nice
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or not -20 <= value <= 19:
        raise ValueError(f"{NICE_ENV}: expected an integer from -20 to 19, got {text!r}")
    return value


def load_and_resolve(**flags) -> tuple[object, DaemonConfig]:
    """Load the stack (StackInvalid propagates) and resolve against its omnid.toml."""
    from omnid.model.units import load_stack

    udir = os.path.abspath(flags.get("units_dir") or default_units_dir())
    stack = load_stack(udir)
    flags["units_dir"] = udir
    return stack, resolve(stack_settings=stack.settings, **flags)
