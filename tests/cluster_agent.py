"""A stand-in for one host's omnid in the tests of omnid.cluster: it runs a ClusterSession and
one ClusterGroup in its host's namespace, starts `--local` member processes per generation
(each with the rank environment, so a test can read RANK from /proc/PID/environ), SIGKILLs
them the moment the generation goes down, and joins the next one.

Commands, one JSON object per line on stdin: {"cmd": "fail", "index": 1} (SIGKILL that member
and report it), {"cmd": "stop"} / {"cmd": "start"} (an operator stop and start of the group
here), {"cmd": "status"}, {"cmd": "quit"}. Events, one JSON object per line on stdout, with
wall-clock times: open, running, down, refused, status.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import structlog

from omnid.cluster.group import ClusterGroup, GroupDown, GroupRefused
from omnid.cluster.session import ClusterRefused, ClusterSession
from omnid.model.cluster import ClusterSettings, Endpoint

# A member: dies with the agent (PR_SET_PDEATHSIG = 1, SIGKILL), then sleeps.
MEMBER = ("import ctypes, os, sys, time\n"
          "ctypes.CDLL(None).prctl(1, 9)\n"
          "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
          "time.sleep(1e6)\n")


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        host, port = args.etcd.rsplit("//", 1)[1].rsplit(":", 1)
        self.settings = ClusterSettings(endpoints=(Endpoint(host, int(port)),), tls=args.etcd.startswith("https:"),
                                        host=args.host, address=args.address, lease_ttl=args.ttl, prefix=args.prefix,
                                        peer_port=args.peer_port, ca=args.ca, cert=args.cert, key=args.key)
        self.args = args
        self.members: list[subprocess.Popen] = []
        self.gen = None
        self.down = asyncio.Event()
        self.running = asyncio.Event()  # wanted: run the group here
        self.running.set()
        self.quit = False

    def on_down(self, d: GroupDown) -> None:
        got = time.time()
        pids = self.kill_members()
        emit(ev="down", gen=d.generation, reason=d.reason, fenced=d.fenced, t=got, stopped=time.time(), pids=pids,
             kill_by_in_s=None if d.kill_by is None else round(d.kill_by - time.monotonic(), 3))
        self.down.set()

    def kill_members(self) -> list[int]:
        pids = [m.pid for m in self.members]
        for m in self.members:
            if m.poll() is None:
                m.send_signal(signal.SIGKILL)
        for m in self.members:
            m.wait()
        self.members = []
        return pids

    def dump_tasks(self) -> None:
        """SIGUSR1: every asyncio task's stack on stderr (to see what a stuck agent waits for)."""
        for task in asyncio.all_tasks():
            coro = task.get_coro()
            frames = []
            while coro is not None and hasattr(coro, "cr_frame"):
                if coro.cr_frame is not None:
                    frames.append(f"{coro.cr_code.co_filename.rsplit('/', 2)[-1]}:{coro.cr_frame.f_lineno} {coro.cr_code.co_name}")
                coro = coro.cr_await
            print("task:", " -> ".join(frames) or repr(task), file=sys.stderr, flush=True)

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                self.quit = True
                self.down.set()
                self.running.set()
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "fail" and self.gen is not None and self.members:
                victim = self.members[cmd.get("index", 0)]
                t = time.time()
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                self.group.member_failed(self.gen.number, f"ranks@{cmd.get('index', 0)}", "killed by SIGKILL")
                emit(ev="failed", gen=self.gen.number, t=t, pid=victim.pid)
                self.kill_members()
                self.down.set()
            elif cmd["cmd"] == "stop":
                self.running.clear()
                self.down.set()
            elif cmd["cmd"] == "start":
                self.running.set()
            elif cmd["cmd"] == "status":
                emit(ev="status", group=self.group.status(), session=self.session.status(), t=time.time())
            elif cmd["cmd"] == "quit":
                self.quit = True
                self.running.set()
                self.down.set()

    async def main(self) -> int:
        self.session = ClusterSession(self.settings)
        self.group = ClusterGroup(self.session, self.args.group, tuple(self.args.hosts.split(",")), self.args.local,
                                  self.on_down)
        try:
            await self.session.open()
        except ClusterRefused as exc:
            emit(ev="refused", reason=str(exc))
            return 2
        emit(ev="open", t=time.time())
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.dump_tasks)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        reader = asyncio.get_running_loop().create_task(self.commands())
        try:
            while not self.quit:
                await self.running.wait()
                if self.quit:
                    break
                try:
                    join = asyncio.get_running_loop().create_task(self.group.join())
                    quit_wait = asyncio.get_running_loop().create_task(self.down.wait())
                    self.down.clear()
                    done, _ = await asyncio.wait({join, quit_wait}, return_when=asyncio.FIRST_COMPLETED)
                    quit_wait.cancel()
                    if join not in done:
                        join.cancel()
                        try:
                            await join
                        except asyncio.CancelledError:
                            pass
                        continue
                    self.gen = join.result()
                except (GroupRefused, ClusterRefused) as exc:
                    emit(ev="refused", reason=str(exc), t=time.time())
                    self.running.clear()
                    continue
                self.down.clear()
                for i in range(self.gen.local_size):
                    env = dict(os.environ, **self.gen.rank_env(i))
                    self.members.append(subprocess.Popen([sys.executable, "-c", MEMBER, str(os.getpid())], env=env))
                emit(ev="running", gen=self.gen.number, pids=[m.pid for m in self.members], t=time.time(),
                     env=[self.gen.rank_env(i) for i in range(self.gen.local_size)])
                await self.down.wait()
                self.kill_members()
                self.group.left(self.gen.number, "stopped by the operator" if not self.running.is_set() else
                                "its members were stopped")
                self.gen = None
        finally:
            self.kill_members()
            reader.cancel()
            await self.session.close()
            emit(ev="closed", t=time.time())
        return 0


def main() -> int:
    p = argparse.ArgumentParser()
    for flag in ("--host", "--address", "--etcd", "--prefix", "--group", "--hosts"):
        p.add_argument(flag, required=True)
    p.add_argument("--ttl", type=int, default=3)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--peer-port", type=int, default=9322)
    for flag in ("--ca", "--cert", "--key"):
        p.add_argument(flag, type=Path, default=None)
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    return asyncio.run(Agent(args).main())


if __name__ == "__main__":
    sys.exit(main())
