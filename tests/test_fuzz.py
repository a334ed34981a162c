"""Issue #9: property tests (hypothesis) for the two untrusted inputs with a grammar:
unit files (`omnid check` never raises, every error names its file) and control
requests (every request gets a well-formed reply, the daemon never dies, bad
arguments get `bad_request` naming the argument). Case counts: UNIT_CASES,
RAW_TOML_CASES, CONTROL_CASES below (hypothesis runs exactly max_examples when no
example fails)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnid.model.units import UNIT_KEYS, UnitFileError, check_stack
from tests.harness import Daemon, make_stack, repo_pythonpath

UNIT_CASES = 400
RAW_TOML_CASES = 300
CONTROL_CASES = 300


# ------------------------------------------------------------------ unit files
def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string for these characters
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 1024, 1025, 2**31, 2**63 - 1, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=20),
    st.sampled_from(["started", "notify", "%i", "infinity", "SIGTERM", "http://127.0.0.1:1/", "a", "b@0",
                     "127.0.0.1:80", "worker", ""]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["http", "tcp", "nofile", "memlock", "interval", "timeout", "failures",
                                     "X", "PATH"]), inner, max_size=3)), max_leaves=8)
unit_tables = st.dictionaries(st.sampled_from(sorted(UNIT_KEYS)) | st.text(min_size=1, max_size=8,
                              alphabet="abcdefghij_"), values, max_size=8)


def assert_clean(directory: Path) -> tuple[UnitFileError, ...]:
    errors = check_stack(directory)  # must not raise
    for e in errors:
        assert isinstance(e, UnitFileError) and e.message and str(e.file).startswith(str(directory)), e
    return errors


@settings(max_examples=UNIT_CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["a", "b", "worker"]), unit_tables, min_size=1, max_size=3))
def test_unit_parser_never_raises_and_names_the_file(stack):
    d = Path(tempfile.mkdtemp(prefix="omfz-", dir="/tmp"))
    try:
        for name, table in stack.items():
            text = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in table.items())
            (d / f"{name}.toml").write_text(text)
        assert_clean(d)
    finally:
        shutil.rmtree(d)


fragments = st.sampled_from(['exec = ["sleep", "1"]\n', "instances = 2\n", 'requires = ["b"]\n', "[", "]", "{",
                             "}", "=", '"', "\n", "a.b.c = 1\n", "[x]\n", "[[y]]\n", "instances = 1e6\n",
                             "instances = 99999999999999999999\n", "x = 1979-05-27T07:32:00Z\n", "\\u0000",
                             "inf", "nan", "'''", '"""'])


@settings(max_examples=RAW_TOML_CASES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(fragments, st.text(max_size=10)), max_size=30), st.integers(0, 3000))
def test_raw_unit_file_text_never_raises(parts, depth):
    d = Path(tempfile.mkdtemp(prefix="omfz-", dir="/tmp"))
    try:
        (d / "a.toml").write_text("".join(parts))  # st.text() has no lone surrogates: always UTF-8
        (d / "b.toml").write_text('exec = ["x"]\nv = ' + "[" * depth + "]" * depth + "\n")
        errors = assert_clean(d)
        if depth > 2000:
            assert any(e.file.name == "b.toml" for e in errors)
    finally:
        shutil.rmtree(d)


def test_check_bounds_instances_and_long_chains(tmp_path):
    (tmp_path / "a.toml").write_text('exec = ["x"]\ninstances = 9223372036854775807\n')
    (tmp_path / "b.toml").write_text('exec = ["x"]\ninstances = 1e6\n')
    errors = assert_clean(tmp_path)
    assert {e.file.name for e in errors} == {"a.toml", "b.toml"}, errors
    assert any("1024" in e.message for e in errors), errors
    chain = tmp_path / "chain"
    chain.mkdir()
    for i in range(4000):
        dep = f'requires = ["u{i - 1}"]\n' if i else ""
        (chain / f"u{i}.toml").write_text(f'exec = ["x"]\n{dep}')
    assert assert_clean(chain) == ()


# ------------------------------------------------------------------ control protocol
CMDS = ["status", "start", "stop", "restart", "kill", "logs", "check", "nope", "", "shutdownx"]
arg_values = st.one_of(scalars, st.lists(st.sampled_from(["a", "b", "zz", ""]), max_size=3),
                       st.sampled_from([float("nan"), float("inf"), -1, 0, 1e300, "5", None, 9, 19, 64, 65,
                                        "USR1", "SIGHUP", ["a"], {"x": 1}]))
requests = st.fixed_dictionaries(
    {"cmd": st.sampled_from(CMDS)},
    optional={"id": st.one_of(st.integers(), st.text(max_size=5), st.none()),
              "args": st.one_of(st.dictionaries(st.sampled_from(["units", "unit", "timeout", "signal", "n",
                                                                 "verify", "units_dir", "x"]), arg_values,
                                                max_size=4), arg_values)})


def test_control_protocol_property(tmp_path):
    stack = make_stack({"a": 'exec = ["sleep", "1000"]\nstop_timeout = 1\nkill_timeout = 1\n',
                        "b": 'exec = ["sleep", "1000"]\nstop_timeout = 1\nkill_timeout = 1\n'})
    d = Daemon(stack, env={"PYTHONPATH": repo_pythonpath()}).start()
    seen = {"n": 0}
    try:
        d.wait_all_active()

        @settings(max_examples=CONTROL_CASES, deadline=None, derandomize=False,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(requests)
        def prop(req):
            seen["n"] += 1
            payload = json.dumps(req, allow_nan=True).encode()
            rep = d.raw(payload, timeout=20)
            assert isinstance(rep.get("ok"), bool), rep
            if not rep["ok"]:
                err = rep["error"]
                assert err["code"] and err["message"], rep
                assert err["code"] != "internal", (req, rep, d.log()[-2000:])
            args = req.get("args")
            if isinstance(args, dict) and "timeout" in args and req["cmd"] in ("start", "stop", "restart"):
                t = args["timeout"]
                bad = t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                                         or not math.isfinite(t) or t <= 0 or t > 86400)
                if bad:
                    assert not rep["ok"] and rep["error"]["code"] in ("bad_request", "unknown_unit"), (req, rep)
                    if rep["error"]["code"] == "bad_request" and "units" not in rep["error"]["message"]:
                        assert "timeout" in rep["error"]["message"], rep
            if req["cmd"] == "kill" and isinstance(args, dict) and args.get("unit") == "a" \
                    and isinstance(args.get("signal"), int) and not isinstance(args.get("signal"), bool) \
                    and 1 <= args["signal"] <= 64:
                assert rep["ok"] or rep["error"]["code"] == "not_running", (req, rep)
            assert d.proc.poll() is None, d.log()[-3000:]

        prop()
        print(f"control protocol: {seen['n']} cases")
        assert seen["n"] >= CONTROL_CASES
        st_ = d.ok("status", {"verify": True})
        assert st_["verify"]["ok"], st_["verify"]
    finally:
        d.close()
        shutil.rmtree(stack, ignore_errors=True)
