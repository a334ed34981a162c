"""The package's layers, read from its imports: each package imports only the ones below it,
no module imports another's private (underscore) names, and no modules import each other in a
circle. ARCHITECTURE.md draws the same picture; this test is what keeps it true."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

OMNID = Path(__file__).resolve().parent.parent / "omnid"

# Lowest first. A package may import its own modules and those of every lower floor; packages
# on one floor do not import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("base", "version"),
    ("model",),
    ("process",),
    ("gpu", "cluster", "forensics"),
    ("core",),
    ("api",),
    ("daemon",),
    ("cli",),
    ("__main__",),
)
# The reference stack runs as units, not as part of the daemon: it may use the leaf helpers and
# the GPU backend's public readers, nothing that supervises.
DEMO_MAY_IMPORT = {"demo", "base", "gpu", "version"}

RANK = {name: i for i, floor in enumerate(FLOORS) for name in floor}


def module_name(path: Path) -> str:
    rel = path.relative_to(OMNID.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module imported, names taken from it) for every omnid import in the file, lazy
    imports inside functions included (they load at run time just the same)."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "omnid"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "omnid":
                found.append((node.lineno, mod, [a.name for a in node.names]))
    return found


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(OMNID.rglob("*.py"))}


def is_extension(mod: str, name: str) -> bool:
    """A compiled module (omnid/process/_spawnc.c) is a module, not a private name."""
    return (OMNID.parent / mod.replace(".", "/") / f"{name}.c").is_file()


def top(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def resolve(mod: str, name: str, known: dict[str, Path]) -> str:
    """`from omnid.process import handle`: the module omnid.process.handle, else the package."""
    return f"{mod}.{name}" if f"{mod}.{name}" in known else mod


def test_every_module_stands_on_a_floor():
    # omnid.engines: launchers run by an engine's own interpreter, never imported (package data;
    # test_engine_vllm_socket.py checks they import nothing of omnid).
    stray = [m for m in modules() if m != "omnid" and top(m) not in RANK and top(m) not in ("demo", "engines")]
    assert not stray, f"modules outside every layer package (give each a package): {stray}"


def test_imports_point_down_only():
    known = modules()
    upward = []
    for me, path in known.items():
        mine = top(me)
        if not mine:
            continue
        for line, mod, names in imports(path):
            for target in {resolve(mod, n, known) for n in names} or {mod}:
                theirs = top(target)
                if not theirs or theirs == mine:
                    continue
                if mine == "demo":
                    ok = theirs in DEMO_MAY_IMPORT
                else:
                    ok = theirs in RANK and RANK[theirs] < RANK[mine]
                if not ok:
                    upward.append(f"{path.relative_to(OMNID.parent)}:{line} {me} -> {target}")
    assert not upward, "imports that point up a layer or across a floor:\n" + "\n".join(sorted(set(upward)))


def test_no_module_takes_another_modules_private_names():
    known = modules()
    private = []
    for me, path in known.items():
        for line, mod, names in imports(path):
            for n in names:
                if n.startswith("_") and f"{mod}.{n}" not in known and not is_extension(mod, n):
                    private.append(f"{path.relative_to(OMNID.parent)}:{line} {me} takes {mod}.{n}")
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_no_circle_of_imports():
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for me, path in known.items():
        for _, mod, names in imports(path):
            for target in {resolve(mod, n, known) for n in names} or {mod}:
                if target in known and target != me and not known[target].name == "__init__.py":
                    graph[me].add(target)
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(" -> ".join(c) for c in circles)


def everything_loaded_by(start: str, known: dict[str, Path]) -> dict[str, str]:
    """{module: the omnid module that imports it} for every module, omnid's or not, that
    loading `start` can load: its imports, lazy ones inside functions included, and theirs,
    with the packages on the way (importing omnid.a.b runs omnid/a/__init__.py)."""
    by: dict[str, str] = {}
    todo = [start]
    while todo:
        me = todo.pop()
        tree = ast.parse(known[me].read_text(), str(known[me]))
        package = me if known[me].name == "__init__.py" else me.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                mod = (".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""])
                       .rstrip(".") if node.level else node.module or "")
                found |= {resolve(mod, a.name, known) for a in node.names}
        for mod in found:
            parts = mod.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step not in by and step != start:
                    by[step] = me
                    if step in known:
                        todo.append(step)
    return by


def test_a_status_asked_before_the_health_api_is_up_never_loads_aiohttp():
    """The control socket's handlers run on the event loop. A `status` asked while the health
    API was still loading (right after the daemon's start, as every test and `omnid start`
    ask) once imported aiohttp there, through the health verdict: ~200 ms in which the loop
    saw no death, and the first answer came only after it. aiohttp is for the health API,
    which loads it in a thread (omnid.daemon.fronts)."""
    known = modules()
    by = everything_loaded_by("omnid.api.handlers", known)
    if "aiohttp" in by:
        chain, mod = ["aiohttp"], "aiohttp"
        while mod in by:
            mod = by[mod]
            chain.append(mod)
        pytest.fail("the control handlers load aiohttp on the event loop: " + " <- ".join(chain))
    assert "omnid.api.verdict" in by  # the walk does reach the verdict the handlers share with /health
