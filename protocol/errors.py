"""Error codes shared by every process, and the exceptions that carry them."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_REQUEST = "invalid_request"
    TOO_LONG = "too_long"  # can never fit the pool or the model's context
    UNSUPPORTED = "unsupported"
    OVERLOADED = "overloaded"
    ABORTED = "aborted"
    WORKER_FAILED = "worker_failed"
    UNAVAILABLE = "unavailable"  # the server went away: nothing heard from it, not even keepalives
    TIMEOUT = "timeout"  # the client's own timeout passed first; it aborted the request
    INTERNAL = "internal"


class RequestError(Exception):
    """A request failed; `code` is one of ErrorCode's values, `message` is for a human."""

    def __init__(self, code: str | ErrorCode, message: str, request_id: str | None = None):
        self.code = ErrorCode(code).value if code in ErrorCode._value2member_map_ else str(code)
        self.message = message
        self.request_id = request_id
        super().__init__(f"{self.code}: {message}")


class ProtocolError(RequestError):
    """A message that cannot be decoded or does not match its schema."""

    def __init__(self, message: str, code: str | ErrorCode = ErrorCode.INVALID_REQUEST):
        super().__init__(code, message)
