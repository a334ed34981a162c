"""The table of unit keys (omnid.model.keys) holds the facts about each key once; these tests
hold the table, the parser, the Unit model, the reload planner and omnid.unit(5) together:
a key missing from one of them, or classified in one way and planned in another, fails here."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from enum import Enum
from types import MappingProxyType
from typing import Any

import pytest

from omnid.core.reload import plan
from omnid.model.units import (DrainHook, ListenSocket, Liveness, NumaMode, Progress, Ready, ReadyKind, Rlimit,
                         TorchDistributed, Unit, check_stack, load_stack)
from omnid.model.units import LIVENESS_KEYS, PROGRESS_KEYS, SOCKET_KEYS, TORCH_DISTRIBUTED_KEYS
from omnid.model.keys import TEMPLATE_KEYS, UNIT_KEY_TABLE, UNIT_KEYS, OnChange, UnitKey
from tests.harness import REPO, make_stack

pytestmark = pytest.mark.fast

MAN = (REPO / "man" / "omnid.unit.5").read_text()
# Unit fields that say which instance of which file a unit is: not keys.
IDENTITY = {"name", "template", "instance", "file"}


def documented_keys() -> dict[str, str]:
    """key -> the .SS subsection of KEYS whose tagged paragraph (.TP/.TQ) names it."""
    keys_section = MAN.split("\n.SH KEYS\n", 1)[1].split("\n.SH ", 1)[0]
    found: dict[str, str] = {}
    section = ""
    lines = keys_section.splitlines()
    for before, line in zip(["", *lines], lines):
        if line.startswith(".SS "):
            section = line[4:]
        elif before in (".TP", ".TQ") and line.startswith((".B ", ".BR ")):
            for word in re.findall(r"[a-z_]+", line.split(" ", 1)[1]):
                found.setdefault(word, section)
    return found


def test_the_table_names_each_key_once():
    assert len(set(UNIT_KEYS)) == len(UNIT_KEYS) == len(UNIT_KEY_TABLE)
    assert all(k.doc and "\n" not in k.doc for k in UNIT_KEY_TABLE)
    # Read by omnid.model.unitfile's own code: the nested tables. The template's keys are one value each.
    assert {k.name for k in UNIT_KEY_TABLE if k.parse is None} == {"torch_distributed", "liveness", "progress",
                                                                   "sockets"}
    assert all(k.parse is not None for k in UNIT_KEY_TABLE if k.name in TEMPLATE_KEYS)


@pytest.mark.parametrize("key", UNIT_KEY_TABLE, ids=lambda k: k.name)
def test_every_key_is_documented_in_omnid_unit_5_under_its_section(key: UnitKey):
    documented = documented_keys()
    assert key.name in documented, f"{key.name} has no tagged paragraph under KEYS in man/omnid.unit.5"
    assert documented[key.name] == key.section


def render(value: Any) -> str:
    """A default as the man page writes it in bold."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return json.dumps(value.name if isinstance(value, signal.Signals) else str(value.value))
    if isinstance(value, Ready):
        return json.dumps(str(value.kind))
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, str):
        return json.dumps(value)
    return "[]" if value == () else repr(value)


def test_the_man_page_states_the_defaults_of_the_table():
    """Where the first line of a key's paragraph says its default, it is the table's."""
    lines = MAN.splitlines()
    checked = []
    for i, line in enumerate(lines[1:-1], 1):
        if lines[i - 1] not in (".TP", ".TQ") or not line.startswith(".B "):
            continue
        name, text = line[3:], lines[i + 1].replace("\\-", "-")
        key = next((k for k in UNIT_KEY_TABLE if k.name == name), None)
        stated = re.search(r"default \\fB(.*?)\\fR", text) or re.search(r'\\fB("[^"]*")\\fR \(default\)', text)
        if key is None or stated is None:
            continue
        assert stated.group(1) == render(key.default), f"{name}: the man page says {stated.group(1)}"
        checked.append(name)
    assert len(checked) >= 25, checked  # most keys state their default on their first line


def test_the_parser_accepts_exactly_the_keys_of_the_table(tmp_path):
    errors = check_stack(make_stack({"a": 'exec = ["true"]\nbogus = 1\n'}))
    (error,) = errors
    assert error.key == "bogus"
    listed = error.message.split("expected one of: ", 1)[1].split(", ")
    assert listed == sorted(UNIT_KEYS)


@pytest.mark.parametrize("key", UNIT_KEY_TABLE, ids=lambda k: k.name)
def test_the_parser_reads_every_key_of_the_table(key: UnitKey):
    """A value no key takes (an array of arrays) is reported under that key's name."""
    text = "" if key.name == "exec" else 'exec = ["true"]\n'
    errors = check_stack(make_stack({"a": f"{text}{key.name} = [[1]]\n"}))
    assert errors and all(re.match(rf"{key.name}($|[.\[])", e.key) for e in errors), errors


def test_every_unit_field_is_a_key_of_the_table_or_says_which_unit_it_is():
    fields = {f.name for f in dataclasses.fields(Unit)}
    assert fields - IDENTITY == set(UNIT_KEYS)


def test_a_unit_that_sets_nothing_gets_the_table_defaults():
    unit = load_stack(make_stack({"a": 'exec = ["true"]\n'}))["a"]
    # gpus: the table's None is "not written" (CUDA_VISIBLE_DEVICES untouched); the unit has none.
    expected = {k.name: k.default for k in UNIT_KEY_TABLE if k.name not in ("exec", "gpus")}
    assert {n: getattr(unit, n) for n in expected} == {**expected, "title": "omnid: a"}  # %n expanded
    assert expected["title"] == "omnid: %n" and unit.gpus == ()
    for f in dataclasses.fields(Unit):
        if f.name in expected and f.default is not dataclasses.MISSING:
            assert f.default == expected[f.name], f.name


# Hand-written changes for keys whose default a generic change (below) cannot change.
CHANGED: dict[str, Any] = {
    "exec": ("sleep", "2"), "cwd": "/tmp", "user": "nobody", "group": "nogroup",
    "env": MappingProxyType({"A": "1"}), "limits": (Rlimit(7, 64, 64),), "ready": Ready(ReadyKind.NOTIFY),
    "stop_signal": signal.SIGINT, "drain": DrainHook(url="http://127.0.0.1:1/drain"), "worker_group": "g",
    "group_hosts": ("node-a", "node-b"), "torch_distributed": TorchDistributed(), "memory_max": 1 << 30,
    "tasks_max": 64, "liveness": Liveness(url="http://127.0.0.1:1/"), "numa": 0, "gpus": (0,),
    "progress": Progress(metrics="http://127.0.0.1:1/metrics", counter="c", busy=("b",)),
    "sockets": (ListenSocket("127.0.0.1:1", "http"),), "after": ("b",), "requires": ("b",), "abort_timeout": 2.0,
}


def changed(key: UnitKey, old: Any) -> Any:
    if key.name in CHANGED:
        return CHANGED[key.name]
    if isinstance(old, bool):
        return not old
    if isinstance(old, Enum):
        return next(m for m in type(old) if m != old)
    if isinstance(old, (int, float, str)):
        return old + type(old)(1) if not isinstance(old, str) else old + "x"
    raise AssertionError(f"{key.name}: write a changed value into CHANGED")


@pytest.mark.parametrize("key", [k for k in UNIT_KEY_TABLE if k.change is not OnChange.INSTANCES],
                         ids=lambda k: k.name)
def test_reload_plans_a_change_of_each_key_as_the_table_classifies_it(key: UnitKey):
    old = load_stack(make_stack({"a": 'exec = ["sleep", "1"]\n', "b": 'exec = ["sleep", "1"]\n'}))
    unit = old["a"]
    value = changed(key, getattr(unit, key.name))
    assert value != getattr(unit, key.name)
    edited = dataclasses.replace(unit, **{key.name: value})
    new = dataclasses.replace(old, units=MappingProxyType({**old.units, "a": edited}))
    if key.name == "worker_group":
        new = dataclasses.replace(new, groups=MappingProxyType({"g": ("a",)}))
    p = plan(old, new)
    if key.change is OnChange.RESTART:
        assert p.restarted == {"a": [key.name]} and not p.updated, p
    else:
        assert p.updated == {"a": [key.name]} and not p.restarted, p
    assert p.unchanged == ["b"]


def test_a_change_of_instances_adds_or_removes_instances_and_leaves_the_others():
    assert {k.name for k in UNIT_KEY_TABLE if k.change is OnChange.INSTANCES} == {"instances"}
    old = load_stack(make_stack({"w": 'exec = ["sleep", "1"]\ninstances = 2\n'}))
    new = load_stack(make_stack({"w": 'exec = ["sleep", "1"]\ninstances = 3\n'}))
    p = plan(old, new)
    assert (p.added, p.removed, p.restarted, p.updated, p.unchanged) == (["w@2"], [], {}, {}, ["w@0", "w@1"])
    p = plan(new, old)
    assert (p.added, p.removed, p.restarted, p.updated, p.unchanged) == ([], ["w@2"], {}, {}, ["w@0", "w@1"])


def test_omnid_8_lists_each_key_under_the_reload_class_of_the_table():
    """omnid(8), RELOAD: the keys named for "restarted" and for "updated" (with the page's
    patterns restart*, start_limit_*, *_timeout) are the table's, and `instances` is told apart."""
    section = (REPO / "man" / "omnid.8").read_text().split("\n.SH RELOAD\n", 1)[1].split("\n.SH ", 1)[0]

    def named(tag: str) -> set[str]:
        paragraph = section.split(f"\n.B {tag}\n", 1)[1].split("\n.TP\n", 1)[0]
        words = re.findall(r"^\.(?:BR|RB) \(? ?([a-z_*]+) \)?[,:]", paragraph, re.M)
        return {k for k in UNIT_KEYS for w in words if re.fullmatch(w.replace("*", "[a-z_]*"), k)}

    by_class = {c: {k.name for k in UNIT_KEY_TABLE if k.change is c} for c in OnChange}
    assert named("restarted") == by_class[OnChange.RESTART]
    assert named("updated") == by_class[OnChange.SUPERVISION]
    assert "Changing\n.B instances\nadds or removes instances only" in section


@pytest.mark.parametrize("parent, keys", [("liveness", LIVENESS_KEYS), ("progress", PROGRESS_KEYS),
                                          ("sockets", SOCKET_KEYS), ("torch_distributed", TORCH_DISTRIBUTED_KEYS)])
def test_the_keys_of_each_nested_table_are_documented_in_its_paragraph(parent: str, keys: tuple[str, ...]):
    """From the key's tag to the next tag of another key of the table."""
    after = MAN.split("\n.SH KEYS\n", 1)[1].split(f"\n.TP\n.B {parent}\n", 1)[1]
    others = "|".join(k for k in UNIT_KEYS if k != parent)
    paragraph = re.split(rf"\n\.T[PQ]\n\.BR? (?:{others})\b|\n\.SH ", after, maxsplit=1)[0]
    for key in keys:
        assert re.search(rf'(^\.BR? |\\fB|[{{,] ){key}\b', paragraph, re.M), f"{parent}.{key} is not documented"


def _unit_examples() -> list[str]:
    """The unit files shown in omnid.unit(5) (its .EX blocks that set `exec`), as plain text."""
    blocks = re.findall(r"^\.EX\n(.*?)^\.EE", MAN, re.S | re.M)
    plain = [b.replace("\\-", "-").replace("\\(aq", "'").replace("\\(dq", '"').replace("\\e", "\\") for b in blocks]
    return [p for p in plain if re.search(r"^exec = ", p, re.M)]


@pytest.mark.parametrize("text", _unit_examples(), ids=lambda t: t.splitlines()[0][:40])
def test_every_unit_file_the_man_page_shows_is_one_omnid_accepts(text: str):
    """What a reader copies from omnid.unit(5) must load (two examples once spread an inline
    table over lines, which TOML does not allow)."""
    import tomllib

    raw = tomllib.loads(text)
    deps = {d for key in ("after", "requires") for d in raw.get(key, [])}
    errors = check_stack(make_stack({"example": text, **{d: 'exec = ["true"]\n' for d in deps}}))
    assert not errors, errors


def test_the_man_page_shows_unit_files():
    assert len(_unit_examples()) >= 4
