"""Issue #28, operators' habits: the `omnid` command behaves as systemctl, journalctl and
kubectl do -- a closed pipe ends it quietly, `restart` says what else restarts, RESTARTS
means one thing everywhere, `start` neither attaches to another stack nor pretends it
started a running one, `check DIR`, logs as text wherever they go, where state goes, and
what "nothing to show" exits with.

Real daemons and real children throughout (sleep, a short Python program); nothing mocked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omnid.model import settings
from tests.harness import REPO, free_port, make_stack, repo_pythonpath, wait_for

PY = sys.executable
PROGRESS = re.compile(r"^\s+\[\s*\d+\.\d+s\] ", re.M)  # one `omnid start` progress line


def omnid(*args: str, timeout: float = 90, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=repo_pythonpath())
    return subprocess.run([PY, "-m", "omnid", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(REPO), **kw)


def into_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """Run omnid with stdout a pipe whose reader is gone already (`| head -1` that exited):
    every write meets EPIPE, deterministically."""
    r, w = os.pipe()
    os.close(r)
    try:
        env = dict(os.environ, PYTHONPATH=repo_pythonpath())
        return subprocess.run([PY, "-m", "omnid", *args], stdout=w, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=env, cwd=str(REPO))
    finally:
        os.close(w)


def sleeper(extra: str = "") -> str:
    return 'exec = ["sleep", "1000"]\n' + extra


def group_stack() -> Path:
    """worker@0..1 (one worker group) <- engine <- serve, as in the issue's report."""
    return make_stack({
        "worker": sleeper('instances = 2\nworker_group = "tp"\nrestart = "on-failure"\nrestart_sec = 0.1\n'),
        "engine": sleeper('requires = ["worker"]\n'),
        "serve": sleeper('requires = ["engine"]\n'),
    })


# ----------------------------------------------------------------------------- 1. closed pipe
def test_output_into_a_closed_pipe_ends_quietly_with_the_sigpipe_status(daemon_factory):
    d = daemon_factory(make_stack({f"u{i}": sleeper() for i in range(3)}))
    d.wait_all_active()
    for args in (["status", "--json"], ["status", "u0"], ["status"], ["logs", "u0", "--json"], ["check", str(d.units_dir)]):
        argv = ["--control", d.control, *args] if args[0] != "check" else args
        r = into_closed_pipe(*argv)
        assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr and "Broken pipe" not in r.stderr, \
            (args, r.stderr)
        # 141 = 128 + SIGPIPE: what a shell reports for cat or grep in the same place.
        assert r.returncode in (0, 128 + signal.SIGPIPE), (args, r.returncode, r.stderr)
    assert into_closed_pipe("--control", d.control, "status", "--json").returncode == 128 + signal.SIGPIPE


# ----------------------------------------------------------------------------- 2 + 3. restart
def _metric(text: str, name: str, unit: str) -> float:
    m = re.search(rf'^{name}{{unit="{re.escape(unit)}"}} (\S+)$', text, re.M)
    assert m, (name, unit, text[:3000])
    return float(m.group(1))


def test_restart_lists_what_else_restarts_and_why_before_it_acts(daemon_factory):
    d = daemon_factory(group_stack())
    before = d.wait_all_active()
    r = omnid("--control", d.control, "restart", "worker@0", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert d.units() == before or all(d.units()[n]["pid"] == before[n]["pid"] for n in before)  # dry: nothing moved
    plan = r.stdout
    assert plan.splitlines()[0] == "restarting worker@0, and 3 more units with it:", plan
    assert re.search(r"^  worker@1 +worker group tp", plan, re.M), plan
    assert re.search(r"^  engine +requires worker", plan, re.M), plan
    assert re.search(r"^  serve +requires engine", plan, re.M), plan
    assert plan.index("engine") < plan.index("serve"), plan

    r = omnid("--control", d.control, "restart", "worker@0")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # The listing comes before the table of the result (it was printed before the restart).
    assert out.index("worker group tp") < out.index("UNIT "), out
    after = d.units()
    for n in before:  # every one of them did restart: new processes
        assert after[n]["pid"] != before[n]["pid"] and after[n]["state"] == "active", (n, after[n])


def test_restarts_counts_automatic_restarts_only_the_same_in_status_json_and_metrics(daemon_factory):
    d = daemon_factory(group_stack())
    before = d.wait_all_active()
    d.ok("restart", {"units": ["worker@0"], "timeout": 60}, timeout=70)  # as `omnid restart worker@0`
    after = d.units()
    assert all(after[n]["pid"] != before[n]["pid"] for n in before), after
    # 3. RESTARTS: automatic restarts only. A requested restart counts nowhere ...
    _, text = d.http("/metrics")
    for n, u in after.items():
        assert u["restarts"] == 0, (n, u)
        assert _metric(text, "omnid_unit_restarts_total", n) == 0, n
    st = json.loads(omnid("--control", d.control, "status", "--json").stdout)
    assert {u["name"]: u["restarts"] for u in st["units"]} == dict.fromkeys(before, 0)
    table = omnid("--control", d.control, "status").stdout.splitlines()
    head = next(i for i, ln in enumerate(table) if ln.startswith("TIER"))
    col = table[head].index("RESTARTS")
    rows = table[head + 1:head + 1 + len(before)]
    assert len(rows) == 4 and all(ln[col] == "0" for ln in rows), table

    # ... an automatic one counts on the member that failed and on its group's other member,
    # the same in status, status --json and /metrics.
    os.kill(after["worker@0"]["pid"], signal.SIGKILL)
    wait_for(lambda: all(u["state"] == "active" and u["pid"] != after[n]["pid"] for n, u in d.units().items()),
             30, "the stack back after worker@0's death")
    now = d.units()
    assert now["worker@0"]["restarts"] == 1 and now["worker@1"]["restarts"] == 1, now
    assert now["engine"]["restarts"] == 0 and now["serve"]["restarts"] == 0, now  # their requirement failed
    _, text = d.http("/metrics")
    for n, u in now.items():
        assert _metric(text, "omnid_unit_restarts_total", n) == u["restarts"], n


def test_restart_help_says_what_else_restarts():
    r = omnid("restart", "--help")
    text = " ".join(r.stdout.split())
    assert "worker group" in text and "require" in text and "listed" in text, r.stdout
    assert "automatic restarts only" in text, r.stdout


# ----------------------------------------------------------------------------- 4 + 5. start
class Cli:
    def __init__(self, tmp_path: Path) -> None:
        self.control = str(tmp_path / "c.sock")
        self.state = tmp_path / "state"
        self.port = free_port()

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return omnid("--control", self.control, *args, **kw)

    def start(self, *extra: str) -> subprocess.CompletedProcess:
        return self("start", "--state-dir", str(self.state), "--health-listen", f"127.0.0.1:{self.port}",
                    "--timeout", "60", *extra)

    def stop(self) -> None:
        if os.path.exists(self.control):
            r = self("stop")
            assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: not os.path.exists(self.control), 20, "the daemon to exit")


@pytest.fixture
def cli(tmp_path):
    c = Cli(tmp_path)
    yield c
    c.stop()


def test_plain_start_refuses_exit_2_when_the_daemon_serves_another_stack(cli):
    other = make_stack({"a": sleeper(), "b": sleeper('restart = "no"\n')})
    r = cli.start("-u", str(other))
    assert r.returncode == 0, r.stdout + r.stderr
    pids = {u["name"]: u["pid"] for u in json.loads(cli("status", "--json").stdout)["units"]}
    r = cli.start()  # no -u: the default (demo) stack, which this daemon does not run
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(other) in r.stderr and settings.default_units_dir() in r.stderr, r.stderr
    after = {u["name"]: u["pid"] for u in json.loads(cli("status", "--json").stdout)["units"]}
    assert after == pids  # nothing was started or restarted


def test_second_start_says_the_daemon_was_already_running_and_start_unit_prints_no_progress(cli):
    stack = make_stack({"a": sleeper(), "b": sleeper('requires = ["a"]\n'), "c": sleeper()})
    r = cli.start("-u", str(stack))
    assert r.returncode == 0, r.stdout + r.stderr
    daemon_pid = json.loads(cli("status", "--json").stdout)["daemon"]["pid"]
    r = cli.start("-u", str(stack))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(rf"already running \(pid {daemon_pid}, up [\d.]+\w*", r.stdout), r.stdout
    assert not PROGRESS.search(r.stdout), r.stdout  # nothing changed: no progress lines
    assert "ready in" not in r.stdout and "already active" in r.stdout, r.stdout
    r = cli("start", "a")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not PROGRESS.search(r.stdout), r.stdout
    assert "already active, nothing started: a" in r.stdout, r.stdout
    assert not re.search(r"^c ", r.stdout, re.M), r.stdout  # only the unit asked about is shown


# ----------------------------------------------------------------------------- 6. check DIR
def test_check_takes_the_directory_as_an_argument_and_keeps_u(tmp_path):
    stack = make_stack({"a": sleeper(), "b": sleeper('requires = ["a"]\n')})
    for argv in (["check", str(stack)], ["check", "-u", str(stack)], ["check", str(stack), "-u", str(stack)]):
        r = omnid(*argv)
        assert r.returncode == 0, (argv, r.stdout + r.stderr)
        assert r.stdout.startswith(f"{stack}: ok, 2 units"), r.stdout
    r = omnid("check", str(stack), "-u", str(tmp_path))
    assert r.returncode == 2 and "two stack directories" in r.stderr, r.stderr
    (tmp_path / "bad.toml").write_text("exec = 3\n")
    r = omnid("check", str(tmp_path))
    assert r.returncode == 2 and "bad.toml" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- 7. logs
def test_logs_print_text_into_a_pipe_and_json_only_when_asked(tmp_path, daemon_factory):
    prog = tmp_path / "talk.py"
    prog.write_text("import sys, time\nprint('ERROR disk on fire', flush=True)\nprint('all fine', flush=True)\n"
                    "time.sleep(3600)\n")
    d = daemon_factory(make_stack({"talk": f'exec = ["{PY}", "{prog}"]\n', "quiet": sleeper()}))
    d.wait_all_active()
    wait_for(lambda: len(d.ok("logs", {"unit": "talk", "n": 10})["talk"]) >= 2, 10, "talk's two lines")
    r = omnid("--control", d.control, "logs", "talk")  # stdout is a pipe here
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[stdout\] ", ln) for ln in lines), \
        r.stdout
    assert lines[0].endswith("[stdout] ERROR disk on fire"), r.stdout
    # What `omnid logs talk | grep ERROR` sees is the line a person saw.
    grep = subprocess.run(["grep", "ERROR"], input=r.stdout, capture_output=True, text=True, timeout=10)
    assert grep.stdout.strip() == lines[0]
    r = omnid("--control", d.control, "logs", "talk", "--json")
    items = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [i["line"] for i in items] == ["ERROR disk on fire", "all fine"] and items[0]["unit"] == "talk"
    # Every command: text into a pipe unless --json.
    for args in (["status"], ["status", "talk"]):
        out = omnid("--control", d.control, *args).stdout
        with pytest.raises(ValueError):
            json.loads(out)
    assert json.loads(omnid("--control", d.control, "status", "--json").stdout)["units"]

    # 9. Nothing to show: exit 0, nothing on stdout, a note on stderr.
    r = omnid("--control", d.control, "logs", "quiet")
    assert r.returncode == 0 and r.stdout == "" and "no output of quiet kept" in r.stderr, r
    r = omnid("--control", d.control, "dump", "quiet")
    assert r.returncode == 0 and r.stdout == "" and "no capture of quiet" in r.stderr, r
    r = omnid("--control", d.control, "logs", "nope")
    assert r.returncode == 2 and "nope" in r.stderr, r  # an unknown unit is a usage error, not "nothing"


# ----------------------------------------------------------------------------- 8 + 9. documents
def _readme_first_screen() -> str:
    text = (REPO / "README.md").read_text()
    return text[:text.index("\n## ")]  # before the first section: what a newcomer reads first


@pytest.mark.fast
def test_readme_says_where_state_goes_before_its_first_section():
    first = _readme_first_screen()
    assert "STATE_DIR" in first and "/var/lib/omnid" in first and "/run/omnid" in first, first
    assert "daemon.log" in first and "dumps" in first, first
    assert "omnid stop" in first  # and how to make it go away


def test_exit_status_documents_nothing_to_show_and_a_closed_pipe_alike_in_man_and_help():
    man = (REPO / "man" / "omnid.8").read_text()
    section = man[man.index(".SH EXIT STATUS"):man.index(".SH ENVIRONMENT")]
    flat = " ".join(section.replace("\\-", "-").split())
    assert "Nothing to show" in flat and "141" in flat, flat
    helptext = " ".join(omnid("--help").stdout.split())
    assert "nothing to show: 0" in helptext and "141" in helptext, helptext


# ----------------------------------------------------------------------------- completion
def _complete(shell: str, script: str, words: list[str], control: str | None = None) -> list[str]:
    """Drive the completion function as bash (or zsh through bashcompinit) does at a Tab:
    COMP_WORDS, COMP_CWORD, then the function; what it offers, one a line. `omnid` is a
    shell function running this checkout's omnid (the completion calls it by that name)."""
    words_q = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    prelude = f'omnid() {{ "{PY}" -m omnid "$@"; }}\n'
    if shell == "zsh":
        prelude += "autoload -U compinit && compinit -u\n"
    body = (f"{prelude}source {script}\n"
            f"COMP_WORDS=({words_q}); COMP_CWORD={len(words) - 1}; COMP_LINE=\"${{COMP_WORDS[*]}}\"\n"
            f"COMP_POINT=${{#COMP_LINE}}\n_omnid\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    env = dict(os.environ, PYTHONPATH=repo_pythonpath(), HOME=str(Path(script).parent))
    argv = ["bash", "--norc", "-c", body] if shell == "bash" else ["zsh", "-f", "-c", body]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO))
    assert r.returncode == 0, (shell, words, r.stdout, r.stderr)
    return [ln for ln in r.stdout.splitlines() if ln]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_offers_commands_options_and_the_running_stacks_unit_names(tmp_path, daemon_factory, shell):
    import shutil

    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (Debian package {shell})")
    d = daemon_factory(make_stack({"engine": sleeper(), "worker": sleeper('instances = 2\n'),
                                   "serve": sleeper('requires = ["engine"]\n')}))
    d.wait_all_active()
    r = omnid("completion", shell)
    assert r.returncode == 0, r.stderr
    script = tmp_path / f"omnid.{shell}"
    script.write_text(r.stdout)
    if shell == "bash":
        check = subprocess.run(["bash", "--norc", "-c", f"source {script}; complete -p omnid"], capture_output=True,
                               text=True, timeout=30)
        assert check.stdout.strip() == "complete -F _omnid omnid", check.stdout + check.stderr
    ctl = ["omnid", "--control", d.control]
    assert _complete(shell, str(script), ["omnid", "sta"]) == ["start", "status"]
    assert "completion" in _complete(shell, str(script), ["omnid", ""])
    assert "__complete" not in _complete(shell, str(script), ["omnid", ""])  # hidden
    assert _complete(shell, str(script), [*ctl, "restart", "--d"]) == ["--dry-run"]
    assert _complete(shell, str(script), ["omnid", "logs", "x", "--j"]) == ["--json"]
    assert _complete(shell, str(script), ["omnid", "completion", ""]) == ["bash", "zsh"]
    # Unit names, asked of the running daemon named by --control on the line being completed.
    assert sorted(_complete(shell, str(script), [*ctl, "restart", ""])) == \
        ["engine", "serve", "worker", "worker@0", "worker@1"]
    assert sorted(_complete(shell, str(script), [*ctl, "logs", "w"])) == ["worker", "worker@0", "worker@1"]
    assert _complete(shell, str(script), [*ctl, "status", "se"]) == ["serve"]
    # No daemon there: nothing offered, no error printed into the terminal.
    assert _complete(shell, str(script), ["omnid", "--control", str(tmp_path / "none.sock"), "stop", ""]) == []


@pytest.mark.fast
def test_every_command_and_option_of_help_is_in_omnid_8():
    """omnid(8) and --help say the same: every command --help lists, and each of its long
    options, is in the page (the hidden __complete is the completion script's, not a user's)."""
    import argparse

    from omnid.cli.main import build_parser
    from omnid.cli.completion import _subcommands

    man = (REPO / "man" / "omnid.8").read_text().replace("\\-", "-")
    missing = []
    for name, sp in _subcommands(build_parser()).items():
        if not re.search(rf"^\.B[IR]? {re.escape(name)}\b", man, re.M):
            missing.append(name)
        for a in sp._actions:  # an option is there under one of its spellings (-n or --lines)
            if a.option_strings and a.help is not argparse.SUPPRESS and "--help" not in a.option_strings \
                    and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", man) for o in a.option_strings):
                missing.append(f"{name} {'/'.join(a.option_strings)}")
    assert not missing, missing


# ----------------------------------------------------------------------------- status, first screen
def _on_a_terminal(argv: list[str], env: dict[str, str]) -> str:
    """Run omnid with stdout and stderr on a pseudo-terminal (what a person sees); its output."""
    import pty

    master, slave = pty.openpty()
    try:
        full = dict(os.environ, PYTHONPATH=repo_pythonpath(), TERM="xterm-256color", **env)
        full.pop("NO_COLOR", None) if "NO_COLOR" not in env else None
        proc = subprocess.Popen([PY, "-m", "omnid", *argv], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL,
                                env=full, cwd=str(REPO))
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(30) == 0, b"".join(chunks).decode(errors="replace")
        return b"".join(chunks).decode(errors="replace")
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


def test_status_first_screen_says_the_verdict_and_root_cause_then_units_by_tier(daemon_factory):
    d = daemon_factory(make_stack({
        "worker": sleeper('instances = 3\n'),
        "cache": 'exec = ["sh", "-c", "echo cannot bind >&2; exit 3"]\nrestart = "no"\nready = "notify"\n',
        "engine": sleeper('requires = ["worker"]\n'),
        "router": sleeper('requires = ["engine", "cache"]\n'),
        "gateway": sleeper('requires = ["router"]\n'),
    }))
    wait_for(lambda: (us := d.units())["cache"]["state"] == "failed" and us["engine"]["state"] == "active"
             and not any(u["phase"] != "idle" for u in us.values()), 30, "cache failed, the rest settled")
    out = omnid("--control", d.control, "status").stdout  # into a pipe: no colour
    lines = out.splitlines()
    assert lines[0].startswith("● FAILED: cache failed: exited with code 3"), out
    assert "down with it: router, gateway" in lines[1], out
    assert re.search(r"5 units: 3 active, 1 inactive|units: .*1 failed", lines[2]) and "daemon pid" in lines[2], out
    assert "\x1b[" not in out
    header = next(i for i, ln in enumerate(lines) if ln.startswith("TIER"))
    rows = [ln.split() for ln in lines[header + 1:] if ln.strip() and not ln.startswith(("GPU:", "group "))]
    # Tier numbers on each tier's first row, in start order; the rest of the tier below it.
    tiers = {}
    current = None
    for ln in lines[header + 1:]:
        if not ln.strip():
            continue
        if ln[0] != " ":
            current = ln.split()[0]
        tiers.setdefault(current, []).append(ln[6:].split()[0])
    assert tiers == {"0": ["cache", "worker@0", "worker@1", "worker@2"], "1": ["engine"], "2": ["router"],
                     "3": ["gateway"]}, out
    assert len(rows) == 7

    # Stable columns: the header is the same whether the stack is OK or not, and every
    # row's cells start under their headings.
    head = lines[header]
    starts = [head.index(h) for h in ("STATE", "PID", "RESTARTS", "LAST EXIT", "REASON")]
    for ln in lines[header + 1:]:
        for s in starts:
            if s < len(ln):  # an empty REASON ends the row earlier
                assert ln[s - 2:s] == "  " and ln[s] != " ", (ln, s)
    assert re.search(r"^2 +router +inactive .* not started: requires cache, which failed: exited with code 3$", out, re.M), out
    d.ok("stop", {"units": ["cache"]})
    d.ok("start", {"units": ["worker"]})
    out2 = omnid("--control", d.control, "status").stdout
    assert next(ln for ln in out2.splitlines() if ln.startswith("TIER")) == head, out2

    # On a terminal: colours (the verdict and the states); NO_COLOR: none, the same words.
    tty = _on_a_terminal(["--control", d.control, "status"], {})
    assert "\x1b[" in tty and "FAILED" not in out2.splitlines()[0], tty
    plain = _on_a_terminal(["--control", d.control, "status"], {"NO_COLOR": "1"})
    assert "\x1b[" not in plain and "TIER" in plain, plain
    # On a narrow terminal table rows are cut at its width, as systemctl does; -l shows them whole.
    narrow = _on_a_terminal(["--control", d.control, "status"], {"NO_COLOR": "1", "COLUMNS": "70"})
    table = narrow.splitlines()[narrow.splitlines().index(next(ln for ln in narrow.splitlines()
                                                                if ln.startswith("TIER"))):]
    assert all(len(ln) <= 70 for ln in table) and any(ln.endswith("…") for ln in table), narrow
    full = _on_a_terminal(["--control", d.control, "status", "-l"], {"NO_COLOR": "1", "COLUMNS": "70"})
    assert "(was failed: exited with code 3" in full and not any(ln.endswith("…") for ln in full.splitlines()), full
    assert "cache (stopped by request)" in full.splitlines()[0], full


def test_status_of_a_healthy_stack_says_ok_first(daemon_factory):
    d = daemon_factory(make_stack({"a": sleeper(), "b": sleeper('requires = ["a"]\n')}))
    d.wait_all_active()
    first = omnid("--control", d.control, "status").stdout.splitlines()[0]
    assert first == "● OK: 2/2 units active and ready", first
