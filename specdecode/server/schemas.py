"""Request bodies of the OpenAI API (the fields this server honours) and the response/chunk shapes.

Fields outside these models are screened by fields.py first: harmless ones are dropped, unsupported ones are
accepted only with their neutral value (`n: 1`, `logprobs: false`, ...) and anything else is a 400 naming the
field. The models themselves forbid extra fields, so nothing can slip through unread.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Collection
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ..common.method_options import all_options
from ..core.sampling import MIN_REPETITION_PENALTY
from ..engine.request import MAX_LOGPROBS, TokenLogprob
from .errors import bad_request
from .fields import screen, unknown

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # a stop string is held back from a stream until it cannot match: keep that short
MAX_K = 64  # guesses per step a request may fix (a draft model proposes them one forward at a time)
MAX_OPTION = 64  # the largest value of a request's method option (each sizes a step's proposing work)
MAX_LOGIT_BIAS = 300  # as OpenAI
MAX_STOP_TOKEN_IDS = 64
MAX_GRAMMAR_CHARS = 8192  # a regular expression's length
MAX_CHOICES = 256
MAX_N = 16
MAX_TEMPLATE_CHARS = 65536


class Strict(BaseModel):
    """No unknown field, and no conversion: `true` is not the integer 1 and "5" is not 5 (a client that sends
    either has a bug it should hear about)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculationBase(Strict):
    """Per-request extension: `"speculation": {"method": "prompt-lookup", "k": "auto", "max_ngram": 2}` or `false`
    (plain). Besides the method and k, the method options a request may set (common/method_options.py,
    `per_request`): one field each, generated below; None leaves the method's default."""

    method: str | None = None
    k: int | Literal["auto"] | None = Field(None)

    @field_validator("k")
    @classmethod
    def _k(cls, k):
        if isinstance(k, int) and not 0 <= k <= MAX_K:
            raise ValueError(f"k must be 'auto' or an integer in [0, {MAX_K}]")
        return k

    def options(self) -> dict[str, Any]:
        """The method options this request sets."""
        return {name: value for name in PER_REQUEST if (value := getattr(self, name)) is not None}


PER_REQUEST = {o.name: o for o in all_options().values() if o.per_request}
if any(type(o.default) not in (int, type(None)) for o in PER_REQUEST.values()):
    raise TypeError("a per-request method option that is not a count needs its own field type here")
_OPTION_FIELDS: dict[str, Any] = {
    name: (int | None, Field(None, ge=1, le=MAX_OPTION, description=f"{', '.join(o.methods)}: {o.help}"))
    for name, o in PER_REQUEST.items()}
Speculation = create_model("Speculation", __base__=SpeculationBase, **_OPTION_FIELDS)


class JsonSchema(Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {name, schema}")
        return self


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class Common(Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # the target's logits processed by what was generated (processing.py), with each draft-tree node's own history
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI sends it: a string) -> bias in [-100, 100]
    # extensions (vLLM's names)
    speculation: Speculation | bool | None = None  # type: ignore[valid-type]
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10)
    min_tokens: int | None = Field(None, ge=0)  # at most max_tokens (checked against the model: app.build_row)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1, le=MAX_N)  # choices: one prefill, n rows of the batch
    # structured output (grammar.py): OpenAI's response_format, or vLLM's guided_* fields (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)

    def structured(self) -> tuple[str, dict] | None:
        """(the field that asked, what the output must follow as LLM.generate's `structured` takes it), or None:
        free text."""
        asked = {name: value for name, value in (("response_format", self.response_format),
                 ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                 ("guided_choice", self.guided_choice)) if value is not None}
        if isinstance(self.response_format, ResponseFormat) and self.response_format.type == "text":
            asked.pop("response_format")
        if len(asked) > 1:
            raise bad_request(f"ask for one structured output at a time, got {', '.join(asked)}",
                              param=next(iter(asked)))
        if not asked:
            return None
        name, value = asked.popitem()
        if name == "response_format":
            return name, {"json": value.json_schema.schema_ if value.json_schema else True}
        if name == "guided_json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise bad_request("guided_json must be a JSON schema (an object, or a string holding one)",
                                      param=name) from None
            return name, {"json": value if isinstance(value, dict) else True}
        return name, {"regex": value} if name == "guided_regex" else {"choice": value}

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
        out = {}
        for key, value in bias.items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids (strings of digits), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
            out[key] = value
        return out

    def token_ids(self, vocab: int) -> tuple[dict[int, float], list[int]]:
        """(logit_bias by token id, stop_token_ids), checked against the vocabulary's size."""
        bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        for name, ids in (("logit_bias", bias), ("stop_token_ids", self.stop_token_ids or [])):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise bad_request(f"{name} names token {outside[0]}, outside the vocabulary of {vocab} tokens",
                                  param=name)
        return bias, list(self.stop_token_ids or [])

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        for s in stops:
            if not 0 < len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters (got {len(s)})")
        return stop

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(Strict):
    type: str
    text: str | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted; the chat template decides whether it shows

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise bad_request("only text content parts are supported", param="messages")
        return "".join(p.text or "" for p in self.content)


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # the chat template (vLLM's fields): a request's own template only where the server trusts them
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # 0: the chosen tokens' only

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

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


class TokenizeCompletion(Strict):
    """vLLM's /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    """vLLM's /tokenize with messages (rendered by the model's chat template, the assistant's turn opened)."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: Literal[True] = True
    return_token_strs: bool = False

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class Detokenize(Strict):
    model: str | None = None
    tokens: list[int]


Validated = TypeVar("Validated", bound=BaseModel)


def validate(cls: type[Validated], body: object) -> Validated:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        # an unknown nested field says more than "not a boolean" from the other member of a union
        first = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        path = [p for p in first["loc"] if not is_union_tag(p)]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        if first["type"] == "extra_forbidden":
            nested = {f for m in (Speculation, StreamOptions, Message, TextPart) for f in m.model_fields}
            raise unknown(loc, nested | set(cls.model_fields)) from None
        if not path:  # a check of the whole request (a model validator): its message names the field first
            message = first["msg"].removeprefix("Value error, ")
            raise bad_request(message, param=named_field(message, cls.model_fields)) from None
        raise bad_request(f"{loc}: {first['msg']}", param=str(path[0])) from None


def named_field(message: str, fields: Collection[str]) -> str | None:
    """The first of `fields` that a message names (its words as written), else None."""
    return next((word for word in re.findall(r"[a-z_]+", message) if word in fields), None)


def is_union_tag(part: str | int) -> bool:
    """pydantic names the member of a union in an error's location: `Speculation`, `bool`, `list[str]`..."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in ("bool", "int", "str", "float"))


GenerationRequest = ChatRequest | CompletionRequest  # what a route hands to the server
RequestType = type[ChatRequest] | type[CompletionRequest]


def parse(cls: RequestType, body: object) -> GenerationRequest:
    """A chat or completion request: fields screened (fields.py), then validated."""
    if isinstance(body, dict):
        body = screen(body, set(cls.model_fields), chat=cls is ChatRequest)
    return validate(cls, body)


def parse_tokenize(body: object) -> TokenizeCompletion | TokenizeChat:
    if isinstance(body, dict) and "messages" in body:
        return validate(TokenizeChat, body)
    return validate(TokenizeCompletion, body)


def request_body(*models: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that reads its JSON body itself (validated by one of `models`), so that
    /docs shows it and a fuzzer generates it."""
    bodies = [inline(model.model_json_schema()) for model in models]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


def inline(schema: dict) -> dict:
    """A JSON schema with its `$defs` written in place of their `$ref`s (no model here refers to itself)."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    return resolve(schema)


# ------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def choice(kind: str, text: str | None, finish_reason: str | None, *, stream: bool, first: bool = False,
           logprobs: list[dict] | None = None, offset: int = 0, index: int = 0) -> dict:
    """One choice; logprobs: entries as `logprob_entries` makes them (None: not asked for), shaped as the route's
    API wants them; offset: characters of text the stream sent before this choice's (completions' text_offset)."""
    if kind == "completion":
        return {"index": index, "text": text or "", "logprobs": None if logprobs is None else
                completion_logprobs(logprobs, offset), "finish_reason": finish_reason}
    chat_logprobs = None if logprobs is None else {"content": logprobs, "refusal": None}
    if not stream:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": chat_logprobs,
                "finish_reason": finish_reason}
    delta: dict = {} if text is None else {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": index, "delta": delta, "logprobs": chat_logprobs, "finish_reason": finish_reason}


def merge_usage(usages: list[dict]) -> dict:
    """One response's usage from its choices': the prompt counted once, the rest added up (the estimated speedup:
    the mean of those priced)."""
    if len(usages) == 1:
        return usages[0]
    out = dict(usages[0])
    for key in ("completion_tokens", "drafted", "accepted", "target_forwards"):
        out[key] = sum(u[key] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    out["tau"] = round(out["completion_tokens"] / out["target_forwards"], 4) if out["target_forwards"] else 0.0
    out["acceptance_rate"] = round(out["accepted"] / out["drafted"], 4) if out["drafted"] else 0.0
    priced = [u["estimated_speedup"] for u in usages if u["estimated_speedup"] is not None]
    out["estimated_speedup"] = round(sum(priced) / len(priced), 4) if priced else None
    return out


def logprob_entries(logprobs: list[TokenLogprob], token_text) -> list[dict]:
    """Chat's per-token entries (token, logprob, bytes, top_logprobs); token_text(ids) -> each id's text."""
    texts = token_text([t.token for t in logprobs] + [alt for t in logprobs for alt, _ in t.top])
    chosen, alternatives = texts[: len(logprobs)], iter(texts[len(logprobs):])

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(text, t.logprob), "top_logprobs": [entry(next(alternatives), lp) for _, lp in t.top]}
            for text, t in zip(chosen, logprobs, strict=True)]


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The completions API's shape of the same entries: parallel lists, alternatives as {token: logprob}."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


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
