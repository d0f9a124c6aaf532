"""Errors as the OpenAI API shapes them: `{"error": {"message", "type", "param", "code"}}`, with
the HTTP status each of siding's error codes maps to."""

from __future__ import annotations

from starlette.responses import JSONResponse

from protocol.errors import ErrorCode, RequestError

# siding's code -> (HTTP status, OpenAI's error type)
STATUS = {
    ErrorCode.INVALID_REQUEST.value: (400, "invalid_request_error"),
    ErrorCode.TOO_LONG.value: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED.value: (400, "invalid_request_error"),
    ErrorCode.OVERLOADED.value: (503, "server_error"),
    ErrorCode.ABORTED.value: (503, "server_error"),  # the server is shutting down
    ErrorCode.WORKER_FAILED.value: (503, "server_error"),
    ErrorCode.UNAVAILABLE.value: (503, "server_error"),
    ErrorCode.TIMEOUT.value: (504, "server_error"),
    ErrorCode.INTERNAL.value: (500, "server_error"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def of(cls, error: RequestError, param: str | None = None) -> ApiError:
        status, kind = STATUS.get(error.code, (500, "server_error"))
        return cls(status, error.message, error.code, param, kind)

    @property
    def counted_as(self) -> str:
        """The error code the cluster's metrics count this refusal under: siding's own, or
        invalid_request for the HTTP layer's (invalid_json, model_not_found, ...)."""
        if self.code in ErrorCode._value2member_map_:
            return self.code
        return ErrorCode.INVALID_REQUEST.value

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unsupported(param: str) -> ApiError:
    return ApiError(400, f"{param} is not supported by siding", ErrorCode.UNSUPPORTED.value,
                    param)
