"""Hosts made of network namespaces, for the tests of a stack across hosts.

    om<id>-sw     a "switch": two bridges, `peers` (10.231.1.0/24) and `etcdnet` (10.231.2.0/24)
    om<id>-etcd   etcd (Debian's etcd-server) on 10.231.2.1:2379, its data in /dev/shm
    om<id>-<h>    host h: eth0 on the peer network (10.231.1.10+i, its `address`) and
                  eth1 on the etcd network (10.231.2.10+i)

Cutting a host off detaches its switch ports from their bridge ("nomaster"): its packets are
then dropped in silence, as in a real partition (no RST, no ICMP), while its own links stay
up. There is no sch_netem here (delay/loss): `Testbed.netem_available()` says so.

Everything made is removed by `close()` (deleting a namespace takes its veths and bridges
with it), also when the test failed; `testbed` skips with the reason only where namespaces
or etcd cannot exist (not root, no iproute2, no etcd).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from tests.harness import Daemon, wait_for

PEER_NET = "10.231.1"
ETCD_NET = "10.231.2"
ETCD_ADDR = f"{ETCD_NET}.1"
ETCD_PORT = 2379


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def unavailable() -> str | None:
    """Why namespaces or etcd cannot exist here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        return "etcd and etcdctl are not installed (Debian: apt-get install etcd-server etcd-client)"
    probe = f"omprobe-{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Testbed:
    __test__ = False  # not a test class: pytest must not collect it

    def __init__(self, hosts: list[str]) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.hosts = list(hosts)
        self.ns = {h: f"om{self.id}-{h}" for h in hosts}
        self.switch = f"om{self.id}-sw"
        self.etcd_ns = f"om{self.id}-etcd"
        self.address = {h: f"{PEER_NET}.{10 + i}" for i, h in enumerate(hosts)}
        self.etcd_url = f"http://{ETCD_ADDR}:{ETCD_PORT}"
        self.workdir = Path(tempfile.mkdtemp(prefix="omnet-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.etcd: subprocess.Popen | None = None
        self._etcd_log = None
        self._made: list[str] = []

    # -- life -----------------------------------------------------------------------------
    def open(self) -> "Testbed":
        try:
            for ns in (self.switch, self.etcd_ns, *self.ns.values()):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for br in ("peers", "etcdnet"):
                _ip("-n", self.switch, "link", "add", br, "type", "bridge")
                _ip("-n", self.switch, "link", "set", br, "up")
            self._plug(self.etcd_ns, "eth0", "etcd", "etcdnet", f"{ETCD_ADDR}/24")
            for i, h in enumerate(self.hosts):
                self._plug(self.ns[h], "eth0", f"p-{h}", "peers", f"{self.address[h]}/24")
                self._plug(self.ns[h], "eth1", f"e-{h}", "etcdnet", f"{ETCD_NET}.{10 + i}/24")
            self.start_etcd()
        except BaseException:
            self.close()
            raise
        return self

    def _plug(self, ns: str, inside: str, port: str, bridge: str, cidr: str) -> None:
        _ip("link", "add", inside, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", bridge)
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", cidr, "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")

    def close(self) -> None:
        """Remove everything made. A namespace whose mount is still busy (a process of it
        exiting) is tried again for a few seconds; one that cannot be removed fails loudly."""
        try:
            self.kill_etcd()
        finally:
            left = list(reversed(self._made))
            deadline = time.monotonic() + 15
            while left:
                left = [ns for ns in left if _ip("netns", "del", ns, check=False).returncode != 0
                        and ns in _ip("netns", "list", check=False).stdout.split()]
                if not left or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            self._made.clear()
            shutil.rmtree(self.workdir, ignore_errors=True)
            if left:
                raise RuntimeError(f"network namespaces could not be removed: {left}")

    def __enter__(self) -> "Testbed":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things in a host ------------------------------------------------------------
    def popen(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """`argv` inside host's namespace (ip netns exec execs it: the pid is the program's)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], **kw)

    # -- etcd ----------------------------------------------------------------------------------
    def start_etcd(self) -> None:
        data = self.workdir / "etcd"
        self._etcd_log = open(self.workdir / "etcd.log", "ab")
        start = self._etcd_log.tell()
        # etcd at the daemons' priority (unset daemon_nice: 10 steps ahead, -10 here): on a real
        # cluster it has machines of its own; here it shares two cores with a parallel suite,
        # and a keepalive it answers late fences a host as surely as a partition.
        self.etcd = subprocess.Popen(
            ["ip", "netns", "exec", self.etcd_ns, "nice", "-n", "-10", "etcd", "--name", "e", "--data-dir", str(data),
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
             "--initial-cluster", "e=http://127.0.0.1:2380", "--log-level", "warn", "--logger", "zap",
             *self._etcd_tls_flags()],
            stdin=subprocess.DEVNULL, stdout=self._etcd_log, stderr=self._etcd_log)
        # "ready to serve client requests" is logged at info; ask for health instead.
        wait_for(lambda: self.etcd.poll() is not None or self._etcd_healthy(), 30,
                 f"etcd to serve (log: {self.etcd_log(start)[-2000:]})", interval=0.1)
        if self.etcd.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.etcd.returncode}: {self.etcd_log(start)[-2000:]}")

    def _etcd_tls_flags(self) -> list[str]:
        t = getattr(self, "_tls", None)
        if not t:
            return []
        return ["--cert-file", str(t["server_cert"]), "--key-file", str(t["server_key"]), "--client-cert-auth",
                "--trusted-ca-file", str(t["ca"])]

    def _etcdctl_tls(self) -> list[str]:
        t = getattr(self, "_tls", None)
        return ["--cacert", str(t["ca"]), "--cert", str(t["cert"]), "--key", str(t["key"])] if t else []

    def _etcd_healthy(self) -> bool:
        r = subprocess.run(["ip", "netns", "exec", self.etcd_ns, "etcdctl", "--endpoints", self.etcd_url,
                            *self._etcdctl_tls(), "--command-timeout=1s", "endpoint", "health"],
                           capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"), timeout=10)
        return r.returncode == 0

    def etcdctl(self, *args: str, stdin: bytes | None = None) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.etcd_ns, "etcdctl", "--endpoints", self.etcd_url,
                            *self._etcdctl_tls(), *args],
                           capture_output=True, input=stdin, env=dict(os.environ, ETCDCTL_API="3"), timeout=20)
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
        return r.stdout.decode(errors="replace")

    def etcd_log(self, start: int = 0) -> str:
        try:
            return (self.workdir / "etcd.log").read_bytes()[start:].decode(errors="replace")
        except OSError:
            return ""

    def make_tls(self) -> dict[str, Path]:
        """A CA, a server certificate for the etcd address and a client certificate (openssl)."""
        d = self.workdir / "tls"
        d.mkdir(exist_ok=True)
        def run(*args: str) -> None:
            r = subprocess.run(["openssl", *args], capture_output=True, text=True, cwd=d, timeout=60)
            if r.returncode != 0:
                raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr.strip()}")
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=omnid-test-ca")
        (d / "ext").write_text(f"subjectAltName=IP:{ETCD_ADDR}\nextendedKeyUsage=serverAuth,clientAuth\n")
        for name in ("server", "client"):
            run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", "ext")
        for f in d.iterdir():
            os.chmod(f, 0o600)
        return {"ca": d / "ca.pem", "cert": d / "client.pem", "key": d / "client.key",
                "server_cert": d / "server.pem", "server_key": d / "server.key"}

    def restart_etcd_with_tls(self, tls: dict[str, Path]) -> None:
        """etcd again, on https:// with client certificates required."""
        self.kill_etcd()
        self.etcd_url = f"https://{ETCD_ADDR}:{ETCD_PORT}"
        self._tls = tls
        self.start_etcd()

    def kill_etcd(self) -> None:
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.send_signal(signal.SIGKILL)
        if self.etcd is not None:
            self.etcd.wait(10)
        self.etcd = None
        if self._etcd_log is not None:
            self._etcd_log.close()
            self._etcd_log = None

    # -- faults --------------------------------------------------------------------------------
    def cut(self, host: str, *, peers: bool = True, etcd: bool = True) -> float:
        """Silently drop host's traffic on the peer network and/or the etcd network; when."""
        for net, port in ((peers, f"p-{host}"), (etcd, f"e-{host}")):
            if net:
                _ip("-n", self.switch, "link", "set", port, "nomaster")
        return time.time()

    def heal(self, host: str) -> float:
        for port, bridge in ((f"p-{host}", "peers"), (f"e-{host}", "etcdnet")):
            _ip("-n", self.switch, "link", "set", port, "master", bridge)
        return time.time()

    def netem_available(self) -> bool:
        """Can this kernel delay and drop packets (sch_netem)? Tried inside the switch namespace."""
        if shutil.which("tc") is None:
            return False
        r = subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True, text=True)
        return r.returncode == 0


class HostAgent:
    """tests/cluster_agent.py running in one host's namespace; its events collected by a thread."""

    def __init__(self, bed: Testbed, host: str, *, hosts: list[str], local: int = 2, ttl: int = 3,
                 group: str = "tp", prefix: str | None = None, tls: dict[str, Path] | None = None,
                 peer_port: int = 9322) -> None:
        import sys
        import threading

        from tests.harness import REPO, repo_pythonpath

        self.bed, self.host = bed, host
        self.prefix = prefix or f"/omnid/t{bed.id}"
        self.events: list[dict] = []
        self.stderr_path = bed.workdir / f"agent-{host}-{uuid.uuid4().hex[:4]}.log"
        self._err = open(self.stderr_path, "wb")
        self.proc = bed.popen(host, [sys.executable, "-m", "tests.cluster_agent", "--host", host,
                                     "--address", bed.address[host], "--etcd", bed.etcd_url, "--prefix", self.prefix,
                                     "--group", group, "--hosts", ",".join(hosts), "--local", str(local),
                                     "--ttl", str(ttl), "--peer-port", str(peer_port),
                                     *[f"--{k}={tls[k]}" for k in ("ca", "cert", "key") if tls and k in tls]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, cwd=str(REPO),
                              env=dict(os.environ, PYTHONPATH=repo_pythonpath(), PYTHONUNBUFFERED="1"))
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import json

        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(ev)

    def send(self, **cmd) -> None:
        import json

        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def log(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-12000:]
        except OSError:
            return ""

    def find(self, ev: str, **match) -> list[dict]:
        with self._lock:
            return [e for e in self.events if e.get("ev") == ev and all(e.get(k) == v for k, v in match.items())]

    def wait(self, ev: str, timeout: float, **match) -> dict:
        return wait_for(lambda: (f := self.find(ev, **match)) and f[-1], timeout,
                        lambda: f"{self.host}: event {ev} {match or ''} (events {self.events[-6:]}; log:\n"
                                f"{self.log_with_stacks()})")

    def log_with_stacks(self) -> str:
        """The log, after the agent wrote where each of its threads and asyncio tasks stands (SIGUSR2
        reaches the threads even when its event loop is blocked; SIGUSR1 lists the tasks)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR2)
            self.proc.send_signal(signal.SIGUSR1)
            try:
                wait_for(lambda: "task:" in self.log(), 3, "")
            except AssertionError:
                pass
        return self.log()

    def status(self, timeout: float = 10) -> dict:
        n = len(self.find("status"))
        self.send(cmd="status")
        wait_for(lambda: len(self.find("status")) > n, timeout, f"{self.host}: status")
        return self.find("status")[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self._reader.join(10)
        self.proc.stdout.close()
        self._err.close()


# ------------------------------------------------------------------ real omnid daemons per host


class HostDaemon(Daemon):
    """An omnid daemon inside one host's namespace (its control socket is a file: reachable)."""

    def __init__(self, bed: Testbed, host: str, units_dir: Path) -> None:
        # At the default priority (10 steps ahead: -10), as on a real host: a keepalive answered late
        # fences a host, and these daemons share two cores with a parallel suite.
        super().__init__(units_dir, env={"OMNID_DAEMON_NICE": ""})
        self.bed, self.host = bed, host

    def argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.bed.ns[self.host], *super().argv()]

    def health(self) -> tuple[int, dict]:
        """GET /health from inside the host's namespace (where the daemon listens)."""
        import json
        import sys

        code = ("import json, sys, urllib.request, urllib.error\n"
                "try:\n"
                f"    r = urllib.request.urlopen('http://127.0.0.1:{self.health_port}/health', timeout=5)\n"
                "    print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n"
                "    print(e.code); print(e.read().decode())\n")
        out = subprocess.run(["ip", "netns", "exec", self.bed.ns[self.host], sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=20).stdout.split("\n", 1)
        return int(out[0]), json.loads(out[1])

    def _health_served(self) -> bool:
        """As Daemon's, asked from inside the host's namespace (where the daemon listens)."""
        try:
            self.health()
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return False
        return True


def ranks_stack(bed: Testbed, host: str, hosts: list[str], progress: Path, port: int, *, ttl: int = 3,
                restart: str = "on-failure", exit_when_failed: bool = False, local: int = 2,
                restart_max_sec: float = 60) -> Path:
    """host's stack: `local` torch gloo ranks (omnid/demo/ranks.py) of group tp across `hosts`."""
    import json

    from tests.harness import make_stack

    unit = "\n".join([
        'exec = ["python3", "-m", "omnid.demo.ranks"]',
        f"instances = {local}",
        'ready = "notify"',
        "ready_timeout = 90",
        "stop_timeout = 2",
        f'restart = "{restart}"',
        "restart_sec = 0.2",
        f"restart_max_sec = {restart_max_sec}",
        "start_limit_burst = 1000",
        'worker_group = "tp"',
        f"group_hosts = {json.dumps(hosts)}",
        f"torch_distributed = {{ master_port = {port} }}",
        # gloo picks its address from the host name; in a namespace it must be told the interface.
        f'env = {{ OMNID_RANKS_PROGRESS_DIR = "{progress}", OMNID_RANKS_TIMEOUT_S = "120", '
        'GLOO_SOCKET_IFNAME = "eth0" }',
    ])
    settings = (("exit_when_failed = true\n" if exit_when_failed else "")
                + f'[cluster]\netcd = ["{bed.etcd_url}"]\nhost = "{host}"\naddress = "{bed.address[host]}"\n'
                f'lease_ttl = {ttl}\nprefix = "/omnid/e2e{bed.id}"\n')
    return make_stack({"ranks": unit + "\n"}, settings)
