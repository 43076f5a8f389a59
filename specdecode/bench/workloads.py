"""Repetitive workloads, built from public training data (../shared/data/train, never the evaluation prompts):
the traffic a server sees from agents and editors, where the answer re-sends text the model saw or wrote.

- `revise`: a two-turn chat (a ShareGPT question and its recorded answer), then "revise your previous answer":
  the new answer rewrites the old one.
- `code-edit`: a file (a GPTeacher codegen answer) and an edit to make; the reply is the whole updated file.
- `tool-loop`: an agent's tool calls in one fixed JSON schema (tools and queries from GPTeacher toolformer): a
  system prompt with the schema, earlier calls and results, and a batch of new tasks to call tools for.

`repetitive` is all three. Their earlier turns are recorded text (another model's answers, the dataset's calls).

`sessions` is the same traffic as a server meets it in a conversation: the earlier answers are the model's own
(`OWN`: written by plain greedy decoding when the benchmark runs, so every method meets the same prompt), and a
server with prefix caching has their keys and values from the turn before.
- `revise-session`: a ShareGPT question, the model's answer, then "revise your previous answer".
- `edit-session`: a GPTeacher codegen task, the model's code, then an edit asking for the whole updated file.
- `tool-session`: the tool schema and a batch of tasks, the model's calls, then their results and more tasks.

Prompts are chat messages; each category's prompts are drawn with a fixed seed.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ..data import train_dir
from .data import Question

TRAIN = train_dir()
SESSIONS = ("revise-session", "edit-session", "tool-session")
WORKLOADS = {"repetitive": ("revise", "code-edit", "tool-loop"), "revise": ("revise",),
             "code-edit": ("code-edit",), "tool-loop": ("tool-loop",), "sessions": SESSIONS,
             **{name: (name,) for name in SESSIONS}}
REVISIONS = ("make it more formal", "make it friendlier", "use shorter sentences", "fix any mistakes you find",
             "make it clearer for a beginner")
CODE_EDITS = ("Add a comment above each function saying what it does", "Add a short docstring or header comment",
              "Rename the main variable to something more descriptive", "Add input validation",
              "Print a message when the program finishes")
TOOL_CALL = re.compile(r"(\w+)\('([^']+)'\)")
ID_BASE = {"revise": 100_000, "code-edit": 200_000, "tool-loop": 300_000, "revise-session": 400_000,
           "edit-session": 500_000, "tool-session": 600_000}
OWN: dict[str, str | None] = {"role": "assistant", "content": None}  # the model answers it when the benchmark runs


def load_workload(name: str, categories: str | list[str] = "all", per_category: int = 10, seed: int = 0,
                  train: Path = TRAIN) -> list[Question]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of spec-bench, {', '.join(WORKLOADS)}")
    known = WORKLOADS[name]
    wanted = known if categories == "all" else list(categories)
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise ValueError(f"unknown categories {unknown} for workload {name}; known: {', '.join(known)}")
    if not train.is_dir():
        raise FileNotFoundError(f"training data not found at {train}: the workloads are built from it")
    build = {"revise": revise, "code-edit": code_edit, "tool-loop": tool_loop, "revise-session": revise_session,
             "edit-session": edit_session, "tool-session": tool_session}
    out = []
    for category in wanted:
        prompts = build[category](train, per_category, random.Random(f"{seed}-{category}"))
        out += [Question(ID_BASE[category] + i, category, p) for i, p in enumerate(prompts)]
    return out


def revise(train: Path, n: int, rng: random.Random) -> list[list[dict[str, str]]]:
    rows = [json.loads(line) for line in (train / "sharegpt" / "sharegpt_sample_1000.jsonl").open()]
    pairs = [(c[0]["value"], c[1]["value"]) for c in (r["conversations"] for r in rows)
             if len(c) >= 2 and c[0]["from"] == "human" and c[1]["from"] == "gpt"
             and 300 < len(c[1]["value"]) < 1500 and len(c[0]["value"]) < 600]
    return [[{"role": "user", "content": question}, {"role": "assistant", "content": answer},
             {"role": "user", "content": f"Revise your previous answer: {rng.choice(REVISIONS)}. Write out the whole "
                                         "revised answer."}]
            for question, answer in rng.sample(pairs, min(n, len(pairs)))]


def code_edit(train: Path, n: int, rng: random.Random) -> list[list[dict[str, str]]]:
    rows = json.loads((train / "gpteacher" / "codegen-instruct.json").read_text())
    files = [r["response"] for r in rows if 300 < len(r["response"]) < 1500 and r["response"].count("\n") >= 8]
    return [[{"role": "user", "content": f"Here is a file:\n```\n{code}\n```\n{rng.choice(CODE_EDITS)}. Reply with "
                                         "the whole updated file in one code block."}]
            for code in rng.sample(files, min(n, len(files)))]


def tool_schema(train: Path) -> tuple[str, list[tuple[str, str, str]]]:
    """The agent's system prompt (one JSON schema for every call) and GPTeacher toolformer's (task, tool, query)."""
    rows = json.loads((train / "gpteacher" / "toolformer-dedupe-only-dataset.json").read_text())
    calls = []
    for r in rows:
        found = TOOL_CALL.search(r["response"])
        if found and r["input"].strip():
            task = r["instruction"].strip().splitlines()[-1]
            calls.append((f"{task} Input: {r['input'].strip()}", found.group(1), found.group(2)))
    tools = sorted({tool for _, tool, _ in calls})
    system = ("You are an agent that answers only with tool calls. For each task, write one line holding one JSON "
              'object: {"task": <task number>, "tool": <tool name>, "arguments": {"query": <text>}}. '
              f"Tools: {', '.join(tools)}.")
    return system, calls


def tool_loop(train: Path, n: int, rng: random.Random, history: int = 3, tasks: int = 4) -> list[list[dict[str, str]]]:
    system, calls = tool_schema(train)

    def call(i: int, tool: str, query: str) -> str:
        return json.dumps({"task": i, "tool": tool, "arguments": {"query": query}})

    prompts = []
    for _ in range(n):
        picked = rng.sample(calls, history + tasks)
        messages = [{"role": "system", "content": system}]
        for i, (task, tool, query) in enumerate(picked[:history], start=1):
            messages += [{"role": "user", "content": f"Task {i}: {task}"},
                         {"role": "assistant", "content": call(i, tool, query)},
                         {"role": "user", "content": f"Result of task {i}: done."}]
        todo = "\n".join(f"Task {i}: {task}" for i, (task, _, _) in enumerate(picked[history:], start=history + 1))
        messages.append({"role": "user", "content": todo})
        prompts.append(messages)
    return prompts


def has_own_turns(prompt: object) -> bool:
    """Whether a prompt holds turns the model answers itself (`OWN`) before it can be sent."""
    return isinstance(prompt, list) and any(m.get("role") == "assistant" and m.get("content") is None for m in prompt)


def sharegpt_questions(train: Path) -> list[str]:
    rows = [json.loads(line) for line in (train / "sharegpt" / "sharegpt_sample_1000.jsonl").open()]
    return [c[0]["value"] for c in (r["conversations"] for r in rows)
            if len(c) >= 2 and c[0]["from"] == "human" and 20 < len(c[0]["value"]) < 600]


def revise_session(train: Path, n: int, rng: random.Random) -> list[list[dict]]:
    questions = sharegpt_questions(train)
    return [[{"role": "user", "content": question}, OWN,
             {"role": "user", "content": f"Revise your previous answer: {rng.choice(REVISIONS)}. Write out the whole "
                                         "revised answer."}]
            for question in rng.sample(questions, min(n, len(questions)))]


def edit_session(train: Path, n: int, rng: random.Random) -> list[list[dict]]:
    rows = json.loads((train / "gpteacher" / "codegen-instruct.json").read_text())
    tasks = [r["instruction"].strip() + (f"\n{r['input'].strip()}" if r.get("input", "").strip() else "")
             for r in rows if len(r["response"]) > 300 and len(r["instruction"]) < 600]
    return [[{"role": "user", "content": task}, OWN,
             {"role": "user", "content": f"{rng.choice(CODE_EDITS)}. Reply with the whole updated file in one code "
                                         "block."}]
            for task in rng.sample(tasks, min(n, len(tasks)))]


def tool_session(train: Path, n: int, rng: random.Random, tasks: int = 4) -> list[list[dict]]:
    system, calls = tool_schema(train)
    prompts: list[list[dict]] = []
    for _ in range(n):
        picked = rng.sample(calls, 2 * tasks)
        first = "\n".join(f"Task {i}: {task}" for i, (task, _, _) in enumerate(picked[:tasks], start=1))
        then = "\n".join(f"Task {i}: {task}" for i, (task, _, _) in enumerate(picked[tasks:], start=tasks + 1))
        prompts.append([{"role": "system", "content": system}, {"role": "user", "content": first}, OWN,
                        {"role": "user", "content": f"Results of tasks 1-{tasks}: done.\n{then}"}])
    return prompts
