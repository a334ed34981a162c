"""What the `omnid` command prints: unit tables, the stop summary, events, log
lines; colours only on a terminal. Used by omnid.cli."""

from __future__ import annotations

import os
import re
import sys
import time
from datetime import datetime


# --------------------------------------------------------------------------- output
def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 120:
        return f"{s:.1f}s ago"
    if s < 7200:
        return f"{s / 60:.0f}m ago"
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def use_colour(stream=None) -> bool:
    """Colours on a terminal only, and never with NO_COLOR set."""
    stream = stream or sys.stdout
    return stream.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


_COLOURS = {"active": "32", "failed": "31;1", "starting": "33", "stopping": "33", "inactive": "2"}


def colour_state(text: str, state: str, on: bool) -> str:
    code = _COLOURS.get(state)
    return f"\x1b[{code}m{text}\x1b[0m" if on and code else text


def unit_usage(pid: int | None) -> tuple[int, float, int] | None:
    """(RSS bytes, CPU seconds, tasks = threads) over a unit's main process and its descendants,
    read here from /proc (the CLI runs on the daemon's host); None when it is not running."""
    from omnid.process.handle import tree_usage

    use = tree_usage(pid)
    return (use.rss, use.cpu_s, use.threads) if use else None


def usage_of_trees(pids: list[int]) -> dict[int, tuple[int, float, int]]:
    """unit_usage for many units from one read of /proc (every /proc/PID/stat once): psutil's
    children(recursive=True) reads all of /proc per unit, seconds for a 20-unit stack on a
    busy host. {main pid: (RSS bytes, CPU seconds, tasks)} for the pids that are running."""
    page, hz = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, int, float, int]] = {}  # pid -> (ppid, rss, cpu s, threads)
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        try:
            stats[int(name)] = (int(fields[1]), int(fields[21]) * page,
                                (int(fields[11]) + int(fields[12])) / hz, int(fields[17]))
        except (IndexError, ValueError):
            continue
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(st[0], []).append(pid)
    out = {}
    for main in pids:
        if main not in stats:
            continue
        rss, cpu, threads, todo, seen = 0, 0.0, 0, [main], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            _, r, c, t = stats[pid]
            rss, cpu, threads = rss + r, cpu + c, threads + t
            todo.extend(children.get(pid, ()))
        out[main] = (rss, cpu, threads)
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def human_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}min {int(s % 60)}s"
    if s < 86400:
        return f"{int(s // 3600)}h {int(s % 3600 // 60)}min"
    return f"{int(s // 86400)}d {int(s % 86400 // 3600)}h"


def uptime(u: dict) -> str:
    if u["state"] != "active" or not u.get("since"):
        return "-"
    return human_seconds(max(0.0, time.time() - u["since"]))


# The table's columns and the width each keeps whatever it shows (a refresh under `watch`
# moves nothing): at least as wide as the heading and the usual values; a longer value
# only pushes the rest of its own row. UNIT is as wide as the longest name of the stack,
# REASON is last and free.
_COLUMNS = (("STATE", 8), ("READY", 5), ("PID", 7), ("UPTIME", 10), ("MEM", 7), ("CPU", 8), ("TASKS", 5),
            ("GPU", 8), ("RESTARTS", 8), ("LAST EXIT", 18))
_PID_NOTE = re.compile(r" \(pid \d+, (while \w+|stopped)\)$")


def _row(u: dict, use: tuple[int, float, int] | None) -> list[str]:
    gpu = f"{u['gpu_mib']:.0f}MiB" if u.get("gpu_mib") is not None else "-"
    ready = "-" if u["state"] != "active" else ("yes" if u.get("ready") else "no")
    last_exit = _PID_NOTE.sub("", u.get("last_exit") or "") or "-"  # the pid is in `status UNIT`
    return [u["state"], ready, str(u["pid"] or "-"), uptime(u), human_bytes(use[0]) if use else "-",
            f"{use[1]:.1f}s" if use else "-", str(use[2]) if use else "-", gpu, str(u["restarts"]), last_exit,
            u.get("reason") or ""]


def print_units(units: list[dict], *, usage: bool = True, colour: bool | None = None,
                tiers: list[list[str]] | None = None, because: dict[str, str] | None = None,
                width_limit: int | None = None) -> None:
    """The systemctl-like table: state, ready, pid, uptime, memory, CPU, tasks, GPU memory,
    restarts (automatic ones), last exit, reason. With `tiers` (the start order), units
    are grouped by tier, the tier's number on its first row."""
    colour = use_colour() if colour is None else colour
    by_name = {u["name"]: u for u in units}
    usage_by_pid = usage_of_trees([u["pid"] for u in units if u.get("pid")]) if usage else {}
    for name, failed in (because or {}).items():  # a unit that never started has no reason of its own
        u = by_name.get(name)
        if u is not None and not u.get("reason"):
            by_name[name] = {**u, "reason": f"not started: requires {failed}, which failed"}
    units = [by_name[u["name"]] for u in units]
    groups: list[tuple[str, list[dict]]]
    if tiers:
        groups = [(str(i), [by_name[n] for n in t if n in by_name]) for i, t in enumerate(tiers)]
        placed = {n for t in tiers for n in t}
        rest = [u for u in units if u["name"] not in placed]  # a reload in between: shown, not lost
        groups = [g for g in groups if g[1]] + ([("?", rest)] if rest else [])
    else:
        groups = [("", units)]
    name_w = max([4, *(len(u["name"]) for u in units)])
    lead = ["TIER"] if tiers else []

    def line(first: list[str], name: str, cells: list[str], state: str | None) -> str:
        out = [c.ljust(4) for c in first] + [name.ljust(name_w)]
        for (_, width), c in zip(_COLUMNS, cells):
            out.append(c.ljust(width))
        text = ("  ".join(out) + "  " + cells[-1]).rstrip()
        if width_limit and len(text) > width_limit:  # on a terminal, as systemctl: cut, never wrap
            text = text[:width_limit - 1] + "…"
        if state is not None and colour:  # the STATE cell, coloured after the cut (escapes take no room)
            at = sum(len(c) + 2 for c in out[:len(first) + 1])
            cell = text[at:at + len(out[len(first) + 1])]
            text = text[:at] + colour_state(cell, state, True) + text[at + len(cell):]
        return text

    print(line(lead, "UNIT", [h for h, _ in _COLUMNS] + ["REASON"], None))
    for tier, members in groups:
        for i, u in enumerate(members):
            print(line([tier if i == 0 else ""] if tiers else [], u["name"], _row(u, usage_by_pid.get(u.get("pid") or 0)),
                       u["state"]))
    seen = {u["group"]["name"]: u["group"] for u in units if u.get("group")}
    for g in seen.values():  # worker groups across hosts (omnid(8), CLUSTER)
        print(group_line(g))


_VERDICT_COLOUR = {"ok": "active", "failed": "failed", "starting": "starting", "degraded": "starting",
                   "draining": "stopping", "stopping": "stopping"}


def verdict_lines(units: list[dict], daemon: dict, *, colour: bool) -> list[str]:
    """The first lines of `omnid status`: is the stack OK, and if not, why -- the verdict
    /health gives, the units that failed (the root cause: a unit stopped because one it
    requires failed names it in its reason), then what the stack and the daemon are."""
    verdict = daemon.get("health") or _verdict(units)
    n = len(units)
    counts: dict[str, int] = {}
    for u in units:
        counts[u["state"]] = counts.get(u["state"], 0) + 1
    word = colour_state(verdict.upper(), _VERDICT_COLOUR.get(verdict, ""), colour)
    dot = colour_state("●", _VERDICT_COLOUR.get(verdict, ""), colour)
    failed = [u for u in units if u["state"] == "failed"]
    because = daemon.get("down_because") or {}  # {unit: the failed unit it requires}
    down_for = [u for u in units if u["name"] in because]
    degraded = {u["name"]: u["degraded"] for u in units if u.get("degraded")}
    lines = []
    if verdict == "ok":
        lines.append(f"{dot} {word}: {n}/{n} units active and ready")
    elif failed:
        first = failed[0]
        lines.append(f"{dot} {word}: {first['name']} failed: {first.get('reason') or 'no reason recorded'}")
        for u in failed[1:3]:
            lines.append(f"  and {u['name']} failed: {u.get('reason') or 'no reason recorded'}")
        if len(failed) > 3:
            lines.append(f"  and {len(failed) - 3} more failed: {', '.join(u['name'] for u in failed[3:])}")
        if down_for:
            causes = sorted({because[u["name"]] for u in down_for})
            lines.append(f"  down with it: {_names(down_for)} (require{'s' if len(down_for) == 1 else ''} "
                         f"{', '.join(causes)})")
    elif degraded:
        name, why = next(iter(degraded.items()))
        lines.append(f"{dot} {word}: {name}: {why}")
    else:
        pending = [u for u in units if not (u["state"] == "active" and u.get("ready"))]
        def doing(u: dict) -> str:
            if u.get("goal") == "inactive":
                return "stopped by request" if u["state"] == "inactive" else "stopping by request"
            return u["state"] if u["state"] != "active" else "not ready"

        what = ", ".join(f"{u['name']} ({doing(u)})" for u in pending[:4]) + (f" and {len(pending) - 4} more" if len(pending) > 4 else "")
        lines.append(f"{dot} {word}: {len(pending)} of {n} units not up: {what}" if pending
                     else f"{dot} {word}")
    tally = ", ".join(f"{counts[s]} {s}" for s in ("active", "starting", "stopping", "inactive", "failed")
                      if counts.get(s))
    up = human_seconds(max(0.0, time.time() - daemon["since"])) if daemon.get("since") else "?"
    lines.append(f"  {n} units: {tally}; daemon pid {daemon.get('pid', '?')}, up {up}; "
                 f"units {daemon.get('units_dir', '?')}")
    if daemon.get("health_listen"):
        lines.append(f"  health http://{daemon['health_listen']}/health")
    return lines


def _names(units: list[dict], most: int = 6) -> str:
    names = [u["name"] for u in units]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _verdict(units: list[dict]) -> str:
    """A daemon that does not say its verdict: the same rules as /health, from the units alone."""
    if any(u["state"] == "failed" for u in units):
        return "failed"
    if any(u["state"] == "stopping" or u.get("goal") == "inactive" or u.get("degraded") for u in units):
        return "degraded"
    return "ok" if all(u["state"] == "active" and u.get("ready") for u in units) else "starting"


def print_status(units: list[dict], daemon: dict, *, colour: bool | None = None, full: bool = False) -> None:
    """`omnid status`: the verdict and its cause on top, then the units grouped by tier. On a
    terminal, table rows are cut at its width (`full`: never); into a pipe never."""
    import shutil

    colour = use_colour() if colour is None else colour
    for line in verdict_lines(units, daemon, colour=colour):
        print(line)
    print()
    limit = None if full or not sys.stdout.isatty() else shutil.get_terminal_size().columns
    print_units(units, colour=colour, tiers=daemon.get("tiers"), because=daemon.get("down_because"),
                width_limit=limit)


def group_line(g: dict) -> str:
    """"group tp generation 3 (running): node-a up, node-b up"."""
    hosts = ", ".join(f"{h} {st}" for h, st in g.get("hosts", {}).items())
    return f"group {g['name']} generation {g['generation']} ({g.get('state', '?')}): {hosts}"


def print_unit_detail(u: dict, lines: list[dict], *, colour: bool | None = None) -> None:
    """`omnid status UNIT`: one unit in detail, then its last log lines."""
    colour = use_colour() if colour is None else colour
    dot = colour_state("●", u["state"], colour)
    print(f"{dot} {u['name']}" + (f" - {u['description']}" if u.get("description") else ""))
    state = colour_state(u["state"], u["state"], colour)
    since = ""
    if u.get("since"):
        since = f" since {datetime.fromtimestamp(u['since']).strftime('%Y-%m-%d %H:%M:%S')}; {_ago(u['since'])}"
    ready = "" if u["state"] != "active" else (" (ready)" if u.get("ready") else " (not ready)")
    print(f"     State: {state}{ready}{since}")
    print(f"      Goal: {u.get('goal', '-')}")
    if u.get("role"):
        print(f"      Role: {u['role']}")
    if u.get("pid"):
        print(f"  Main PID: {u['pid']} (process group {u.get('pgid') or u['pid']})")
    use = unit_usage(u.get("pid"))
    if use:
        print(f"     Tasks: {use[2]}")
        print(f"    Memory: {human_bytes(use[0])}")
        print(f"       CPU: {use[1]:.3f}s")
    if u.get("placement") is not None:
        for line in placement_lines(u["placement"], u.get("pid")):
            print(line)
    if u.get("gpu_mib") is not None:
        print(f"  GPU mem.: {u['gpu_mib']:.0f} MiB")
    if u.get("gpu_held"):
        print(f"  GPU held: {'; '.join(u['gpu_held'])} (after its processes were killed)")
    elif u.get("gpu_release_ms") is not None:
        print(f"  GPU free: {u['gpu_release_ms']:.0f} ms after the last stop or failure")
    if u.get("group"):
        print(f"     Group: {group_line(u['group'])}")
    print(f"  Restarts: {u['restarts']} automatic" + (" (gave up)" if u.get("gave_up") else ""))
    if u.get("last_exit"):
        print(f" Last exit: {u['last_exit']}")
    if u.get("private_tmp"):
        print(f"    TMPDIR: {u['private_tmp']}")
    if u.get("ipc_removed"):
        print(f"  IPC gone: {len(u['ipc_removed'])} removed when it was last gone: {'; '.join(u['ipc_removed'])}")
    if u.get("reason"):
        print(f"    Reason: {u['reason']}")
    if u.get("log"):
        lg = u["log"]
        print(f"       Log: {lg['lines']} lines read, {lg['not_echoed']} not echoed (rate limit), "
              f"{lg['truncated']} cut at 16 KiB, {lg['read_pauses']} read pauses")
    if u.get("status_text"):
        print(f"    Status: \"{u['status_text']}\"")
    if u.get("last_capture"):
        c = u["last_capture"]
        print(f"   Capture: {_ago(c['ts'])} ({c['why']}): {c['summary']}; `omnid dump {u['name']}` shows it")
    if lines:
        print()
        for item in lines:
            print(format_log_line(item))


def placement_lines(p: dict, pid: int | None) -> list[str]:
    """`omnid status UNIT`: the NUMA placement omnid sets at spawn (omnid.process.numa), and what the
    kernel says about the running process."""
    if p.get("error"):
        lines = [f"      NUMA: none: {p['error']}"]
    elif p.get("cpus") or p.get("memory") not in (None, "default"):
        nodes = p.get("nodes") or []
        where = ("nodes " if len(nodes) > 1 else "node ") + ",".join(map(str, nodes))
        memory = (f"memory {p['memory']} on {p['memory_nodes']}" if p.get("memory") not in (None, "default")
                  else "memory default")
        lines = [f"      NUMA: {where} (from {p.get('source')}): CPUs {p.get('cpus') or 'not set'}, {memory}"]
    else:
        lines = ["      NUMA: none" + (f" (from {p['source']})" if p.get("source") else "")]
    if p.get("note"):
        lines.append(f"            {p['note']}")
    if pid:
        from omnid.process.numa import kernel_placement

        seen = kernel_placement(pid)
        if seen:
            lines.append(f"    kernel: {seen}")
    return lines


def format_log_line(item: dict, unit: str | None = None) -> str:
    ts = datetime.fromtimestamp(item.get("ts") or 0).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    prefix = f"{unit} " if unit else ""
    return f"{ts} {prefix}[{item.get('stream', 'output')}] {item['line']}"


def log_line_json(item: dict, unit: str) -> str:
    import json

    from datetime import timezone

    ts = datetime.fromtimestamp(item.get("ts") or 0, tz=timezone.utc).isoformat()
    return json.dumps({"ts": ts, "unit": unit, "stream": item.get("stream", "output"), "line": item["line"]})


def print_summary(summary: list[dict]) -> None:
    if not summary:
        print("nothing was running")
        return
    rows = [("UNIT", "SIGNAL", "EXIT", "ESCALATED", "GPU RELEASE", "RESIDUE")]
    for r in summary:
        secs = f"{r['seconds']:.3f}s" if r.get("seconds") is not None else "-"
        gpu = f"{r['gpu_release_ms']:.0f}ms" if r.get("gpu_release_ms") is not None else "-"
        residue = "none"
        if r.get("unkillable"):
            residue = "UNKILLABLE: " + "; ".join(r["unkillable"])
        elif r.get("residue"):
            residue = f"{len(r['residue'])} killed: " + "; ".join(r["residue"])
        if r.get("gpu_held"):
            gpu = "HELD"
            residue = ("" if residue == "none" else residue + "; ") + "GPU: " + "; ".join(r["gpu_held"])
        sent = r["signal"]
        if r.get("to") == "main":  # kill_mode mixed / process: the main process first, then the rest
            sent += " to main"
            if r.get("rest"):
                after = f" at {r['main_seconds']:.3f}s" if r.get("main_seconds") is not None else ""
                sent += f", rest {r['rest']}{after}"
        elif r.get("rest"):  # the main process exited by itself (a drain), then the rest
            sent = f"rest {r['rest']}"
        if r.get("ipc_removed"):
            residue = (("" if residue == "none" else residue + "; ") + f"IPC: {len(r['ipc_removed'])} removed: "
                       + "; ".join(r["ipc_removed"]))
        rows.append((r["unit"], sent, secs, "SIGKILL" if r["escalated"] else "no", gpu, residue))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:5])) + "  " + row[5])
    for r in summary:  # after the exit, on its own clock: the removal of what the processes left
        line = cleanup_line(r)
        if line:
            print(f"{r['unit']}: {line}")


def cleanup_line(r: dict) -> str:
    """The stop's cleanup step in words ("cleanup 3.214s: private tmp removed (150301 entries)"),
    or "" when there was no tree to walk (an empty directory goes with one rmdir)."""
    if r.get("cleanup_seconds") is None or not (r.get("tmp_entries") or r.get("tmp_left")):
        return ""
    left = r.get("tmp_left") or ""
    if left.endswith("the rest is being removed in the background"):  # omnid.core.cleanup's words
        what = f"private tmp still being removed: {left}"
    elif left:
        what = f"private tmp NOT removed: {left}"
    else:
        what = f"private tmp removed ({r['tmp_entries']} entries)"
    return f"cleanup {r['cleanup_seconds']:.3f}s: {what}"


def format_event(ev: dict) -> str:
    """One event line: `12:00:01.234 worker@0 pid 12670: starting -> active — reason`. A unit's
    current state (`omnid events` starts with one per unit) has no "from": `-> active`."""
    ts = datetime.fromtimestamp(ev.get("ts") or time.time()).strftime("%H:%M:%S.%f")[:-3]
    pid = f" pid {ev['pid']}" if ev.get("pid") else ""
    reason = f" — {ev['reason']}" if ev.get("reason") else ""
    change = f"{ev['from']} -> {ev.get('to')}" if ev.get("from") else f"-> {ev.get('to')}"
    return f"{ts} {ev.get('unit')}{pid}: {change}{reason}"


def print_reload_plan(plan: dict) -> None:
    """`omnid reload`: what changes, unit by unit, and which keys made it change."""
    changes = plan.get("changes", {})
    rows = [("added", plan.get("added", [])), ("removed", plan.get("removed", [])),
            ("restarted", plan.get("restarted", [])), ("updated", plan.get("updated", []))]
    if not any(names for _, names in rows):
        print(f"reload: nothing changed ({len(plan.get('unchanged', []))} units unchanged)")
    for what, names in rows:
        for n in names:
            keys = changes.get(n)
            print(f"{what:<10} {n}" + (f"  ({', '.join(keys)})" if keys else ""))
            note = plan.get("notes", {}).get(n)
            if note:
                print(f"{'':<10}   note: {note}")
    if any(names for _, names in rows):
        print(f"{'unchanged':<10} {len(plan.get('unchanged', []))} units")
    for st in plan.get("settings", []):
        print(f"setting    {st['key']}: {st['from']} -> {st['to']}: {st['applies']}")


def print_restart_plan(plan: list[dict]) -> None:
    """`omnid restart`: every unit it stops and starts again, and why, before it acts."""
    rows = [(p["unit"], p["why"]) for p in plan]
    width = max(len(u) for u, _ in rows)
    named = [u for u, why in rows if why == "named"]
    more = len(rows) - len(named)
    print(f"restarting {', '.join(named)}" + (f", and {more} more unit{'s' if more != 1 else ''} with "
                                              f"{'them' if len(named) > 1 else 'it'}:" if more else ""))
    for unit, why in rows:
        if why != "named":
            print(f"  {unit.ljust(width)}  {why}")


def print_captures(captures: list[dict]) -> None:
    """`omnid dump`: each capture's text, oldest first, a rule between two."""
    for i, c in enumerate(captures):
        if i:
            print("-" * 72)
        print(c["text"], end="")


def print_gpu(gpu: dict | None) -> None:
    """Below `omnid status`: the GPU backend when it cannot be read or is the developer's
    fake, and each GPU condition (an Xid, memory health, a stuck read) with the units it
    reaches."""
    if not gpu or gpu.get("backend") in (None, "none"):
        return
    lines = [f"GPU: {gpu['warning']}"] if gpu.get("warning") else []  # the fake backend
    if not gpu.get("readable"):
        stuck = gpu.get("stuck_threads") or 0
        lines.append(f"GPU: {gpu['backend']} {gpu.get('reason') or 'unreadable'}"
                     + (f" ({stuck} reader thread{'s' if stuck != 1 else ''} stuck)" if stuck else ""))
    health = gpu.get("health") or {}
    for c in gpu.get("conditions") or []:
        if c["source"] == "unreadable" and not gpu.get("readable"):
            continue  # said above
        units = health.get(c["gpu"], {}).get("units") or []
        reach = f" [units: {', '.join(units)}]" if units else ""
        lines.append(f"GPU: {c['gpu']} {c['status']}: {c['reason']}{reach}")
    if lines:
        print()
        for line in lines:
            print(line)
