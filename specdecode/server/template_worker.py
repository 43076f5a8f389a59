"""The child process of `TemplateSandbox`: renders chat templates sent on stdin, one JSON line each, and answers
each with one JSON line, {"text": ...} or {"error": ...}. Its memory is capped (argv[1]: MiB beyond what it holds
once its imports are done); its time is bounded by its parent, which kills it."""

from __future__ import annotations

import contextlib
import json
import resource
import sys


def cap_memory(mib: int) -> None:
    """Address space: what the imports took plus `mib` (an allocation beyond it is a MemoryError)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    limit = pages * resource.getpagesize() + (mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def render(request: dict) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered = render_jinja_template(  # (texts, generation indices), one text per conversation
        conversations=[request["messages"]], chat_template=request["template"],
        add_generation_prompt=request["add_generation_prompt"],
        continue_final_message=request["continue_final_message"],
        **{**request["special_tokens"], **request["variables"]})
    return rendered[0][0]


def main() -> None:
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401 - imported before the cap

    with contextlib.suppress(OSError, ValueError):  # no /proc (not Linux): time is still bounded by the parent
        cap_memory(int(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)  # the parent's clock starts at a request, not at our imports
    for line in sys.stdin:
        request = json.loads(line)
        try:
            text = render(request)
            reply = {"text": text} if len(text) <= request["max_chars"] else \
                {"error": f"the chat template's text is longer than the context can hold ({request['max_chars']} "
                          "characters)"}
        except MemoryError:
            reply = {"error": f"the chat template used more than {sys.argv[1]} MiB of memory"}
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                RecursionError, OverflowError) as e:
            reply = {"error": f"the chat template failed: {type(e).__name__}: {str(e)[:500]}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
