"""Python fallback for bench/child.c (same flags, same stamp files).

    python child.py -s STAMPDIR [-d DELAY_MS] [-i] [-g] [-m MAX_SEC]

Used when gcc is not available (or with --child python). Spawn figures with it
include the interpreter's start-up (~20 ms), so they are not comparable with
figures taken with the C child; the results JSON records which one ran.
Standard library only: it runs under whatever interpreter the harness uses.
"""
import os
import signal
import sys
import time

T0 = time.monotonic_ns()


def main() -> int:
    args = sys.argv[1:]
    stamp_dir = None
    delay_ms = 0
    ignore = grandchild = False
    max_sec = 3600
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-s":
            stamp_dir = args[i + 1]; i += 2
        elif a == "-d":
            delay_ms = int(args[i + 1]); i += 2
        elif a == "-m":
            max_sec = int(args[i + 1]); i += 2
        elif a == "-i":
            ignore = True; i += 1
        elif a == "-g":
            grandchild = True; i += 1
        else:
            print(f"child.py: unknown argument {a!r}", file=sys.stderr)
            return 2

    def stamp(kind: str, ns: int) -> None:
        if stamp_dir:
            fd = os.open(f"{stamp_dir}/{kind}.{os.getpid()}.{ns}",
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            os.close(fd)

    # SIGTERM stays blocked and is taken with sigwaitinfo: no lost wake-up.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.alarm(max_sec)
    stamp("s", T0)

    if grandchild:
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                t = time.monotonic_ns()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                signal.alarm(max_sec)
                stamp("g", t)
                while True:
                    signal.pause()
            os._exit(0)
        os.waitpid(pid, 0)

    while True:
        signal.sigwaitinfo({signal.SIGTERM})
        stamp("t", time.monotonic_ns())
        if not ignore:
            if delay_ms > 0:
                time.sleep(delay_ms / 1000)
            os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
