"""siding's wire protocol and client library."""

from .async_client import AsyncClient
from .client import Client, Completion, StreamChunk
from .errors import ErrorCode, ProtocolError, RequestError

__all__ = [
    "AsyncClient", "Client", "Completion", "StreamChunk", "ErrorCode", "ProtocolError",
    "RequestError",
]
