"""Title runner for Python units (omnid.unit(5), key `title`).

Run as a *script* by the unit's own interpreter (which may not have omnid
installed): `python /path/to/runner.py TITLE -m MODULE ARGS...` or
`python /path/to/runner.py TITLE SCRIPT ARGS...`. It sets the process title, then
hands over to the module or script unchanged: same sys.argv as a direct run,
`__name__ == "__main__"`, same sys.path[0]. Stdlib only, plus setproctitle when
the interpreter has it (else the 15-character kernel name via prctl).
"""

import os
import sys


def _set_title(title: str) -> None:
    try:
        from setproctitle import setproctitle

        setproctitle(title)
        return
    except ImportError:
        pass
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main() -> None:
    if len(sys.argv) < 3:
        sys.stderr.write("usage: runner.py TITLE (-m MODULE | SCRIPT) [ARGS...]\n")
        sys.exit(2)
    title = sys.argv[1]
    rest = sys.argv[2:]
    # Undo what running this file as a script did to sys.path[0] (omnid's own
    # package directory), so the unit never imports our modules by accident.
    if rest[0] == "-m":
        sys.path[0] = os.getcwd()
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
    if title:
        _set_title(title)
    # stdout is a pipe to the daemon: Python would block-buffer it and print() would
    # reach `omnid logs` only at exit. Line-buffer it, as on a terminal, whatever the
    # daemon's own environment says about PYTHONUNBUFFERED.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    import runpy

    if rest[0] == "-m":
        if len(rest) < 2:
            sys.stderr.write("runner.py: -m needs a module name\n")
            sys.exit(2)
        sys.argv = [rest[1], *rest[2:]]  # runpy puts the module's path in argv[0]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
