"""Unit-file parsing (omnid/model/units.py): the key table of omnid.unit(5)."""

from __future__ import annotations

import resource
import signal
import textwrap
from pathlib import Path

import pytest

from omnid.model.units import (
    DaemonSettings,
    Liveness,
    LogFormat,
    Ready,
    ReadyKind,
    RestartPolicy,
    Rlimit,
    Stack,
    StackInvalid,
    UnitFileError,
    check_stack,
    load_stack,
)

pytestmark = pytest.mark.fast


def write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    return directory


def errors_of(directory: Path) -> tuple[UnitFileError, ...]:
    with pytest.raises(StackInvalid) as caught:
        load_stack(directory)
    errors = caught.value.errors
    assert errors, "StackInvalid must carry at least one error"
    for error in errors:
        assert error.message, f"empty message in {error!r}"
    return errors


def only_error(directory: Path) -> UnitFileError:
    errors = errors_of(directory)
    assert len(errors) == 1, "\n".join(map(str, errors))
    return errors[0]


def assert_names(error: UnitFileError, file: str, key: str) -> str:
    """The error and its printed form name the file and the key."""
    assert error.file.name == file
    assert error.key == key
    text = str(error)
    assert file in text and key in text
    return text


THREE_TIERS = {
    "worker.toml": """
        exec = ["python", "-m", "worker", "--rank", "%i"]
        instances = 2
        gpus = "%i"
    """,
    "engine.toml": """
        exec = ["python", "-m", "engine"]
        requires = ["worker"]
    """,
    "serve.toml": """
        exec = ["python", "-m", "serve"]
        requires = ["engine"]
    """,
}


# --------------------------------------------------------------------------- valid stacks


def test_full_unit_with_every_key_parses_to_typed_values(tmp_path: Path) -> None:
    write(tmp_path, {
        "db.toml": 'exec = ["db"]\n',
        "cache.toml": 'exec = ["cache"]\n',
        "api.toml": """
            exec = ["python", "-m", "api", "--name", "%n"]
            description = "the API server"
            role = "serve"
            title = "api: %n"
            instances = 1
            after = ["cache"]
            requires = ["db"]
            cwd = "/srv/api"
            env = { MODE = "prod", UNIT = "%n" }
            user = "nobody"
            group = "nogroup"
            limits = { nofile = 65536, memlock = "infinity", core = [0, 1024] }
            gpus = [0, 1]
            ready = "notify"
            ready_timeout = 120
            liveness = { http = "http://127.0.0.1:8000/health", interval = 5, timeout = 2, failures = 3 }
            watchdog_sec = 30
            stop_signal = "SIGINT"
            stop_timeout = 15.5
            kill_timeout = 5
            restart = "on-failure"
            restart_sec = 2
            restart_max_sec = 30
            start_limit_burst = 4
            start_limit_interval = 120
            gpu_min_free_mib = 2048
        """,
        "omnid.toml": """
            control = "/run/omnid/control.sock"
            state_dir = "state"
            health_listen = "127.0.0.1:9400"
            log_format = "json"
        """,
    })  # fmt: skip
    stack = load_stack(tmp_path)
    api = stack["api"]
    assert (api.name, api.template, api.instance, api.instances) == ("api", "api", 0, 1)
    assert api.file == tmp_path / "api.toml"
    assert api.exec == ("python", "-m", "api", "--name", "api")
    assert api.description == "the API server"
    assert api.role == "serve"
    assert api.title == "api: api"
    assert api.after == ("cache",)
    assert api.requires == ("db",)
    assert api.dependencies == ("cache", "db")
    assert api.cwd == "/srv/api"
    assert dict(api.env) == {"MODE": "prod", "UNIT": "api", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert (api.user, api.group) == ("nobody", "nogroup")
    assert api.limits == (
        Rlimit(resource.RLIMIT_NOFILE, 65536, 65536),
        Rlimit(resource.RLIMIT_MEMLOCK, resource.RLIM_INFINITY, resource.RLIM_INFINITY),
        Rlimit(resource.RLIMIT_CORE, 0, 1024),
    )
    assert api.gpus == (0, 1)
    assert api.ready == Ready(ReadyKind.NOTIFY)
    assert api.ready_timeout == 120.0
    assert api.liveness == Liveness("http://127.0.0.1:8000/health", 5.0, 2.0, 3)
    assert api.watchdog_sec == 30.0
    assert api.stop_signal is signal.SIGINT
    assert (api.stop_timeout, api.kill_timeout) == (15.5, 5.0)
    assert api.restart is RestartPolicy.ON_FAILURE
    assert (api.restart_sec, api.restart_max_sec) == (2.0, 30.0)
    assert (api.start_limit_burst, api.start_limit_interval) == (4, 120.0)
    assert api.gpu_min_free_mib == 2048
    assert stack.settings == DaemonSettings(
        file=tmp_path / "omnid.toml",
        control=Path("/run/omnid/control.sock"),
        state_dir=tmp_path / "state",
        health_listen="127.0.0.1:9400",
        log_format=LogFormat.JSON,
    )
    assert check_stack(tmp_path) == ()


def test_defaults_match_the_contract_table(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["serve"]\n'})
    stack = load_stack(tmp_path)
    serve = stack["serve"]
    assert serve.description == "" and serve.role == ""
    assert serve.title == "omnid: serve"
    assert (serve.after, serve.requires, serve.cwd, serve.user, serve.group) == ((), (), None, None, None)
    assert dict(serve.env) == {} and serve.limits == () and serve.gpus == ()
    assert serve.ready == Ready(ReadyKind.STARTED)
    assert serve.ready_timeout == 600.0 and serve.liveness is None and serve.watchdog_sec == 0.0
    assert serve.stop_signal is signal.SIGTERM
    assert (serve.stop_timeout, serve.kill_timeout) == (10.0, 10.0)
    assert serve.restart is RestartPolicy.NO
    assert (serve.restart_sec, serve.restart_max_sec) == (1.0, 60.0)
    assert (serve.start_limit_burst, serve.start_limit_interval) == (5, 60.0)
    assert serve.gpu_min_free_mib == 0
    assert stack.settings == DaemonSettings()


def test_instances_expand_percent_i_and_percent_n_in_exec_env_title_cwd(tmp_path: Path) -> None:
    write(tmp_path, {"worker.toml": """
        exec = ["python", "-m", "worker", "--rank", "%i", "--name", "%n", "--literal", "100%%", "+%Y"]
        instances = 3
        env = { RANK = "%i", WHO = "%n" }
        title = "omnid: %n (rank %i)"
        cwd = "/tmp/work-%i"
    """})  # fmt: skip
    stack = load_stack(tmp_path)
    assert list(stack.units) == ["worker@0", "worker@1", "worker@2"]
    w2 = stack["worker@2"]
    assert (w2.template, w2.instance, w2.instances) == ("worker", 2, 3)
    assert w2.exec == ("python", "-m", "worker", "--rank", "2", "--name", "worker@2", "--literal", "100%", "+%Y")
    assert dict(w2.env) == {"RANK": "2", "WHO": "worker@2"}
    assert w2.title == "omnid: worker@2 (rank 2)"
    assert w2.cwd == "/tmp/work-2"
    assert stack["worker@0"].cwd == "/tmp/work-0"


def test_relative_cwd_is_relative_to_the_stack_directory(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["serve"]\ncwd = "data"\n'})
    assert load_stack(tmp_path)["serve"].cwd == str(tmp_path / "data")


def test_gpus_percent_i_gives_each_instance_its_gpu_and_cuda_visible_devices(tmp_path: Path) -> None:
    write(tmp_path, {
        "worker.toml": 'exec = ["w"]\ninstances = 2\ngpus = "%i"\n',
        "pinned.toml": 'exec = ["p"]\ngpus = [2, 3]\nenv = { CUDA_VISIBLE_DEVICES = "GPU-uuid" }\n',
        "cpu.toml": 'exec = ["c"]\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    for i in (0, 1):
        worker = stack[f"worker@{i}"]
        assert worker.gpus == (i,)
        assert worker.env["CUDA_VISIBLE_DEVICES"] == str(i)
    # env wins over gpus, as the contract says.
    assert stack["pinned"].gpus == (2, 3)
    assert stack["pinned"].env["CUDA_VISIBLE_DEVICES"] == "GPU-uuid"
    assert "CUDA_VISIBLE_DEVICES" not in stack["cpu"].env


MIG = "MIG-377e0049-554c-540b-93c6-d0976f8426cb"
GPU_UUID = "GPU-7f57f032-34ab-a064-c37c-7a4f75601cc5"


def test_gpus_take_gpu_and_mig_uuids_and_cuda_visible_devices_lists_them_as_given(tmp_path: Path) -> None:
    write(tmp_path, {
        "mig.toml": f'exec = ["w"]\ngpus = ["{MIG}"]\n',
        "mixed.toml": f'exec = ["w"]\ngpus = [1, "{GPU_UUID}"]\n',
        "legacy.toml": f'exec = ["w"]\ngpus = ["MIG-{GPU_UUID}/1/0"]\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    assert stack["mig"].gpus == (MIG,)
    # What CUDA parses: the UUID itself, no quotes, brackets or spaces (vllm#41848 crashed on
    # int("MIG-..."): the value must be the UUID, and an index stays a plain number).
    assert stack["mig"].env["CUDA_VISIBLE_DEVICES"] == MIG
    assert stack["mixed"].gpus == (1, GPU_UUID)
    assert stack["mixed"].env["CUDA_VISIBLE_DEVICES"] == f"1,{GPU_UUID}"
    assert stack["legacy"].env["CUDA_VISIBLE_DEVICES"] == f"MIG-{GPU_UUID}/1/0"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('["MIG-377e0049"]', 'item 1: not a MIG device UUID'),
        ('["GPU-xyz"]', "item 1: not a GPU UUID"),
        ('[0, "1"]', 'item 2: expected a GPU index as an integer, got the string "1" (write 1)'),
        (f'["{GPU_UUID},{MIG}"]', "item 1: expected one GPU per item"),
        (f'[" {MIG}"]', "item 1: expected one GPU per item"),
        ('["cuda:0"]', 'item 1: expected a GPU index (0 to 1023), a GPU UUID ("GPU-...") or a MIG device UUID'),
        ("[1.5]", "got float 1.5"),
        (f'["{MIG}", "{MIG}"]', "each GPU once"),
        ('"0,1"', 'or "%i", got string "0,1"'),
    ],
)
def test_malformed_gpus_are_named_errors(tmp_path: Path, value: str, expected: str) -> None:
    write(tmp_path, {"worker.toml": f'exec = ["w"]\ngpus = {value}\n'})
    text = assert_names(only_error(tmp_path), "worker.toml", "gpus")
    assert expected in text, text


def test_numa_is_auto_by_default_and_takes_off_or_a_node(tmp_path: Path) -> None:
    from omnid.model.units import NumaMode

    write(tmp_path, {
        "a.toml": 'exec = ["w"]\ngpus = [0]\n',
        "b.toml": 'exec = ["w"]\nnuma = "off"\n',
        "c.toml": 'exec = ["w"]\nnuma = 1\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    assert stack["a"].numa is NumaMode.AUTO
    assert stack["b"].numa is NumaMode.OFF
    assert stack["c"].numa == 1


@pytest.mark.parametrize("value", ['"on"', "-1", "true", "1.0", "[0]"])
def test_bad_numa_is_a_named_error(tmp_path: Path, value: str) -> None:
    write(tmp_path, {"worker.toml": f'exec = ["w"]\nnuma = {value}\n'})
    text = assert_names(only_error(tmp_path), "worker.toml", "numa")
    assert '"auto"' in text and '"off"' in text and "node number" in text


def test_restart_sec_zero_is_accepted_and_the_start_limit_still_applies(tmp_path: Path) -> None:
    # systemd's RestartSec=0: restart at once; start_limit_burst still ends a crash loop.
    write(tmp_path, {"w.toml": 'exec = ["w"]\nrestart = "always"\nrestart_sec = 0\nrestart_max_sec = 0\n'})
    w = load_stack(tmp_path)["w"]
    assert w.restart_sec == 0.0 and w.restart_max_sec == 0.0 and w.start_limit_burst == 5


def test_dependency_on_a_template_means_all_its_instances(tmp_path: Path) -> None:
    write(tmp_path, THREE_TIERS)
    stack = load_stack(tmp_path)
    assert stack["engine"].requires == ("worker@0", "worker@1")
    assert stack["engine"].dependencies == ("worker@0", "worker@1")


def test_dependency_on_one_instance_and_percent_i_in_dependencies(tmp_path: Path) -> None:
    write(tmp_path, {
        "worker.toml": 'exec = ["w"]\ninstances = 2\n',
        "shard.toml": 'exec = ["s"]\ninstances = 2\nrequires = ["worker@%i"]\n',
        "leader.toml": 'exec = ["l"]\nafter = ["worker@1"]\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    assert stack["shard@0"].requires == ("worker@0",)
    assert stack["shard@1"].requires == ("worker@1",)
    assert stack["leader"].after == ("worker@1",) and stack["leader"].requires == ()


def test_tiers_order_workers_then_engine_then_serve(tmp_path: Path) -> None:
    write(tmp_path, THREE_TIERS)
    stack = load_stack(tmp_path)
    assert [[u.name for u in tier] for tier in stack.tiers()] == [["worker@0", "worker@1"], ["engine"], ["serve"]]
    assert [stack.tier_of(n) for n in ("worker@1", "engine", "serve")] == [0, 1, 2]


def test_tiers_put_a_unit_after_its_latest_dependency(tmp_path: Path) -> None:
    write(tmp_path, {
        "a.toml": 'exec = ["a"]\n',
        "b.toml": 'exec = ["b"]\nafter = ["a"]\n',
        "c.toml": 'exec = ["c"]\nrequires = ["a", "b"]\n',
        "d.toml": 'exec = ["d"]\n',
    })  # fmt: skip
    tiers = load_stack(tmp_path).tiers()
    assert [[u.name for u in tier] for tier in tiers] == [["a", "d"], ["b"], ["c"]]


def test_dependents_are_transitive_requirers_in_stop_order(tmp_path: Path) -> None:
    write(tmp_path, {**THREE_TIERS, "metrics.toml": 'exec = ["m"]\nafter = ["engine"]\n'})
    stack = load_stack(tmp_path)
    names = lambda units: [u.name for u in units]  # noqa: E731
    assert names(stack.dependents("worker@1")) == ["serve", "engine"]
    assert names(stack.dependents("worker")) == ["serve", "engine"]
    # `after` orders but does not tie lifetimes: metrics is not stopped with engine.
    assert names(stack.dependents("engine")) == ["serve"]
    assert names(stack.dependents("serve")) == []
    with pytest.raises(KeyError):
        stack.dependents("nope")


def test_resolve_maps_templates_to_instances(tmp_path: Path) -> None:
    write(tmp_path, THREE_TIERS)
    stack = load_stack(tmp_path)
    assert [u.name for u in stack.resolve("worker")] == ["worker@0", "worker@1"]
    assert [u.name for u in stack.resolve("worker@1")] == ["worker@1"]
    assert isinstance(stack, Stack) and len(stack) == 4 and "engine" in stack


def test_units_are_frozen_and_hashable(tmp_path: Path) -> None:
    write(tmp_path, THREE_TIERS)
    unit = load_stack(tmp_path)["worker@0"]
    with pytest.raises(AttributeError):
        unit.exec = ("x",)  # type: ignore[misc]
    with pytest.raises(TypeError):
        unit.env["X"] = "1"  # type: ignore[index]
    assert len({unit, unit}) == 1


def test_child_environment_tags_the_unit_and_drops_the_daemons_notify_socket(tmp_path: Path) -> None:
    write(tmp_path, {
        "worker.toml": 'exec = ["w"]\ninstances = 2\nready = "notify"\nwatchdog_sec = 3\nenv = { A = "%i" }\n',
        "plain.toml": 'exec = ["p"]\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    base = {"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1"}
    env = stack["worker@1"].environ(base, notify_socket="/run/omnid/notify")
    assert env == {
        "PATH": "/usr/bin", "A": "1", "OMNID_UNIT": "worker@1", "OMNID_INSTANCE": "1", "OMNID_INSTANCES": "2",
        "SPT_NOENV": "1", "NOTIFY_SOCKET": "/run/omnid/notify", "WATCHDOG_USEC": "3000000",
    }  # fmt: skip
    plain = stack["plain"].environ(base, notify_socket="/run/omnid/notify")
    assert "NOTIFY_SOCKET" not in plain and "WATCHDOG_USEC" not in plain
    assert plain["OMNID_UNIT"] == "plain" and plain["OMNID_INSTANCE"] == "0"


def test_ready_tables_parse_http_and_tcp(tmp_path: Path) -> None:
    write(tmp_path, {
        "web.toml": 'exec = ["w"]\ninstances = 2\nready = { http = "http://127.0.0.1:800%i/ready" }\n',
        "sock.toml": 'exec = ["s"]\nready = { tcp = "[::1]:9000" }\n',
    })  # fmt: skip
    stack = load_stack(tmp_path)
    assert stack["web@1"].ready == Ready(ReadyKind.HTTP, url="http://127.0.0.1:8001/ready")
    assert stack["sock"].ready == Ready(ReadyKind.TCP, host="::1", port=9000)


def test_non_toml_files_and_dotfiles_are_ignored(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\n', "README.md": "hi", ".serve.toml": "not = [toml"})
    assert list(load_stack(tmp_path).units) == ["serve"]


# --------------------------------------------------------------------------- one error of each kind


def test_bad_toml_names_the_file_and_the_line(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["serve"]\nrole = = "x"\n'})
    error = only_error(tmp_path)
    assert error.file.name == "serve.toml"
    assert "invalid TOML" in str(error) and "line" in str(error) and "serve.toml" in str(error)


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["serve"]\nrequire = []\n'})
    text = assert_names(only_error(tmp_path), "serve.toml", "require")
    assert 'did you mean "requires"' in text


def test_unknown_nested_key_is_named_with_its_table(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\nliveness = { http = "http://127.0.0.1/", every = 5 }\n'})
    assert_names(only_error(tmp_path), "serve.toml", "liveness.every")


@pytest.mark.parametrize(
    ("line", "key", "expected"),
    [
        ('exec = "serve --port 80"', "exec", "array of strings"),
        ("exec = []", "exec", "non-empty array"),
        ('exec = ["s"]\ndescription = 3', "description", "string"),
        ('exec = ["s"]\ninstances = "2"', "instances", "integer"),
        ('exec = ["s"]\ninstances = true', "instances", "integer"),
        ('exec = ["s"]\nafter = "a"', "after", "array of strings"),
        ('exec = ["s"]\nenv = { PORT = 8000 }', "env.PORT", "string"),
        ('exec = ["s"]\nlimits = { nofile = "lots" }', "limits.nofile", '"infinity"'),
        ('exec = ["s"]\nlimits = { files = 10 }', "limits.files", "nofile"),
        ('exec = ["s"]\ngpus = "all"', "gpus", '"%i"'),
        ('exec = ["s"]\nready = "healthy"', "ready", '"notify"'),
        ('exec = ["s"]\nready = { http = "ftp://x/" }', "ready.http", "http://"),
        ('exec = ["s"]\nready = { tcp = "localhost" }', "ready.tcp", "HOST:PORT"),
        ('exec = ["s"]\nliveness = 5', "liveness", "table"),
        ('exec = ["s"]\nliveness = { interval = 5 }', "liveness.http", "http"),
        ('exec = ["s"]\nstop_timeout = "10s"', "stop_timeout", "seconds"),
        ('exec = ["s"]\nrestart = "sometimes"', "restart", '"on-failure"'),
        ('exec = ["s"]\nrestart = true', "restart", '"always"'),
        ('exec = ["s"]\nuser = 0', "user", "string"),
        ('exec = ["s"]\nenv = { OMNID_UNIT = "x" }', "env.OMNID_UNIT", "set by omnid"),
    ],
)
def test_wrong_type_names_file_key_and_expectation(tmp_path: Path, line: str, key: str, expected: str) -> None:
    write(tmp_path, {"serve.toml": line + "\n"})
    text = assert_names(only_error(tmp_path), "serve.toml", key)
    assert expected in text


def test_missing_exec_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'role = "serve"\n'})
    text = assert_names(only_error(tmp_path), "serve.toml", "exec")
    assert "missing" in text


@pytest.mark.parametrize(
    ("line", "key", "expected"),
    [
        ("instances = 0", "instances", ">= 1"),
        ("ready_timeout = 0", "ready_timeout", "> 0"),
        ("stop_timeout = -1", "stop_timeout", "> 0"),
        ("kill_timeout = nan", "kill_timeout", "> 0"),
        ("watchdog_sec = -5", "watchdog_sec", ">= 0"),
        ("restart_sec = -1", "restart_sec", ">= 0"),
        ("restart_sec = 10\nrestart_max_sec = 5", "restart_max_sec", ">= restart_sec"),
        ("start_limit_burst = 0", "start_limit_burst", ">= 1"),
        ("start_limit_interval = 0", "start_limit_interval", "> 0"),
        ("gpu_min_free_mib = -1", "gpu_min_free_mib", ">= 0"),
        ("gpus = [-1]", "gpus", "0 to 1023"),
        ("gpus = [0, 0]", "gpus", "once"),
        ("limits = { core = [10, 5] }", "limits.core", "soft <= hard"),
        ('liveness = { http = "http://127.0.0.1/", failures = 0 }', "liveness.failures", ">= 1"),
        ('ready = { tcp = "127.0.0.1:70000" }', "ready.tcp", "65535"),
    ],
)
def test_out_of_range_value_names_file_key_and_range(tmp_path: Path, line: str, key: str, expected: str) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\n' + line + "\n"})
    text = assert_names(only_error(tmp_path), "serve.toml", key)
    assert expected in text


def test_unknown_signal_name_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\nstop_signal = "SIGSTOPPLEASE"\n'})
    text = assert_names(only_error(tmp_path), "serve.toml", "stop_signal")
    assert "SIGSTOPPLEASE" in text and "signal name" in text


def test_signal_name_without_sig_prefix_is_accepted(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\nstop_signal = "INT"\n'})
    assert load_stack(tmp_path)["serve"].stop_signal is signal.SIGINT


def test_unknown_dependency_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\nrequires = ["engine"]\n'})
    text = assert_names(only_error(tmp_path), "serve.toml", "requires")
    assert '"engine"' in text


def test_dependency_on_a_missing_instance_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {
        "worker.toml": 'exec = ["w"]\ninstances = 2\n',
        "engine.toml": 'exec = ["e"]\nafter = ["worker@2"]\n',
    })  # fmt: skip
    text = assert_names(only_error(tmp_path), "engine.toml", "after")
    assert "worker@0 to worker@1" in text


def test_self_dependency_is_an_error_reported_once(tmp_path: Path) -> None:
    write(tmp_path, {"worker.toml": 'exec = ["w"]\ninstances = 2\nrequires = ["worker"]\n'})
    # Once, not once per instance, and not also as a cycle between worker@0 and worker@1.
    text = assert_names(only_error(tmp_path), "worker.toml", "requires")
    assert "itself" in text


def test_instance_naming_itself_is_a_self_dependency(tmp_path: Path) -> None:
    write(tmp_path, {"worker.toml": 'exec = ["w"]\ninstances = 2\nafter = ["worker@0"]\n'})
    # worker@1 waiting for worker@0 would be fine, but worker@0 waits for itself.
    text = assert_names(only_error(tmp_path), "worker.toml", "after")
    assert "itself" in text


def test_dependency_cycle_is_an_error_naming_the_loop(tmp_path: Path) -> None:
    write(tmp_path, {
        "a.toml": 'exec = ["a"]\nrequires = ["b"]\n',
        "b.toml": 'exec = ["b"]\nafter = ["c"]\n',
        "c.toml": 'exec = ["c"]\nrequires = ["a"]\n',
        "d.toml": 'exec = ["d"]\nrequires = ["c"]\n',  # stuck behind the cycle, not part of it
    })  # fmt: skip
    text = assert_names(only_error(tmp_path), "a.toml", "requires")
    assert "a -> b -> c -> a" in text
    assert "b.toml" in text and "c.toml" in text


def test_cycle_through_instances_is_reported_once(tmp_path: Path) -> None:
    write(tmp_path, {
        "worker.toml": 'exec = ["w"]\ninstances = 3\nrequires = ["engine"]\n',
        "engine.toml": 'exec = ["e"]\nrequires = ["worker"]\n',
    })  # fmt: skip
    error = only_error(tmp_path)
    assert "cycle" in str(error) and error.key == "requires"


def test_watchdog_without_notify_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\nwatchdog_sec = 10\n'})
    text = assert_names(only_error(tmp_path), "serve.toml", "watchdog_sec")
    assert 'ready = "notify"' in text


@pytest.mark.parametrize(
    ("line", "key", "expected"),
    [
        ('listen = "127.0.0.1:1"', "listen", "health_listen"),
        ('health_listen = "localhost:9321"', "health_listen", "numeric"),
        ('health_listen = "127.0.0.1"', "health_listen", "HOST:PORT"),
        ('log_format = "xml"', "log_format", '"console"'),
        ("state_dir = 5", "state_dir", "string"),
    ],
)
def test_bad_settings_in_omnid_toml_are_errors(tmp_path: Path, line: str, key: str, expected: str) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\n', "omnid.toml": line + "\n"})
    text = assert_names(only_error(tmp_path), "omnid.toml", key)
    assert expected in text


def test_invalid_unit_name_is_an_error(tmp_path: Path) -> None:
    write(tmp_path, {"serve.toml": 'exec = ["s"]\n', "worker@1.toml": 'exec = ["w"]\n'})
    error = only_error(tmp_path)
    assert error.file.name == "worker@1.toml" and "unit name" in str(error)


def test_missing_or_empty_directory_is_an_error(tmp_path: Path) -> None:
    assert "no unit files" in str(only_error(tmp_path))
    assert "not a directory" in str(only_error(tmp_path / "missing"))


def test_dependency_on_an_unreadable_unit_does_not_add_noise(tmp_path: Path) -> None:
    write(tmp_path, {"engine.toml": "exec = [\n", "serve.toml": 'exec = ["s"]\nrequires = ["engine"]\n'})
    assert only_error(tmp_path).file.name == "engine.toml"


# --------------------------------------------------------------------------- all errors at once


def test_every_error_in_every_file_is_reported_at_once(tmp_path: Path) -> None:
    write(tmp_path, {
        "broken.toml": "exec = [\n",
        "engine.toml": 'exec = ["e"]\nrequires = ["ghost"]\nstop_signal = "SIGNOPE"\n',
        "serve.toml": 'description = 1\ninstances = 0\ncolour = "red"\n',
        "worker.toml": 'exec = ["w"]\nwatchdog_sec = 5\n',
        "omnid.toml": 'log_format = "xml"\n',
    })  # fmt: skip
    with pytest.raises(StackInvalid) as caught:
        load_stack(tmp_path)
    found = {(e.file.name, e.key) for e in caught.value.errors}
    assert found == {
        ("broken.toml", ""),
        ("engine.toml", "requires"),
        ("engine.toml", "stop_signal"),
        ("serve.toml", "exec"),
        ("serve.toml", "description"),
        ("serve.toml", "instances"),
        ("serve.toml", "colour"),
        ("worker.toml", "watchdog_sec"),
        ("omnid.toml", "log_format"),
    }
    # The exception's message lists them all, one per line, and check_stack returns the same list.
    message = str(caught.value)
    assert message.startswith("9 errors in unit files:")
    assert all(str(e) in message for e in caught.value.errors)
    assert check_stack(tmp_path) == caught.value.errors


@pytest.mark.parametrize("key,value,why", [
    ("liveness", '{ http = "http://[::1/x" }', "Invalid IPv6 URL"),
    ("ready", '{ http = "http://[::1]:99999/" }', "Port out of range"),
    ("ready", '{ http = "http://h:abc/" }', "Port could not be cast"),
    ("ready", '{ tcp = "[::1:80" }', "IPv6 address in brackets"),
    ("ready", '{ tcp = "::1:80" }', "IPv6 address in brackets"),
])
def test_a_malformed_url_or_host_port_is_a_named_error_not_a_traceback(tmp_path: Path, key, value, why) -> None:
    """Found by fuzzing: urlsplit's ValueError ("Invalid IPv6 URL") came out of `omnid check`
    and the daemon as a traceback."""
    write(tmp_path, {"a.toml": f'exec = ["a"]\n{key} = {value}\n'})
    errs = errors_of(tmp_path)
    assert len(errs) == 1 and errs[0].key.startswith(key + ".") and why in errs[0].message, errs
