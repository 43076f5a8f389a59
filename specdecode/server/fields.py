"""Which request fields this server honours, which it refuses, and which typo a client probably made.

OpenAI answers a field it does not know with a 400 ("Unrecognized request argument"), and so do we: a client
that sends `max_tokenz` or `tools` must learn that it was not honoured, not get plain prose back.
Each field OpenAI or vLLM define falls in one of three groups:
- honoured: the pydantic models in schemas.py validate and use it;
- harmless: accepted and ignored, because it cannot change the output (`user`, `metadata`, ...);
- not supported yet: accepted only with its neutral value (`best_of: 1`, `bad_words: []`,
  `tools: null`, ...), since clients often send defaults explicitly; any other value is a 400 naming the field.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from .errors import APIError

Neutral = Callable[[Any], bool]


def _null(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _zero(v: Any) -> bool:
    return v is None or (not isinstance(v, bool) and v == 0)


def _one(v: Any) -> bool:
    return v is None or (not isinstance(v, bool) and v == 1)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


def _is(*values: Any) -> Neutral:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


CHANGES_DISTRIBUTION = "it changes the target's distribution, which the verifier does not apply yet"
STRUCTURED = ("this form of structured output is not supported: use response_format (json_object, json_schema) "
              "or guided_json, guided_regex, guided_choice")
TOOLS = "tool and function calling are not implemented; describe the tools in the prompt instead"
LOGPROBS = "log-probabilities of the prompt and raw token ids are not returned yet"

# name -> (neutral value test, why not / what to do instead); shared by both routes
UNSUPPORTED: dict[str, tuple[Neutral, str]] = {
    "best_of": (_one, "send several requests and pick the best yourself"),
    "use_beam_search": (_false, "beam search is not speculative decoding's job"),
    "length_penalty": (_one, "it only applies to beam search"),
    "bad_words": (_empty, CHANGES_DISTRIBUTION),
    "allowed_token_ids": (_null, CHANGES_DISTRIBUTION),
    "logits_processors": (_null, CHANGES_DISTRIBUTION),
    "include_stop_str_in_output": (_false, "the text always ends before a stop string"),
    "skip_special_tokens": (_true, "special tokens are always left out of the text"),
    "spaces_between_special_tokens": (_true, "special tokens are always left out of the text"),
    "truncate_prompt_tokens": (_null, "shorten the prompt yourself (see /tokenize)"),
    "prompt_logprobs": (_null, LOGPROBS),
    "return_tokens_as_token_ids": (_false, LOGPROBS),
    "priority": (_zero, "requests are served first come, first served"),
    "guided_grammar": (_null, STRUCTURED),
    "guided_decoding_backend": (_null, STRUCTURED),
    "guided_whitespace_pattern": (_null, STRUCTURED),
    "structural_tag": (_null, STRUCTURED),
    "structured_outputs": (_null, STRUCTURED),
}
UNSUPPORTED_CHAT: dict[str, tuple[Neutral, str]] = {
    "tools": (_empty, TOOLS),
    "tool_choice": (_is("none"), TOOLS),
    "functions": (_empty, TOOLS),
    "function_call": (_is("none"), TOOLS),
    "audio": (_null, "this server answers in text only"),
    "modalities": (_is(["text"]), "this server answers in text only"),
    "prediction": (_null, "predicted outputs are not supported; speculation already guesses from the prompt"),
    "reasoning_effort": (_null, "this model does not reason in a separate channel"),
    "verbosity": (_null, "this model has no verbosity control"),
    "web_search_options": (_null, "this server does not search the web"),
    "add_special_tokens": (_false, "the chat template places the special tokens"),
    "documents": (_null, "put the documents in the messages"),
    "mm_processor_kwargs": (_null, "this server takes text only"),
    "echo": (_false, "the response holds the new text only"),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Neutral, str]] = {
    "echo": (_false, "the response holds the new text only"),
    "suffix": (_is(""), "insertion (fill in the middle) is not supported"),
    "add_special_tokens": (_true, "the tokenizer always adds the model's special tokens to a text prompt"),
}
# accepted and ignored: they cannot change what the model writes
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                      "parallel_tool_calls", "request_id", "cache_salt"})

MESSAGE_FIELDS = frozenset({"role", "content", "name"})
UNSUPPORTED_MESSAGE: dict[str, tuple[Neutral, str]] = {
    "tool_calls": (_empty, TOOLS),
    "function_call": (_null, TOOLS),
    "audio": (_null, "this server takes text only"),
}
HARMLESS_MESSAGE = frozenset({"refusal", "annotations", "tool_call_id", "reasoning_content"})


def unsupported(param: str, value: Any, why: str) -> APIError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return APIError(400, f"`{param}` is not supported by this server (got {shown}): {why}", param=param,
                    code="unsupported_parameter")


def unknown(param: str, known: set[str] | frozenset[str], where: str = "") -> APIError:
    guess = difflib.get_close_matches(param.split(".")[-1], sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean `{guess[0]}`?" if guess else ""
    return APIError(400, f"unrecognized request argument `{param}`{where}{hint}", param=param,
                    code="unknown_parameter")


def screen(body: dict, honoured: set[str], chat: bool) -> dict:
    """The body less harmless and neutral fields; a 400 for a field with a value we cannot honour or a name
    nobody defines. `honoured`: the fields the request model reads."""
    table = {**UNSUPPORTED, **(UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION)}
    kept = sift(body, honoured, table, HARMLESS)
    if chat and isinstance(kept.get("messages"), list):
        kept["messages"] = [screen_message(m, i) for i, m in enumerate(kept["messages"])]
    return kept


def screen_message(message: Any, index: int) -> Any:
    if not isinstance(message, dict):
        return message  # pydantic says what is wrong with it
    return sift(message, MESSAGE_FIELDS, UNSUPPORTED_MESSAGE, HARMLESS_MESSAGE, f"messages[{index}].")


def sift(fields: dict, honoured: set[str] | frozenset[str], unsupported_fields: dict[str, tuple[Neutral, str]],
         harmless: frozenset[str], where: str = "") -> dict:
    """The honoured fields of `fields`; the others dropped where harmless or neutral, else a 400 naming the field
    as `where` + its name."""
    kept = {}
    for name, value in fields.items():
        if name in honoured:
            kept[name] = value
        elif name in unsupported_fields:
            neutral, why = unsupported_fields[name]
            if not neutral(value):
                raise unsupported(where + name, value, why)
        elif name not in harmless:
            raise unknown(where + name, honoured | set(unsupported_fields) | harmless)
    return kept
