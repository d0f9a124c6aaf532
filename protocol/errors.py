"""Error codes shared by every process, and the exceptions that carry them."""

from __future__ import annotations

import re
from enum import Enum

import msgspec


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
    """A message that cannot be decoded or does not match its schema; `field` names the field
    at fault where one is."""

    def __init__(self, message: str, code: str | ErrorCode = ErrorCode.INVALID_REQUEST,
                 field: str | None = None):
        super().__init__(code, message)
        self.field = field


_AT = re.compile(r"(.*) - at `\$\.?((?:\w|\[).*)`", re.DOTALL)
_NAMED = re.compile(r"Object (contains unknown|missing required) field `(.*)`", re.DOTALL)


def invalid(e: msgspec.ValidationError, what: str | None = None) -> ProtocolError:
    """msgspec's words for a value that does not fit its type, the field named first:
    "field 'sampling.n': expected `int` <= 64", "unknown field 'choices[0].x'"; `what` (the
    message's type) names the whole where no field is at fault."""
    m = _AT.fullmatch(str(e))
    text, where = m.groups() if m else (str(e), "")
    if named := _NAMED.fullmatch(text):
        kind, name = named.groups()
        field = f"{where}.{name}" if where else name
        return ProtocolError(f"{'unknown' if kind[0] == 'c' else 'missing'} field {field!r}",
                             field=field)
    if not where:
        return ProtocolError(f"{what}: {text[:1].lower()}{text[1:]}" if what else text)
    return ProtocolError(f"field {where!r}: {text[:1].lower()}{text[1:]}", field=where)
