"""What the `omnid` command prints: unit tables, the stop summary, events, log
lines; colours only on a terminal. Used by omnid.cli."""

from __future__ import annotations

import os
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
    from omnid.process import tree_usage

    use = tree_usage(pid)
    return (use.rss, use.cpu_s, use.threads) if use else None


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


def print_units(units: list[dict], *, usage: bool = True, colour: bool | None = None) -> None:
    """The systemctl-like table: state, pid, uptime, memory, CPU, tasks, GPU memory,
    restarts, last exit, reason."""
    colour = use_colour() if colour is None else colour
    rows = [("UNIT", "STATE", "PID", "UPTIME", "MEM", "CPU", "TASKS", "GPU", "RESTARTS", "LAST EXIT", "REASON")]
    states = [""]
    for u in units:
        state = u["state"] + ("" if u["state"] != "active" or u.get("ready") else " (not ready)")
        use = unit_usage(u.get("pid")) if usage else None
        gpu = f"{u['gpu_mib']:.0f}MiB" if u.get("gpu_mib") is not None else "-"
        rows.append((u["name"], state, str(u["pid"] or "-"), uptime(u),
                     human_bytes(use[0]) if use else "-", f"{use[1]:.1f}s" if use else "-",
                     str(use[2]) if use else "-", gpu, str(u["restarts"]),
                     u.get("last_exit") or "-", u.get("reason") or ""))
        states.append(u["state"])
    n = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    for r, st in zip(rows, states):
        cells = [c.ljust(widths[i]) for i, c in enumerate(r[:n])]
        cells[1] = colour_state(cells[1], st, colour)
        print("  ".join(cells) + "  " + r[n])
    groups = {u["group"]["name"]: u["group"] for u in units if u.get("group")}
    for g in groups.values():  # worker groups across hosts (omnid(8), CLUSTER)
        print(group_line(g))


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
    print(f"  Restarts: {u['restarts']}" + (" (gave up)" if u.get("gave_up") else ""))
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
    """`omnid status UNIT`: the NUMA placement omnid sets at spawn (omnid.numa), and what the
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
        from omnid.numa import kernel_placement

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
        if r.get("ipc_removed"):
            residue = (("" if residue == "none" else residue + "; ") + f"IPC: {len(r['ipc_removed'])} removed: "
                       + "; ".join(r["ipc_removed"]))
        rows.append((r["unit"], r["signal"], secs, "SIGKILL" if r["escalated"] else "no", gpu, residue))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row[:5])) + "  " + row[5])


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


def print_captures(captures: list[dict]) -> None:
    """`omnid dump`: each capture's text, oldest first, a rule between two."""
    for i, c in enumerate(captures):
        if i:
            print("-" * 72)
        print(c["text"], end="")


def print_gpu(gpu: dict | None) -> None:
    """Below `omnid status`: the GPU backend when it cannot be read, and each GPU condition
    (an Xid, memory health, a stuck read) with the units it reaches."""
    if not gpu or gpu.get("backend") in (None, "none"):
        return
    lines = []
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
