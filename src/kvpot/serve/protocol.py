"""Request bodies (pydantic) of the OpenAI-compatible API plus kvpot's own, and its error type.

Bodies are parsed by hand (`parse`), not by FastAPI's dependency injection, so that every
malformed request gets OpenAI's error JSON with status 400 and a sentence, never a 422 list.
Unknown fields are accepted and ignored, as OpenAI's clients send fields a server may not use.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 512  # per stop string: generous for any real stop sequence, cheap to match at every token


class ApiError(Exception):
    """An HTTP error in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 499: "cancelled", 500: "server_error",
             503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """What chat and text completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    document_id: str | None = None  # kvpot: answer from a stored document's state
    ignore_eos: bool = False  # kvpot (as vLLM): generate max_tokens even past an end-of-sequence token

    @field_validator("seed")
    @classmethod
    def _seed_in_64_bits(cls, seed: int | None) -> int | None:
        # any integer is a seed (OpenAI sets no range); reduced to the unsigned 64 bits torch seeds with
        return None if seed is None else seed % 2**64

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(400, f"stop takes up to {MAX_STOPS} non-empty strings.", param="stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string has {longest:,} characters; this server takes at most "
                                f"{MAX_STOP_CHARS}.", param="stop")
        return stops

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, "kvpot answers one choice per request; n must be 1.", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise ApiError(400, "presence and frequency penalties are not supported; leave them at 0.",
                           param="presence_penalty" if self.presence_penalty else "frequency_penalty")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream=true.", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool | None = None
    tools: list | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported.", param="logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported.", param="tools")

    def limit(self, default: int) -> int:
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return default if chosen is None else chosen


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, value, fine in (("echo", self.echo, False), ("logprobs", self.logprobs, None),
                                  ("suffix", self.suffix, None)):
            if value not in (fine, None) and value != fine:
                raise ApiError(400, f"{name} is not supported.", param=name)
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of must be 1.", param="best_of")

    def limit(self, default: int) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    def prompt_value(self) -> str | list[int]:
        """One prompt, as text or token ids (a batch of several is refused)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "kvpot answers one prompt per request; give a single prompt.", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ApiError(400, "the prompt is empty.", param="prompt")
        return prompt


class DocumentRequest(_Body):
    text: str = Field(min_length=1)
    method: str | None = None  # a method spec, e.g. "streaming:window=4092"; default: the server's


def parse(raw: bytes, kind: type[BaseModel]) -> BaseModel:
    """Parse and validate a JSON body, turning every failure into a 400 with one sentence."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body's JSON is nested too deeply.") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        raise ApiError(400, f"the body is not valid JSON ({err}).".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object.")
    bad = _unencodable(data)
    if bad is not None:
        raise ApiError(400, f"{bad}: the text holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text; "
                            "send valid UTF-8.", param=bad)
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApiError(400, f"{where}: {first['msg']}.", param=where) from None


def _unencodable(data) -> str | None:
    """The path of the first string that UTF-8 cannot encode (JSON's `\\ud800` escapes allow lone surrogates,
    which tokenizers refuse), or None. Iterative: nesting that `json.loads` accepted never recurses here."""
    stack = [("body", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            stack.extend((f"{k}" if where == "body" else f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))
    return None
