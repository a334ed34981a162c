"""The users and groups units run as, resolved once per stack load, never on the event loop.

A `user` or `group` of a unit file is a name; the uid, gid and supplementary groups come from
NSS (getpwnam, getgrnam, getgrouplist), which may ask LDAP or SSSD and wait for as long as
they take. `load_stack` resolves every name of the stack it read (the daemon's start, before
its loop; a reload's read, on a thread of its own, bounded) and keeps the answers here; the
spawn path (the socket files' owner, the private directory's owner, what the spawner switches
to) reads them. A name that does not resolve is kept as its error, said by the spawn that
needs it, as before.
"""

from __future__ import annotations

import grp
import os
import pwd
import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Account:
    """What a unit's `user` and `group` resolve to: -1 for "the daemon's own"; `groups`: the
    user's supplementary groups (None without a user); `error` for a name that does not
    resolve (the rest is then unset)."""

    uid: int = -1
    gid: int = -1
    groups: tuple[int, ...] | None = None
    error: str = ""


_known: dict[tuple[str | None, str | None], Account] = {}
_lock = threading.Lock()


def resolve(user: str | None, group: str | None) -> Account:
    """Ask NSS now (may block: never on the loop). The error's words are the spawner's."""
    uid = gid = -1
    groups = None
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError as exc:
            return Account(error=f"group {group!r} failed: {exc}")
    if user:
        try:
            pw = pwd.getpwnam(user)
        except KeyError as exc:
            return Account(error=f"user {user!r} failed: {exc}")
        if gid < 0:
            gid = pw.pw_gid
        uid = pw.pw_uid
        groups = tuple(os.getgrouplist(pw.pw_name, gid))
    return Account(uid, gid, groups)


def resolve_all(names: Iterable[tuple[str | None, str | None]]) -> None:
    """Resolve each (user, group) pair and keep the answers (a stack load: a new read of the
    system's accounts replaces the older answers for the same names)."""
    fresh = {pair: resolve(*pair) for pair in set(names) if pair != (None, None)}
    with _lock:
        _known.update(fresh)


def of(user: str | None, group: str | None) -> Account:
    """The account a (user, group) pair resolved to at the last stack load. A pair no stack
    load has seen (a unit made outside load_stack) is resolved now, and kept."""
    if not user and not group:
        return Account()
    with _lock:
        known = _known.get((user, group))
    if known is None:
        known = resolve(user, group)
        with _lock:
            _known[(user, group)] = known
    return known
