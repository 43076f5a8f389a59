"""Request bodies of the OpenAI API (the fields this server honours) and the response/chunk shapes.

Unknown fields are accepted and ignored, as OpenAI clients send many optional ones; fields whose non-default
values this server cannot honour (n > 1, logprobs, penalties, echo, best_of) are refused with a 400 that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import bad_request


class Speculation(BaseModel):
    """Per-request extension: `"speculation": {"method": "prompt-lookup", "k": "auto"}` or `false` (plain)."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    k: int | Literal["auto"] | None = Field(None)

    @field_validator("k")
    @classmethod
    def _k(cls, k):
        if isinstance(k, int) and k < 0:
            raise ValueError("k must be 'auto' or an integer >= 0")
        return k


class StreamOptions(BaseModel):
    include_usage: bool = False


class Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # other OpenAI fields (user, metadata, ...) are ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    # extensions
    speculation: Speculation | bool | None = None
    top_k: int | None = Field(None, ge=0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise bad_request(f"n must be 1 (got {self.n}): this server returns one choice per request; "
                              "send several requests for several choices", param="n")
        if self.logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported (it would change the target distribution)", param=name)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(BaseModel):
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise bad_request("only text content parts are supported", param="messages")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of must be 1", param="best_of")

    @property
    def limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request("one prompt per request: send several requests for several prompts",
                                  param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        return prompt  # type: ignore[return-value]  # a list of lists was refused above


GenerationRequest = ChatRequest | CompletionRequest  # what a route hands to the server
Parsed = TypeVar("Parsed", bound=Common)


def parse(cls: type[Parsed], body: object) -> Parsed:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{loc}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) from None
    req.check_supported()
    return req


# ------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def choice(kind: str, text: str | None, finish_reason: str | None, *, stream: bool, first: bool = False) -> dict:
    if kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    delta: dict = {} if text is None else {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict], *, stream: bool,
             usage: dict | None = None, with_usage: bool = False) -> dict:
    obj = {"chat": "chat.completion", "completion": "text_completion"}[kind]
    if stream and kind == "chat":
        obj = "chat.completion.chunk"
    out = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
           "choices": choices}
    if not stream or with_usage:
        out["usage"] = usage
    return out
