"""The figures. Each scenario function fills `bench.figures[KEY]`.

Timing sources (all CLOCK_MONOTONIC):
- launch / stop / kill instants: taken by the harness right before the syscall;
- "child running": the child's own start stamp (first thing in main());
- "child gone": its pidfd turning readable (the kernel's exit notification);
- "SIGTERM received": the child's own stamp, taken in its signal handler;
- supervisor notifications: time of receipt by the consumer (harness SUB
  socket for omnid / Circus, the event-listener process for supervisord);
- /health: time the first 503 answer was read (polled every 2 ms).
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .adapters import ADAPTERS, Adapter, Ctx, Program
from .common import (MS, Budget, Deadline, Janitor, alive, cpu_ns, log, open_pidfds,
                     summarize, wait_pidfds)


MIN_JITTER_S = 0.5


def jitter(period: float, lo: float = 0.2) -> None:
    """Sleep lo + U(0, period): the next trigger falls at a uniformly random
    phase of the supervisor's timer loop, so periodic supervisors are not
    measured at a lucky (or unlucky) fixed phase. Event-driven supervisors
    (period 0) still get U(0, 0.5 s) as a guard against a hidden timer."""
    time.sleep(lo + random.uniform(0.0, max(period, MIN_JITTER_S)))


class Bench:
    def __init__(self, *, sups: list[str], ctx: Ctx, rundir: Path, deadline: Deadline,
                 samples: int, quick: bool):
        self.sups = sups
        self.ctx = ctx
        self.rundir = rundir
        self.deadline = deadline
        self.samples = samples
        self.quick = quick
        self.janitor: Janitor = ctx.janitor
        self.figures: dict[str, dict] = {}
        self.notes: list[str] = []
        self.leftovers: list[dict] = []
        self._seq = 0

    # -- helpers -------------------------------------------------------------
    def new(self, sup: str, label: str) -> Adapter:
        self._seq += 1
        return ADAPTERS[sup](self.ctx, self.rundir / sup / f"{label}-{self._seq}")

    def finish(self, a: Adapter) -> None:
        """Tear down one run: stop watching, kill whatever is left, by pid."""
        a.close()
        left = self.janitor.sweep()
        if left:
            self.leftovers.append({"supervisor": a.name, "dir": str(a.dir), "pids": left})
            log(f"WARNING: could not kill {left} after {a.name} run")

    def figure(self, key: str, title: str, unit: str, kind: str = "latency", **extra) -> dict:
        fig = self.figures.setdefault(key, {"title": title, "unit": unit, "kind": kind,
                                            "results": {}, **extra})
        return fig["results"]

    def round_robin(self, label: str, cap_s: float, n_samples: int, fn) -> dict[str, list]:
        """Call fn(sup) n_samples times per supervisor, interleaved, within cap_s."""
        budget = Budget(cap_s, self.deadline)
        out: dict[str, list] = {s: [] for s in self.sups}
        for i in range(n_samples):
            for sup in self.sups:
                if budget.left() <= 0:
                    self.notes.append(f"{label}: time cap reached after {i} rounds")
                    log(f"{label}: time cap reached after {i} rounds")
                    return out
                try:
                    out[sup].append(fn(sup))
                except Exception as e:  # one broken run must not end the bench
                    log(f"{label}: {sup}: {e!r}")
                    out[sup].append({"error": repr(e)[:300], "err_ms": [], "term_ms": []})
        return out

    # -- 1 & 3a: start N, stop N ------------------------------------------
    def one_start_stop(self, sup: str, n: int, measure_stop: bool) -> dict:
        a = self.new(sup, f"start{n}")
        res: dict = {}
        try:
            a.write_config([Program("w", n)])
            t0 = a.launch()
            st = a.stamps.wait_starts(n, timeout=self.deadline.cap(90))
            if st is None:
                res["error"] = f"only {len(a.stamps.starts())}/{n} children started"
                return res
            res["start_ms"] = (max(st.values()) - t0) / MS
            res["first_ms"] = (min(st.values()) - t0) / MS
            if a.supports_health:
                h = a.wait_health(200, timeout=self.deadline.cap(30), interval=0.005)
                if h is not None:
                    res["ready_ms"] = (h - t0) / MS
            # cross-check with /proc: every stamped child is a live descendant
            kids = set(a.children())
            missing = set(st) - kids
            if missing:
                res["not_in_proc"] = len(missing)
            if not measure_stop:
                return res  # finish() kills it all
            a.settle()
            jitter(a.stop_tick_s)
            fds = open_pidfds(st.keys())
            own = open_pidfds(a.own_pids())
            ts = a.stop()
            gone = wait_pidfds(fds, timeout=self.deadline.cap(60))
            if len(gone) == len(fds):
                res["stop_ms"] = (max(gone.values()) - ts) / MS
            else:
                res["stop_error"] = f"{len(fds) - len(gone)} children still alive after 60 s"
            exited = wait_pidfds(own, timeout=self.deadline.cap(30))
            if own and len(exited) == len(own):
                res["exit_ms"] = (max(exited.values()) - ts) / MS
            terms = [v[0] for v in a.stamps.read()["t"].values() if v[0] >= ts]
            if terms:
                res["first_term_ms"] = (min(terms) - ts) / MS
            return res  # the supervisor's own exit is not waited for: finish() kills it
        finally:
            self.finish(a)

    def run_start(self, ns: list[int], caps: dict[int, float], stop_ns: set[int]) -> None:
        for n in ns:
            ms = n in stop_ns
            log(f"start{'/stop' if ms else ''} N={n}: {self.samples} samples per supervisor")
            runs = self.round_robin(f"start N={n}", caps[n], self.samples,
                                    lambda sup: self.one_start_stop(sup, n, ms))
            start = self.figure(f"start_{n}", f"start: launch -> all {n} children running", "ms")
            first = self.figure(f"first_{n}", f"start: launch -> first child running ({n} children)", "ms")
            stop = (self.figure(f"stop_{n}", f"stop: {n} children exiting on SIGTERM -> all gone", "ms")
                    if ms else {})
            term = (self.figure(f"stop_first_term_{n}", f"stop: {n} children, stop request -> first SIGTERM "
                                "received", "ms") if ms else {})
            exit_ = (self.figure(f"stop_exit_{n}", f"stop: {n} children, stop request -> the supervisor "
                                 "exited", "ms") if ms else {})
            ready = None
            for sup, rs in runs.items():
                start[sup] = summarize([r["start_ms"] for r in rs if "start_ms" in r], self.samples)
                first[sup] = summarize([r["first_ms"] for r in rs if "first_ms" in r], self.samples)
                if ms:
                    stop[sup] = summarize([r["stop_ms"] for r in rs if "stop_ms" in r], self.samples)
                    term[sup] = summarize([r["first_term_ms"] for r in rs if "first_term_ms" in r],
                                          self.samples)
                    exit_[sup] = summarize([r["exit_ms"] for r in rs if "exit_ms" in r], self.samples)
                errs = [r.get("error") or r.get("stop_error") for r in rs
                        if r.get("error") or r.get("stop_error")]
                if errs:
                    start[sup]["errors"] = errs[:5]
                nip = sum(1 for r in rs if r.get("not_in_proc"))
                if nip:
                    start[sup]["runs_with_children_missing_in_proc"] = nip
                rd = [r["ready_ms"] for r in rs if "ready_ms" in r]
                if rd:
                    ready = ready or self.figure(f"ready_{n}",
                                                 f"start: launch -> /health 200 ({n} children)", "ms",
                                                 only="omnid")
                    ready[sup] = summarize(rd, self.samples)

    # -- 2: death detection ---------------------------------------------------
    def run_death(self, cap_s: float) -> None:
        notify = self.figure("death_notify", "death: SIGKILL a child -> supervisor's own notification", "ms")
        replace = self.figure("death_replace", "death: SIGKILL a child -> replacement running", "ms")
        for sup in self.sups:
            log(f"death detection: {sup}")
            n_ms, r_ms, errs = self._death_loop(sup, Budget(cap_s, self.deadline))
            if ADAPTERS[sup].has_events:
                notify[sup] = summarize(n_ms, self.samples)
            replace[sup] = summarize(r_ms, self.samples)
            if errs:
                replace[sup]["errors"] = errs[:5]
        if "omnid" in self.sups:
            log("death detection: omnid /health")
            h_ms, e_ms, errs = self._omnid_health_loop(Budget(cap_s, self.deadline))
            fig = self.figure("death_health", "death: SIGKILL a child -> /health 503 (restart = no)", "ms",
                              only="omnid")
            fig["omnid"] = summarize(h_ms, self.samples)
            if errs:
                fig["omnid"]["errors"] = errs[:5]
            fig2 = self.figure("death_event_norestart",
                               "death: SIGKILL a child -> event (restart = no)", "ms", only="omnid")
            fig2["omnid"] = summarize(e_ms, self.samples)

    def _death_loop(self, sup: str, budget: Budget) -> tuple[list, list, list]:
        a = self.new(sup, "death")
        n_ms: list[float] = []
        r_ms: list[float] = []
        errs: list[str] = []
        try:
            a.write_config([Program("w", 1, restart=True)], events=True)
            watch = a.start_watch()
            t0 = a.launch()
            st = a.stamps.wait_starts(1, timeout=self.deadline.cap(30))
            if not st:
                return n_ms, r_ms, ["child never started"]
            a.settle()
            watch.connected.wait(timeout=10)
            time.sleep(1.0)  # let the subscription settle (ZeroMQ slow joiner)
            current = max(st, key=st.get)
            st_ns = st[current]
            while len(r_ms) < self.samples and budget.left() > 0:
                jitter(a.tick_s, lo=0.05)
                # runsv restarts a child that ran under 1 s only after 1 s (by design):
                # measure its restart path, not that pause.
                young = a.min_uptime_s - (time.monotonic_ns() - st_ns) / 1e9 if a.min_uptime_s else 0
                if young > 0:
                    time.sleep(young + 0.05)
                if not alive(current):
                    errs.append(f"child {current} not alive before kill")
                    break
                unit = a.unit_of(current)
                tk = a.kill_child(current)
                if a.has_events:
                    ev = watch.wait_for(a.death_pred(current, unit), tk, timeout=self.deadline.cap(15))
                    if ev is None:
                        errs.append(f"no notification for pid {current} within 15 s")
                    else:
                        n_ms.append((ev[0] - tk) / MS)
                new = a.stamps.wait_starts(1, timeout=self.deadline.cap(15), after_ns=tk)
                if not new:
                    errs.append(f"no replacement for pid {current} within 15 s")
                    break
                pid = min(new, key=new.get)
                r_ms.append((new[pid] - tk) / MS)
                current, st_ns = pid, new[pid]
            a.stop()
            a.wait_exit(timeout=self.deadline.cap(30))
            return n_ms, r_ms, errs
        finally:
            self.finish(a)

    def _omnid_health_loop(self, budget: Budget) -> tuple[list, list, list]:
        a = self.new("omnid", "health")
        h_ms: list[float] = []
        e_ms: list[float] = []
        errs: list[str] = []
        try:
            a.write_config([Program("w", 1, restart=False)], events=True)
            watch = a.start_watch()
            a.launch()
            st = a.stamps.wait_starts(1, timeout=self.deadline.cap(30))
            if not st:
                return h_ms, e_ms, ["child never started"]
            a.settle()
            time.sleep(1.0)
            current = max(st, key=st.get)
            while len(h_ms) < self.samples and budget.left() > 0:
                if a.wait_health(200, timeout=self.deadline.cap(15), interval=0.01) is None:
                    errs.append("/health never 200 before kill")
                    break
                jitter(a.tick_s, lo=0.05)
                unit = a.unit_of(current)
                tk = a.kill_child(current)
                h = a.wait_health(503, timeout=self.deadline.cap(10), interval=0.002)
                if h is None:
                    errs.append("/health not 503 within 10 s")
                else:
                    h_ms.append((h - tk) / MS)
                ev = watch.wait_for(a.death_pred(current, unit), tk, timeout=self.deadline.cap(10))
                if ev is not None:
                    e_ms.append((ev[0] - tk) / MS)
                r = a.cli("start", unit or "w", timeout=self.deadline.cap(30))
                if r.returncode != 0:
                    errs.append(f"omnid start {unit}: rc={r.returncode} {r.stderr.strip()[-300:]}")
                    break
                new = a.stamps.wait_starts(1, timeout=self.deadline.cap(15), after_ns=tk)
                if not new:
                    errs.append("no new child after `omnid start`")
                    break
                current = min(new, key=new.get)
            a.stop()
            a.wait_exit(timeout=self.deadline.cap(30))
            return h_ms, e_ms, errs
        finally:
            self.finish(a)

    # -- 3b: stop timeout ------------------------------------------------------
    def one_stop_timeout(self, sup: str, k: int) -> dict:
        a = self.new(sup, "stoptmo")
        res: dict = {"err_ms": [], "term_ms": []}
        try:
            a.write_config([Program("w", k, flags=["-i"], stop_timeout=1)])
            a.launch()
            st = a.stamps.wait_starts(k, timeout=self.deadline.cap(30))
            if not st:
                res["error"] = "children never started"
                return res
            a.settle()
            jitter(a.stop_tick_s)
            fds = open_pidfds(st.keys())
            ts = a.stop()
            gone = wait_pidfds(fds, timeout=self.deadline.cap(30))
            term = a.stamps.read()["t"]
            for pid in st:
                if pid not in gone:
                    res.setdefault("not_killed", 0)
                    res["not_killed"] += 1
                elif pid not in term:
                    res.setdefault("no_sigterm", 0)
                    res["no_sigterm"] += 1
                else:
                    res["err_ms"].append((gone[pid] - term[pid][0]) / MS - 1000.0)
                    res["term_ms"].append((term[pid][0] - ts) / MS)
            a.wait_exit(timeout=self.deadline.cap(30))
            return res
        finally:
            self.finish(a)

    def run_stop_timeout(self, cap_s: float, k: int = 3) -> None:
        runs_needed = -(-self.samples // k)
        log(f"stop timeout: {runs_needed} runs x {k} children ignoring SIGTERM per supervisor")
        runs = self.round_robin("stop timeout", cap_s, runs_needed,
                                lambda sup: self.one_stop_timeout(sup, k))
        fig = self.figure("stop_kill_error",
                          "stop: children ignoring SIGTERM, stop timeout 1 s -> SIGKILL (error vs 1 s)", "ms")
        fig2 = self.figure("stop_term_delivery", "stop: stop request -> SIGTERM received by child", "ms")
        for sup, rs in runs.items():
            fig[sup] = summarize([x for r in rs for x in r["err_ms"]], runs_needed * k)
            fig2[sup] = summarize([x for r in rs for x in r["term_ms"]], runs_needed * k)
            for key in ("not_killed", "no_sigterm"):
                v = sum(r.get(key, 0) for r in rs)
                if v:
                    fig[sup][key] = v
            errs = [r["error"] for r in rs if "error" in r]
            if errs:
                fig[sup]["errors"] = errs[:5]

    # -- 4: residue -------------------------------------------------------------
    def one_residue_setsid(self, sup: str, n: int) -> dict:
        a = self.new(sup, "residue-setsid")
        try:
            a.write_config([Program("w", n, flags=["-g"], stop_timeout=2, group_kill=True)])
            a.launch()
            st = a.stamps.wait_starts(n, timeout=self.deadline.cap(30))
            end = time.monotonic() + 10
            while time.monotonic() < end and len(a.stamps.read()["g"]) < n:
                time.sleep(0.02)
            g = list(a.stamps.read()["g"])
            if not st or len(g) < n:
                return {"error": f"{len(st or {})} children, {len(g)} grandchildren started"}
            a.settle()
            time.sleep(0.3)
            a.stop()
            rc = a.wait_exit(timeout=self.deadline.cap(30))
            time.sleep(1.0)
            return {"children": n, "grandchildren": n,
                    "children_left": sum(1 for p in st if alive(p)),
                    "grandchildren_left": sum(1 for p in g if alive(p)),
                    "supervisor_exited": rc is not None}
        finally:
            self.finish(a)

    def one_residue_kill(self, sup: str, n: int) -> dict:
        a = self.new(sup, "residue-kill")
        try:
            a.write_config([Program("w", n, group_kill=True)])
            a.launch()
            st = a.stamps.wait_starts(n, timeout=self.deadline.cap(30))
            if not st:
                return {"error": "children never started"}
            a.settle()
            time.sleep(0.3)
            helpers = [p for p in a.supervisor_pids() if p != a.proc.pid]
            a.kill_supervisor()
            a.wait_exit(timeout=10)
            time.sleep(1.0)
            return {"children": n, "children_left": sum(1 for p in st if alive(p)),
                    "helpers": len(helpers), "helpers_left": sum(1 for p in helpers if alive(p))}
        finally:
            self.finish(a)

    def run_residue(self, runs: int = 1, n: int = 4) -> None:
        fig = self.figure("residue_setsid",
                          f"residue: {n} children each with a double-forked setsid grandchild -> "
                          "survivors after stop (children + grandchildren)", "processes", kind="count")
        fig2 = self.figure("residue_sigkill",
                           f"residue: SIGKILL the supervisor ({n} children) -> surviving children "
                           "(+ helper processes)", "processes", kind="count")
        for sup in self.sups:
            log(f"residue: {sup}")
            rs = [self.one_residue_setsid(sup, n) for _ in range(runs) if self.deadline.left() > 20]
            ok = [r for r in rs if "error" not in r]
            fig[sup] = {
                "value": max((r["children_left"] + r["grandchildren_left"] for r in ok), default=None),
                "children_left": max((r["children_left"] for r in ok), default=None),
                "grandchildren_left": max((r["grandchildren_left"] for r in ok), default=None),
                "of": 2 * n, "runs": rs,
            }
            rs = [self.one_residue_kill(sup, n) for _ in range(runs) if self.deadline.left() > 20]
            ok = [r for r in rs if "error" not in r]
            fig2[sup] = {
                "value": max((r["children_left"] for r in ok), default=None),
                "helpers_left": max((r["helpers_left"] for r in ok), default=None),
                "of": n, "runs": rs,
            }

    # -- 5 & 6: idle cost, omnid load -------------------------------------------
    def run_idle(self, n: int, idle_s: float, load_s: float) -> None:
        """All supervisors side by side, each with its own n children, measured
        over the same idle window (an idle supervisor does not compete for the
        CPU, and this saves two windows); then omnid alone under load."""
        cpu = self.figure("idle_cpu", f"idle cost: CPU of the supervisor's processes, {n} children, "
                          f"{idle_s:g} s", "% of one core", kind="value")
        rss = self.figure("idle_rss", f"idle cost: RSS of the supervisor's processes, {n} children",
                          "MiB", kind="value")
        # RSS counts shared pages once per process: runit's 256 runsv share their text.
        pss_fig = self.figure("idle_pss", f"idle cost: PSS of the supervisor's processes, {n} children",
                              "MiB", kind="value")
        log(f"idle cost: {', '.join(self.sups)} side by side ({n} children each, {idle_s:g} s)")
        ads: dict[str, Adapter] = {}
        try:
            for sup in self.sups:
                a = ads[sup] = self.new(sup, "idle")
                a.write_config([Program("w", n)])
                a.launch()
            procs: dict[str, list[psutil.Process]] = {}
            for sup, a in ads.items():
                if not a.stamps.wait_starts(n, timeout=self.deadline.cap(120)):
                    cpu[sup] = {"value": None, "error": "children never started"}
                    continue
                a.settle()
            time.sleep(3.0)
            for sup, a in ads.items():
                if sup in cpu:
                    continue
                procs[sup] = []
                for pid in a.supervisor_pids():
                    try:
                        procs[sup].append(psutil.Process(pid))
                    except psutil.Error:
                        pass

            def cpu_s(ps) -> float:
                return sum(cpu_ns(p.pid) for p in ps) / 1e9

            def rss_mib(ps) -> float:
                tot = 0
                for p in ps:
                    try:
                        tot += p.memory_info().rss
                    except psutil.Error:
                        pass
                return tot / 2**20

            c0 = {s: cpu_s(ps) for s, ps in procs.items()}
            w0 = time.monotonic()
            rs: dict[str, list[float]] = {s: [] for s in procs}
            end = w0 + idle_s
            while time.monotonic() < end:
                for s, ps in procs.items():
                    rs[s].append(rss_mib(ps))
                time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            c1 = {s: cpu_s(ps) for s, ps in procs.items()}
            w1 = time.monotonic()
            for s, ps in procs.items():
                rs[s].append(rss_mib(ps))
                names, pss = [], 0.0
                for p in ps:
                    try:
                        names.append(" ".join(p.cmdline()[:2])[:80])
                        pss += p.memory_full_info().pss / 2**20
                    except (psutil.Error, AttributeError):
                        pass
                cpu[s] = {"value": 100.0 * (c1[s] - c0[s]) / (w1 - w0), "cpu_s": c1[s] - c0[s],
                          "wall_s": w1 - w0, "processes": names}
                rss[s] = {"value": max(rs[s]), "mean": sum(rs[s]) / len(rs[s]), "pss_mib": pss,
                          "processes": len(ps)}
                pss_fig[s] = {"value": pss, "processes": len(ps)}
            # omnid's load figures with the peers gone
            for sup, a in ads.items():
                if sup != "omnid":
                    a.stop()
            for sup, a in ads.items():
                if sup != "omnid":
                    a.wait_exit(timeout=self.deadline.cap(60))
            if "omnid" in procs and load_s > 0:
                self._omnid_load(ads["omnid"], load_s, n)
        finally:
            for a in ads.values():
                a.close()
            for a in ads.values():
                self.finish(a)

    def _loadgen(self, args: list[str], timeout: float) -> dict:
        p = self.janitor.spawn([sys.executable, "-m", "bench.loadgen", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=str(Path(__file__).resolve().parent.parent))
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return {"error": "load generator timed out"}
        try:
            return json.loads(out)
        except ValueError:
            return {"error": f"load generator failed: {err.decode()[-500:]}"}

    def _omnid_load(self, a, load_s: float, n: int) -> None:
        log(f"omnid load: control status and /health ({load_s:g} s each)")
        ctl = self.figure("control_status", f"omnid: control-socket `status` ({n} units)", "req/s",
                          kind="load", only="omnid")
        hl = self.figure("health_load", "omnid: GET /health under load (local HTTP load generator)",
                         "req/s", kind="load", only="omnid")
        ep = f"ipc://{a.control}"
        t = load_s + 30
        ctl["omnid"] = {
            "inflight_1": self._loadgen(["zmq", "--endpoint", ep, "--inflight", "1",
                                         "--duration", str(load_s)], self.deadline.cap(t)),
            "inflight_8": self._loadgen(["zmq", "--endpoint", ep, "--inflight", "8",
                                         "--duration", str(load_s)], self.deadline.cap(t)),
        }
        hl["omnid"] = {
            "conns_1": self._loadgen(["http", "--port", str(a.port), "--conns", "1",
                                      "--duration", str(load_s)], self.deadline.cap(t)),
            "conns_16": self._loadgen(["http", "--port", str(a.port), "--conns", "16",
                                       "--duration", str(load_s)], self.deadline.cap(t)),
        }
