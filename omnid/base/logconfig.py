"""structlog set-up: JSON lines for machines, console for people (ARCHITECTURE.md, "Dependencies").

With ``log_file`` (``omnid daemon --log-file``, set by ``omnid start``) the daemon's
stderr is that file, and it is rotated by size: beyond ``max_bytes`` it becomes
``log_file.1`` (one old file kept) and a new file, mode 0600, takes over fds 1 and 2,
so crash output that bypasses the logger lands in the current file too.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

LOG_MAX_BYTES = 8 << 20


class RotatingStderr:
    """A file-like object for structlog's PrintLogger: writes to fd 2, rotates by size."""

    def __init__(self, path: str, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0

    def write(self, text: str) -> int:
        n = sys.stderr.write(text)
        return n

    def flush(self) -> None:
        sys.stderr.flush()
        try:
            size = os.fstat(2).st_size
        except OSError:
            return
        if size > self.max_bytes:
            self.rotate()

    def rotate(self) -> None:
        try:
            os.replace(self.path, self.path + ".1")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # keep writing where we are rather than lose lines
            sys.stderr.write(f'{{"event": "cannot rotate the daemon log", "path": "{self.path}", '
                             f'"error": "{exc.strerror}", "level": "error"}}\n')
            return
        sys.stdout.flush()
        os.dup2(fd, 1, inheritable=False)
        os.dup2(fd, 2, inheritable=False)
        os.close(fd)
        self.rotations += 1


def configure(fmt: str = "console", level: int = logging.INFO, log_file: str | None = None,
              max_bytes: int = LOG_MAX_BYTES) -> None:
    renderer: structlog.types.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    out = RotatingStderr(log_file, max_bytes) if log_file else sys.stderr
    if log_file:
        try:
            os.chmod(log_file, 0o600)  # whatever created it: unit output may hold secrets
        except OSError:
            pass
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
