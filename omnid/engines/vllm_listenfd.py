"""Serve vLLM's OpenAI API server on the listening socket omnid passes (LISTEN_FDS, fd 3).

Why this path: SO_REUSEPORT beside the held socket sent 1,015 of 2,000 connects (measured) to the held one nobody accepts on,
and a proxy in front is one more process to supervise on every request's path; vLLM's own serve_http(sock=...) is neither.

Run with vLLM's own interpreter, as `python vllm_listenfd.py --model M [vLLM's arguments]`:
every argument goes to vLLM's own parser unchanged; only the socket is not vLLM's to bind.
It does what `python -m vllm.entrypoints.openai.api_server` does (cli_env_setup, the same
parser and checks, run_server_worker, serve_http) but for setup_server's bind: the socket is
the one the unit declares (`sockets = [{ listen = "127.0.0.1:8000" }]`), held by the daemon
across every crash and restart, so a client that connects between the old API server's
death and the new one's start waits in its backlog instead of being refused.

The first passed socket is the API's address; any others are served too (with `instances`:
the address the instances share first, each instance's own probe address second). A server
whose engine died stops accepting at once, so that on a shared socket the live instances
take every new connection.

Stdlib and vLLM only: omnid is not installed in vLLM's environment. Exit 2 with one line on
stderr (no traceback) when no usable socket was passed or an argument contradicts it.
"""

from __future__ import annotations

import os
import socket
import sys
import time

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): the first passed fd


def _fail(message: str) -> "NoReturn":  # noqa: F821 (typing is not worth an import here)
    print(f"vllm_listenfd: {message}", file=sys.stderr)
    raise SystemExit(2)


def passed_sockets(environ: dict[str, str] = os.environ) -> list[socket.socket]:
    """The listening stream sockets passed as systemd and omnid pass them (fds 3, 4, ...),
    with the LISTEN_* variables removed (sd_listen_fds(unset_environment=1)): vLLM's children
    must not take them for their own. Each fd is made close-on-exec: a child that outlives
    this process must not keep a socket (the daemon holds them)."""
    try:
        pid, count = int(environ.get("LISTEN_PID", "0")), int(environ.get("LISTEN_FDS", "0"))
    except ValueError:
        _fail(f"LISTEN_PID={environ.get('LISTEN_PID')!r} LISTEN_FDS={environ.get('LISTEN_FDS')!r}: "
              "expected numbers (as omnid or systemd set them)")
    names = environ.get("LISTEN_FDNAMES", "")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(var, None)
    if pid != os.getpid() or count < 1:
        _fail(f"no listening socket was passed (LISTEN_PID={pid or 'unset'}, LISTEN_FDS={count}, this pid "
              f"{os.getpid()}): declare it in the unit, e.g. sockets = [{{ listen = \"127.0.0.1:8000\" }}]")
    out = []
    for i, fd in enumerate(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count)):
        name = (names.split(":") + [""] * count)[i] or "unnamed"
        os.set_inheritable(fd, False)
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            _fail(f"fd {fd} ({name}) is not a socket: {exc.strerror}")
        if sock.type != socket.SOCK_STREAM or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
            sock.detach()
            _fail(f"fd {fd} ({name}) is not a listening stream socket (a `sockets` entry of the unit is; "
                  "stored fds are not for this launcher)")
        out.append(sock)
    return out


STOPPED_ACCEPTING = "the engine died: this API server stopped accepting"


def stop_accepting_when_the_engine_dies(interval: float = 0.02) -> None:
    """vLLM's watchdog (launcher.watchdog_loop) looks every 5 s; until then a server whose
    engine died keeps accepting, and answers 500. On a socket shared with other instances
    every such connection is a request another instance would have served: stop accepting
    within `interval` of vLLM's own monitor marking the engine dead (at once, by the engine
    process's sentinel); what was accepted fails fast as vLLM fails it."""
    import asyncio

    from vllm.entrypoints.launchers import launcher

    async def watchdog_loop(server, engine) -> None:
        while True:
            await asyncio.sleep(interval)
            if engine.errored and not engine.is_running:
                for listener in getattr(server, "servers", ()):
                    listener.close()  # this process's accepts stop; the socket stays held by omnid
                # When, on the host's monotonic clock: a connection begun after it waits for the
                # next server; one this server accepted before it gets vLLM's own 500.
                print(f"{STOPPED_ACCEPTING} (monotonic {time.monotonic():.3f})", file=sys.stderr, flush=True)
                launcher.terminate_if_errored(server, engine)
                return

    launcher.watchdog_loop = watchdog_loop


def serve_every_socket(extra: list[socket.socket]) -> None:
    """vLLM serves one socket (serve_http(sock=...)); uvicorn serves a list: the unit's other
    sockets (an instance's own probe address beside the shared one) join the list."""
    import uvicorn

    startup = uvicorn.Server.startup

    async def startup_all(self, sockets=None):
        return await startup(self, sockets=None if sockets is None else [*sockets, *extra])

    uvicorn.Server.startup = startup_all


def instance_cpus(allowed: set[int], instance: int, instances: int) -> set[int]:
    """Instance `instance` of `instances`: its block of the CPUs, in order, the blocks as even
    as they divide (5 CPUs, 2 instances: 0-2 and 3-4); fewer CPUs than instances: one each, in turn."""
    cpus = sorted(allowed)
    if len(cpus) < instances:
        return {cpus[instance % len(cpus)]}
    share, more = divmod(len(cpus), instances)
    start = instance * share + min(instance, more)
    return set(cpus[start:start + share + (instance < more)])


def one_cpu_block_per_instance(environ: dict[str, str] = os.environ) -> str | None:
    """vLLM's CPU build binds its Worker's OpenMP threads, and with them the whole Worker, to
    the first core(s) it may use (VLLM_CPU_OMP_THREADS_BIND=auto; the last one is left to
    EngineCore): N instances of one unit all compute on core 0. The Worker of an instance
    that restarts then imports torch and loads its weights on the core the survivors' Workers
    serve on (measured on this project's 2-core VM: the restart of a killed instance's tree
    took 5 min beside a serving one, past 480 s in 2 of 3 runs; its other core half idle).
    Instance i of N (omnid's OMNID_INSTANCE, OMNID_INSTANCES) runs on the i-th of N blocks of
    the CPUs it was given, set on itself before vLLM starts and inherited by EngineCore and
    Worker, whose auto binding then chooses within the block: one instance's start, load or
    hang takes no CPU from another. Not on a GPU (vLLM's CPU binding is the CPU build's
    alone), nor when VLLM_CPU_OMP_THREADS_BIND says anything but auto (the user placed it).
    What was set, for the log, or None."""
    try:
        instance, instances = int(environ.get("OMNID_INSTANCE", "0")), int(environ.get("OMNID_INSTANCES", "1"))
    except ValueError:
        return None
    if instances < 2 or not 0 <= instance < instances or environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    allowed = os.sched_getaffinity(0)
    mine = instance_cpus(allowed, instance, instances)
    for tid in os.listdir("/proc/self/task"):  # the threads vLLM's imports started too
        try:
            os.sched_setaffinity(int(tid), mine)
        except ProcessLookupError:
            pass  # ended meanwhile
    return (f"instance {instance} of {instances} runs on CPUs {','.join(map(str, sorted(mine)))} of "
            f"{','.join(map(str, sorted(allowed)))} (vLLM's CPU build binds every instance's Worker to the same "
            "cores otherwise; VLLM_CPU_OMP_THREADS_BIND set to a list turns this off)")


def listen_address(sock: socket.socket, ssl: bool) -> tuple[str, str | None, int | None]:
    """What vLLM logs and puts in its config: (address, host, port)."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}", None, None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    return f"http{'s' if ssl else ''}://{shown}:{port}", host, port


async def serve(args, sock: socket.socket, extra: list[socket.socket]) -> None:
    """vLLM's run_server with the passed socket in place of setup_server's bind."""
    import signal

    from vllm.entrypoints.launchers.api_server.entry import run_server_worker
    from vllm.entrypoints.launchers.launcher import validate_api_server_args
    from vllm.utils.system_utils import decorate_logs, set_ulimit

    decorate_logs("APIServer", skip_if_decorated=True)

    def _interrupt_init(*_) -> None:  # as run_server: a SIGTERM before uvicorn's handlers
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, _interrupt_init)
    # setup_server's work, but for the bind.
    from vllm.entrypoints.serve.utils.api_utils import log_non_default_args, log_version_and_model
    from vllm.logger import init_logger
    from vllm.reasoning import ReasoningParserManager
    from vllm.version import __version__ as vllm_version
    from vllm.tool_parsers import ToolParserManager

    logger = init_logger("vllm.entrypoints.launchers.launcher")
    log_version_and_model(logger, vllm_version, args.model)
    log_non_default_args(args)
    if args.tool_parser_plugin and len(args.tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.reasoning_parser_plugin and len(args.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)
    validate_api_server_args(args)
    set_ulimit()
    stop_accepting_when_the_engine_dies()
    if extra:
        serve_every_socket(extra)
    address, _host, _port = listen_address(sock, bool(args.ssl_keyfile and args.ssl_certfile))
    await run_server_worker(address, sock, args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock, *extra = passed_sockets()  # before vLLM's imports: a unit without one fails in ms, not 20 s

    import uvloop

    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    placed = one_cpu_block_per_instance()
    if placed:
        print(f"vllm_listenfd: {placed}", file=sys.stderr, flush=True)
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM's OpenAI API server on a passed socket"))
    args = parser.parse_args(argv)
    for opt in ("--uds", "--api-server-count", "--headless"):
        if any(a == opt or a.startswith(opt + "=") for a in argv):
            _fail(f"{opt}: not with a passed socket (one API server serves it; run vLLM itself for {opt})")
    _address, host, port = listen_address(sock, False)
    for opt, value in (("--host", host), ("--port", port)):
        given = [a for a in argv if a == opt or a.startswith(opt + "=")]
        if given and str(getattr(args, opt[2:])) != str(value):
            _fail(f"{opt} {getattr(args, opt[2:])} differs from the passed socket's {value}: "
                  f"leave {opt} out (the unit's `sockets` says where to listen)")
    args.host, args.port = host, port  # what vLLM logs and reports: the socket's own address
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(serve(args, sock, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
