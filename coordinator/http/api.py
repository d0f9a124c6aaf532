"""The OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health` and `/metrics` (the engine core's exposition, unauthenticated as vLLM's), as a
Starlette app.

Each HTTP request becomes one siding request per prompt, sent through an `AsyncClient` to the
frontend it runs in, so validation, admission, text, stop strings and `n` are the ZeroMQ
path's, byte for byte. Streams are server-sent events ending in `data: [DONE]`, with no SSE
comments unless `--sse-keepalive` asks for them (some clients lose the events after one). A client
that goes away, streaming or not, has its requests aborted: a stream hears of it from Starlette,
which listens for `http.disconnect` while it streams, so no write is needed to notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol.async_client import AsyncClient, get_within
from protocol.client import build_generate
from protocol.errors import ErrorCode, RequestError
from protocol.messages import Chunk, Generate, Result, Serve
from protocol.metrics_http import read_exposition

from ..admission import check_fits, prompt_ids
from ..text import TextCodec
from .errors import ApiError
from .schema import ChatRequest, CompletionRequest

MAX_BODY_BYTES = 32 << 20  # a request body past this gets 413 before it is parsed
FIRST_REPLY_SECONDS = 1.0  # a stream waits this long for admission errors before its 200


class Api:
    def __init__(self, client: AsyncClient, serve: Serve, api_key: str | None,
                 keepalive: float | None, metrics_socket: str | None = None):
        self.client = client
        self.metrics_socket = metrics_socket  # where the engine core serves its exposition
        self.keepalive = keepalive  # seconds of silence before a stream's SSE comment
        self.serve = serve
        self.codec = TextCodec(serve.model)
        self.api_key = api_key
        self.model = serve.model.name
        self.created = int(time.time())
        # codes of the requests refused here, for the frontend's loop to report as it reports
        # its own (a deque: appended on this thread, taken on that one)
        self.refused: deque[str] = deque()

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
            Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._endpoint(self.model_info), methods=["GET"]),
            Route("/health", self._endpoint(self.health, auth=False), methods=["GET"]),
        ]
        if self.metrics_socket is not None:
            routes.append(Route("/metrics", self._endpoint(self.metrics, auth=False),
                                methods=["GET"]))
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]],
                  auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                if auth:
                    self._authorize(request)
                return await handler(request)
            except ApiError as e:
                if e.code != ErrorCode.ABORTED.value:  # a client gone: the core counts aborts
                    self.refused.append(e.counted_as)
                return e.response()
            except RequestError as e:  # the frontend's refusal, counted there
                return ApiError.of(e).response()
        return run

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                           "invalid_api_key", kind="authentication_error")

    # ---- routes -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        body.refuse_unsupported()
        options = body.options(body.max_tokens, _user(request, body))
        msgs = [build_generate(**prompt, **options) for prompt in body.prompts()]
        return await self._respond(request, body, msgs, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await _parse(request, ChatRequest)
        self._check_model(body.model)
        body.refuse_unsupported()
        messages = [m.as_template_input() for m in body.messages]
        limit = body.token_limit
        msg = build_generate(messages=messages, **body.options(limit or 1, _user(request, body)))
        if limit is None:  # as many tokens as the context and the pool leave
            s = self.serve
            msg.prompt_token_ids, msg.messages = prompt_ids(msg, self.codec), None
            room = min(s.model.max_context, s.kv_pages * s.page_size)
            msg.sampling = msgspec.structs.replace(
                msg.sampling, max_tokens=max(1, room - len(msg.prompt_token_ids)))
            try:  # refused here, before a message past the wire's limits fails the connection
                check_fits(msg.prompt_token_ids, msg, s.model, s.kv_pages, s.page_size)
            except RequestError as e:  # that every HTTP call of this frontend shares
                raise ApiError.of(e) from None
        return await self._respond(request, body, [msg], chat=True)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """200 when every worker is up and loaded and the cluster takes requests; else 503."""
        try:
            s = await asyncio.wait_for(self.client.status(), 5.0)
        except RequestError as e:  # the frontend takes the core as down: it says why
            return _unhealthy(e.message)
        except asyncio.TimeoutError:
            return _unhealthy("the engine core does not answer")
        if s.get("failed"):
            return _unhealthy(s["failed"])
        expected = s["config"]["workers"]
        if s["workers_up"] < expected:  # dead, or (re)loading: a restart empties the list
            down = [str(w["rank"]) for w in s["workers"] if not w["alive"]]
            return _unhealthy(f"{s['workers_up']} of {expected} workers up" + (
                f" (worker {', '.join(down)} down)" if down else " (loading)"))
        if s.get("draining"):
            return _unhealthy("draining: the cluster is shutting down")
        return JSONResponse({"status": "ok", "workers_up": s["workers_up"]})

    async def metrics(self, request: Request) -> Response:
        """The engine core's exposition, as its metrics port serves it (the frontends count
        nothing of their own: what only they see reaches the core in `REPORT`s)."""
        try:
            content_type, body = await asyncio.wait_for(
                read_exposition(self.metrics_socket, request.headers.get("accept", "")), 5.0)
        except (OSError, EOFError, asyncio.TimeoutError):
            return _unhealthy("the engine core does not answer")
        return Response(body, headers={"content-type": content_type})

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "siding", "max_model_len": self.serve.model.max_context}

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server has "
                           f"{self.model!r}", "model_not_found", "model")

    # ---- responses --------------------------------------------------------------------------

    async def _respond(self, request: Request, body: BaseModel, msgs: list[Generate],
                       chat: bool) -> Response:
        shape = Shape(body, chat, msgs[0], self.model, self.serve.exact, self.keepalive)
        calls = Calls(self.client, msgs)
        try:
            if not body.stream:
                return JSONResponse(shape.response(await _unless_gone(request, calls.results())))
            # Admission errors come at once: they get their status, not a 200 stream.
            first = await calls.next(FIRST_REPLY_SECONDS)
        except BaseException:
            await calls.close()
            raise
        return StreamingResponse(shape.events(calls, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


class Shape:
    """One HTTP call's responses in OpenAI's shapes: completions or chat, whole or chunked."""

    def __init__(self, body: Any, chat: bool, first: Generate, model: str, exact: bool,
                 keepalive: float | None):
        self.body = body
        self.keepalive = keepalive
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + first.request_id
        self.object = "chat.completion" if chat else "text_completion"
        self.model = model
        self.exact = exact
        self.created = int(time.time())
        self.n = first.sampling.n

    def response(self, results: list[Result]) -> dict:
        choices = []
        for p, r in enumerate(results):
            for c in r.choices:
                choice: dict[str, Any] = {"index": p * self.n + c.index}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": c.text}
                else:
                    choice["text"] = c.text
                choice["logprobs"] = None
                choice["finish_reason"] = c.finish_reason
                if self.body.return_token_ids:
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": _usage(results),
                "siding": self._extension(results)}

    async def events(self, calls: Calls, first: Any) -> AsyncIterator[bytes]:
        results: dict[int, Result] = {}
        opened = not self.chat
        try:
            item = first
            while item is not END:
                if item is None:
                    if self.keepalive is not None:
                        yield b": keepalive\n\n"
                elif isinstance(item[1], Result):
                    results[item[0]] = item[1]
                elif item[1].token_ids or item[1].finish_reason:  # not the frontend's keepalive
                    if not opened:  # each choice opens with its role when the first tokens
                        opened = True  # come, as vLLM's do: clients time the first token by it
                        for i in range(self.n):
                            yield self._chunk(i, {"role": "assistant", "content": ""})
                    if item[1].text or item[1].finish_reason or self.body.return_token_ids:
                        yield self._content(item[0] * self.n + item[1].index, item[1])
                item = await calls.next(self.keepalive)
            if self.body.include_usage:
                done = [results[p] for p in sorted(results)]
                yield _event({"id": self.id, "object": self._chunk_object, "created":
                              self.created, "model": self.model, "choices": [],
                              "usage": _usage(done), "siding": self._extension(done)})
        except RequestError as e:  # after the 200: the error rides in the stream
            yield _event(ApiError.of(e).body())
        finally:
            await calls.close()
        yield b"data: [DONE]\n\n"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _content(self, index: int, chunk: Chunk) -> bytes:
        if self.chat:
            return self._chunk(index, {"content": chunk.text} if chunk.text else {},
                               chunk.finish_reason, chunk.token_ids)
        return self._chunk(index, chunk.text, chunk.finish_reason, chunk.token_ids)

    def _chunk(self, index: int, new: Any, finish_reason: str | None = None,
               token_ids: list[int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = new
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if self.body.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        out = {"id": self.id, "object": self._chunk_object, "created": self.created,
               "model": self.model, "choices": [choice]}
        if self.body.include_usage:
            out["usage"] = None
        return _event(out)

    def _extension(self, results: list[Result]) -> dict:
        out: dict[str, Any] = {"exact": self.exact, "preemptions": sum(
            c.preemptions for r in results for c in r.choices)}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = [r.prompt_token_ids for r in results]
        return out


# ---- replies ----------------------------------------------------------------------------------

END = object()  # every request of the call has its Result


class Calls:
    """Several requests in flight for one HTTP call, their replies as one queue of (prompt
    index, Chunk or Result). `close` aborts whatever still runs."""

    def __init__(self, client: AsyncClient, msgs: list[Generate]):
        self.left = len(msgs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(client, p, m)) for p, m in enumerate(msgs)]

    async def _pump(self, client: AsyncClient, p: int, msg: Generate) -> None:
        try:
            async with contextlib.aclosing(client.replies(msg)) as replies:
                async for reply in replies:
                    self.queue.put_nowait((p, reply))
        except RequestError as e:
            self.queue.put_nowait((p, e))

    async def next(self, timeout: float | None) -> Any:
        """The next reply; None if there is none within `timeout` (None: no limit), END after
        the last Result. A request's error raises."""
        if not self.left:
            return END
        try:
            item = await get_within(self.queue, timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item[1], RequestError):
            raise item[1]
        self.left -= isinstance(item[1], Result)
        return item

    async def results(self) -> list[Result]:
        results: list[Any] = [None] * len(self.tasks)
        while (item := await self.next(None)) is not END:
            if isinstance(item[1], Result):
                results[item[0]] = item[1]
        return results

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s value, or 499 (its requests aborted) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ApiError(499, "the client went away; its requests were aborted",
                   ErrorCode.ABORTED.value)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- bodies and JSON --------------------------------------------------------------------------


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large()
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        parts.append(part)
    try:
        return model.model_validate_json(b"".join(parts))
    except ValidationError as e:
        raise _invalid(e) from None


def _too_large() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB",
                    "request_too_large")


def _invalid(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err['msg']}", "invalid_json")
    loc = [str(x) for x in err["loc"] if not _is_type_tag(x)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}", "invalid_request", param)
    if err["type"] == "missing":
        return ApiError(400, f"{param} is required", "invalid_request", param)
    message = f"{param}: {err['msg']}" if param else f"the body: {err['msg']}"
    return ApiError(400, message, "invalid_request", param)


def _is_type_tag(part: Any) -> bool:
    """pydantic names a union's member in the error's location (`str`, `list[int]`)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part[:1].isupper())


def _user(request: Request, body: Any) -> str | None:
    """Whom the fair queue counts a call for: its `user`, else the address it came from."""
    if body.user is not None:
        return body.user
    return None if request.client is None else f"http:{request.client.host}"


def _usage(results: list[Result]) -> dict:
    prompt = sum(r.usage.prompt_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + \
        b"\n\n"


def _unhealthy(reason: str) -> Response:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    code).response()
