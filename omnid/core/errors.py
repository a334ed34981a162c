"""The core's refusals: what the supervisor answers instead of doing what it was asked
(an operator request overtaken by another, a reload while one runs or while the stack
stops). Each carries a code and a message that names the reason; the interfaces say it
in their own form (the control socket: an error reply with this code and message,
omnid.api.handlers). The core never raises an interface's error type."""

from __future__ import annotations


class RequestRefused(Exception):
    """A request the core will not carry out: `code` (a word, omnid-control(7)'s error
    codes) and `message`, never empty."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message or code)
        self.code = code
        self.message = message or code
