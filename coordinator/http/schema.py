"""The request bodies of the OpenAI API as siding accepts them, and what they become: the
options of `build_generate`, the sampling ones as `SamplingParams`.

Fields are checked strictly (no strings for numbers) and unknown fields are refused, so a typo
is an error rather than a silently ignored knob; the sampling fields' bounds are
`SamplingParams`' own, checked as the body is mapped onto it. Fields OpenAI defines that
siding cannot honour (log probabilities, penalties, tools, ...) are refused with `unsupported`
when they ask for something, and accepted at their neutral values. siding's own fields
(`priority`, `ignore_eos`, `top_k`, `stop_token_ids`, `return_token_ids`) ride in the same body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import ProtocolError
from protocol.messages import MAX_PRIORITY
from protocol.sampling import SamplingParams, sampling_params

from .errors import ApiError, unsupported


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float | None = None  # None: OpenAI's default, 1
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # the fair queue shares between users
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # siding's own
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    ignore_eos: bool | None = None
    top_k: int | None = None  # 0 or -1: off
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    def refuse_unsupported(self) -> None:
        if self.presence_penalty:
            raise unsupported("presence_penalty")
        if self.frequency_penalty:
            raise unsupported("frequency_penalty")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true",
                           "invalid_request", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def options(self, max_tokens: int | None, user: str | None) -> dict[str, Any]:
        """`build_generate`'s options, but for the prompt."""
        return {"user": user, "priority": self.priority, "stream": self.stream,
                "sampling": self.sampling(max_tokens)}

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The body's sampling fields as siding's; an ApiError names one out of its bounds."""
        try:
            return sampling_params(
                max_tokens=max_tokens, temperature=1.0 if self.temperature is None
                else self.temperature, top_p=self.top_p, n=self.n, seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                top_k=0 if self.top_k == -1 else self.top_k)
        except ProtocolError as e:
            raise ApiError(400, e.message, "invalid_request", e.field) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise unsupported("logprobs")
        if self.echo:
            raise unsupported("echo")
        if self.best_of not in (None, 1, self.n):
            raise unsupported("best_of")
        if self.suffix:
            raise unsupported("suffix")

    def prompts(self) -> list[dict[str, Any]]:
        """One `build_generate` prompt option per prompt in the body."""
        p = self.prompt
        if isinstance(p, str):
            return [{"prompt": p}]
        if not p:
            raise ApiError(400, "prompt must not be empty", "invalid_request", "prompt")
        if isinstance(p[0], str):
            return [{"prompt": s} for s in p]
        if isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        return [{"prompt_token_ids": ids} for ids in p]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise unsupported("logprobs")
        if self.top_logprobs is not None:
            raise unsupported("top_logprobs")
        if self.tools:
            raise unsupported("tools")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise unsupported("response_format")

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens`, or the older `max_tokens`; None: up to the context."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
