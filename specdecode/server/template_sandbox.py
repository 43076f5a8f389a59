"""Requests' own chat templates (--trust-request-chat-template), rendered where they cannot hurt the server.

Transformers' Jinja sandbox keeps a template from reaching files or code, but not from taking seconds and
gigabytes: a 70-byte template of nested loops rendered ~100 MB and took 7.3 GB. So a request's template renders in
a child process (template_worker.py) whose memory is capped and which is killed when it runs past its time; the
server's own template (trusted) renders in-process.
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.chat_template import check_turn

log = logging.getLogger("specdecode.server")
SECONDS = 2.0  # a chat template renders in milliseconds; a request's template gets this long
MEMORY_MIB = 512  # and this much memory beyond the renderer's own
START_SECONDS = 120.0  # the renderer's imports (transformers), with room for a loaded machine


class TemplateSandbox:
    def __init__(self, seconds: float = SECONDS, memory_mib: int = MEMORY_MIB) -> None:
        self.seconds, self.memory_mib = seconds, memory_mib
        self._lock = threading.Lock()  # one render at a time (the renderer reads one request, answers it)
        self._process: subprocess.Popen | None = None
        with self._lock:
            self._start()

    def _start(self) -> subprocess.Popen:
        """A fresh renderer, once it says it is ready."""
        process = subprocess.Popen([sys.executable, "-m", "specdecode.server.template_worker", str(self.memory_mib)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True, encoding="utf-8")
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
        if not ready or not process.stdout.readline():
            process.kill()
            process.wait()
            raise RuntimeError("the chat template renderer did not start (python -m specdecode.server.template_worker)")
        self._process = process
        return process

    def render(self, template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
               continue_final_message: bool, variables: Mapping[str, Any], special_tokens: Mapping[str, Any],
               max_chars: int) -> str:
        """The messages through `template`, or a ValueError that says what went wrong (it failed, ran past its
        time or memory, or wrote more than `max_chars` characters)."""
        check_turn(add_generation_prompt, continue_final_message)
        request = json.dumps({"template": template, "messages": list(messages), "variables": dict(variables),
                              "special_tokens": dict(special_tokens), "max_chars": max_chars,
                              "add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message})
        with self._lock:
            process = self._process if self._process and self._process.poll() is None else self._start()
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(request + "\n")
                process.stdin.flush()
                ready, _, _ = select.select([process.stdout], [], [], self.seconds)
                line = process.stdout.readline() if ready else None
            except (BrokenPipeError, OSError):
                line = ""
            if not line:  # ran past its time, or died (its memory cap): the next request gets a fresh renderer
                process.kill()
                process.wait()
                self._process = None
                why = f"took longer than {self.seconds:g} s" if line is None else \
                    f"stopped the renderer (more than {self.memory_mib} MiB?)"
                raise ValueError(f"the chat template {why}: a chat template renders in milliseconds")
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._process.kill()
                self._process.wait()
                self._process = None
