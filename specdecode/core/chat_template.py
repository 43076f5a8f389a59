"""Chat messages -> prompt text -> token ids, through a chat template (the tokenizer's, or one given).

Rendering and tokenizing are two steps (as `apply_chat_template` does them inside: the text, then the tokenizer
without special tokens), so that a caller can bound the text before it is tokenized and tokenize with a tokenizer of
its own. A template's own variables come from `variables`; the names `apply_chat_template` reads itself (tokenize,
return_tensors, truncation, ...) change what comes back, not what the template sees, and are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

# what the template sees besides `variables` (transformers passes them; a variable of that name would shadow them)
TEMPLATE_INPUTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "conversation"})


@cache
def reserved_names() -> frozenset[str]:
    """apply_chat_template's own parameters (tokenize, padding, truncation, max_length, return_tensors, return_dict,
    tokenizer_kwargs, chat_template, ...) and the template's inputs: never template variables."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    own = {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD and name != "self"}
    return frozenset(own | TEMPLATE_INPUTS)


def check_variables(variables: Mapping[str, Any] | None) -> dict[str, Any]:
    """The template variables asked for (e.g. enable_thinking), or a ValueError naming each reserved one."""
    variables = dict(variables or {})
    refused = sorted(set(variables) & reserved_names())
    if refused:
        raise ValueError(f"chat_template_kwargs may set the template's own variables only; {', '.join(refused)} "
                         f"{'is' if len(refused) == 1 else 'are'} reserved (arguments of the tokenizer or inputs of "
                         "the template)")
    return variables


def check_turn(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """A new assistant turn, or the last message continued: not both."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message exclude each other: a new assistant turn, "
                         "or the last message continued")


def render(tokenizer, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           variables: Mapping[str, Any] | None = None) -> str:
    """The prompt's text: the messages through the template (transformers' Jinja sandbox), the assistant's turn
    opened (add_generation_prompt) or the last message left open (continue_final_message)."""
    import jinja2

    check_turn(add_generation_prompt, continue_final_message)
    try:
        text = tokenizer.apply_chat_template(
            list(messages), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **check_variables(variables))
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None
    if not isinstance(text, str):
        raise ValueError(f"the chat template gave {type(text).__name__}, not text")
    return text


def tokenize(tokenizer, text: str) -> list[int]:
    """A rendered chat's token ids: the template wrote its special tokens itself (none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
