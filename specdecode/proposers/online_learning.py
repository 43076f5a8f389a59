"""Online learning of the EAGLE head from the verifier (after DVI, arXiv 2510.05421): a head that drifts from the
traffic learns it while serving, and output stays exactly the target's, since verification is unchanged.

Every step already computes what the head needs to learn: the target's hidden states at the head's layers, its
distribution at every verified position and the tokens it committed. Proposers `record` them in chunks into a
bounded replay buffer; a background thread fine-tunes a float copy of the head on it (the training-time-test loss
of `specdecode train eagle`, the target's top 8 probabilities as the teacher) and every `publish_every` steps
publishes a new serving head. A proposer takes the newest head only at the start of a step (`current` is read once
there), so no step mixes two heads. Before each new head is learned, its draft vocabulary follows the traffic
(`refresh_vocab`): a head can neither guess nor learn a token outside it, and tool-call answers had 16% of theirs
outside the shipped head's.
The guard: a published head is judged over its first `judge_steps` drafting steps by tokens accepted per step;
under `tolerance` x its predecessor's, the predecessor comes back (and the learner restarts from it).
The learner works only as hard as it pays: after a publish it learns on for at most `publish_every` more steps
while the verdict is awaited (the next head, published as soon as the verdict keeps this one), then waits (a head
that rests, not drafting, is never judged: its learner stays idle), and its share of the time doubles after a head
that accepted more than its predecessor and falls by 30% after one that did not (between `min_duty` and `duty`).
Traffic the head already knows costs a few percent of a core; traffic it does not gets the learner's full share
(idle while each verdict was awaited, the learner made 247 steps in 200 tool-call requests; learning ahead, 277).
"""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ..models.eagle import EagleHead
from ..models.eagle_ttt import ttt_loss


@dataclass
class OnlineConfig:
    lr: float = 3e-4  # as measured in benchmarks/results/online-shift-tool-loop
    batch: int = 8  # chunks per learner step
    chunk: int = 64  # positions per recorded chunk
    buffer_chunks: int = 512  # the replay buffer's bound: the oldest chunks go first
    publish_every: int = 20  # learner steps between published heads
    ttt_steps: int = 3  # draft depths unrolled in training
    duty: float = 1.0  # the learner computes at most this share of the wall time (it sleeps the rest) ...
    min_duty: float = 1 / 32  # ... and at least this share, while its heads gain nothing
    # DVI's reward: the guesses the target rejected (r = 0) are pushed down, with this weight against the committed
    # token's 1 (unlikelihood, -log(1 - q): the bounded form of the policy-gradient term, since the replay buffer
    # repeats old rejections), once `reward_after` learner steps of distillation alone have calibrated the head
    # (DVI's KL -> RL schedule); 0 turns it off
    reward: float = 0.3
    reward_after: int = 20
    # the teacher: the target's top-8 distribution at each verified position (KD, as offline training has it), or
    # the committed token alone (False)
    soft: bool = True
    # with `soft`: the loss covers the positions the target verified (its answers) and a prompt's positions are
    # context only, as offline EAGLE training learns on answers alone; chunks of the prompt alone are not recorded
    answers_only: bool = True
    # the draft vocabulary follows the traffic: before each new head is learned, up to this many of the target tokens
    # the teacher gave most probability mass outside the draft vocabulary (at least `vocab_min_mass`, and twice the
    # row's) take the rows of the draft tokens with the least (0 turns it off). The head cannot guess, nor learn, a
    # token outside its vocabulary, and 16% of tool-call answers' tokens were outside the shipped head's
    vocab_swaps: int = 64
    vocab_min_mass: float = 2.0
    # the counted mass fades, by half every this many chunks recorded (the replay buffer's turnover; 0: never), so
    # the vocabulary follows traffic that shifts more than once: rows an earlier traffic used heavily go back
    vocab_half_life: int = 512
    judge_steps: int = 48  # drafting steps over which a published head is judged
    tolerance: float = 0.9  # reverted if it accepts fewer tokens per step than this x its predecessor
    seed: int = 0


class OnlineHead:
    """An EAGLE head that keeps learning while it serves (see the module docstring). `current` is the serving head,
    `version` counts publishes and reverts."""

    def __init__(self, head: EagleHead, embed: torch.nn.Module, cfg: OnlineConfig | None = None,
                 quantization: str | None = None, output: torch.nn.Module | None = None) -> None:
        self.cfg = cfg or OnlineConfig()
        self.current, self.version = head, 0
        self.quantization = quantization  # the serving head's linear layers' kind (None: as the learner's)
        self.learner = head.float_copy()
        self.learner.requires_grad_(True)  # its parameters (d2t is a buffer)
        table = cast(torch.Tensor, embed.weight)  # the target's embedding (a quantized one dequantizes)
        self.embed = torch.nn.Embedding.from_pretrained(table.detach().float().clone())
        vocab_size = self.embed.weight.shape[0]
        # the target's output rows, where new draft tokens' rows start (a tied model's are its embedding's)
        rows = embed if output is None else output
        self.output = self.embed.weight if rows is embed else cast(torch.Tensor, rows.weight).detach().float()
        self.t2d = self.learner.draft_ids()
        self.mass = torch.zeros(vocab_size, dtype=torch.float64)  # the teacher's probability mass per target token
        self.faded_at = 0  # chunks recorded when the mass last faded
        self.swapped = 0  # draft vocabulary rows given to new tokens
        self.optimizer = self._optimizer()
        self.served = copy.deepcopy(self.learner.state_dict())  # the learner's weights behind `current`
        self._restore: dict[str, torch.Tensor] | None = None  # weights the learner restarts from (after a revert)
        self.buffer: deque[Chunk] = deque(maxlen=self.cfg.buffer_chunks)
        self.recorded = 0  # chunks ever recorded
        self.steps = 0  # learner steps taken
        self.unpublished = 0  # learner steps since the last publish (or restart)
        self.reverts = 0
        self.duty = self.cfg.duty  # the learner's share of the time now (see the module docstring)
        self.lock = threading.Lock()
        self.rng = random.Random(self.cfg.seed)
        # guard: per version [accepted tokens, drafting steps]; the head before the last publish, until judged
        self.judged: dict[int, list[float]] = {0: [0.0, 0.0]}
        self.previous: tuple[EagleHead, dict[str, torch.Tensor], int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ serving side (the engine's threads)
    def serving(self) -> tuple[EagleHead, int]:
        """(the serving head, its version), read together."""
        with self.lock:
            return self.current, self.version

    def record(self, hidden: torch.Tensor, tokens: Sequence[int], rejected: torch.Tensor | None = None,
               teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One chunk the target verified: `hidden` [n, layers x H] at n positions and the n + 1 tokens from the
        first of them on (token i + 1 is the one committed after position i); `rejected` [n, R]: the guesses the
        target rejected for token i + 1 (-1: none); `teacher` ([n, K] ids, [n, K] probabilities): the target's
        most likely tokens after position i (ids -1 where none was kept)."""
        if len(tokens) != hidden.shape[0] + 1:
            raise ValueError(f"{hidden.shape[0]} positions need {hidden.shape[0] + 1} tokens, got {len(tokens)}")
        if rejected is not None and rejected.shape[0] != hidden.shape[0]:
            raise ValueError(f"{hidden.shape[0]} positions need {hidden.shape[0]} rows of rejected guesses, got "
                             f"{rejected.shape[0]}")
        if teacher is not None and teacher[0].shape[0] != hidden.shape[0]:
            raise ValueError(f"{hidden.shape[0]} positions need {hidden.shape[0]} teacher rows, got "
                             f"{teacher[0].shape[0]}")
        kept = None if rejected is None else rejected.detach().to("cpu", torch.long).clone()
        soft = None if teacher is None else (teacher[0].to("cpu", torch.long).clone(),
                                             teacher[1].to("cpu", torch.float32).clone())
        with self.lock:
            self.buffer.append((hidden.detach().to("cpu", torch.float16).clone(), torch.tensor(tokens), kept, soft))
            self.recorded += 1
            if soft is not None:
                taught = soft[0] >= 0
                self.mass.index_add_(0, soft[0][taught], soft[1][taught].double())

    def report(self, version: int, accepted: int) -> None:
        """A drafting step of head `version` had `accepted` guesses accepted: the guard's evidence."""
        with self.lock:
            counts = self.judged.get(version)
            if counts is None:  # a head no longer judged, nor judged against
                return
            counts[0] += accepted
            counts[1] += 1
            if self.previous is not None and version == self.version and counts[1] >= self.cfg.judge_steps:
                before = self.judged.get(self.previous[2], [0.0, 0.0])
                rate_before = before[0] / before[1] if before[1] else 0.0
                rate = counts[0] / counts[1]
                gained = rate > rate_before
                # a verdict over a few dozen steps is noisy: the share falls gently, and comes back at once
                self.duty = min(self.cfg.duty, self.duty * 2) if gained else max(self.cfg.min_duty, self.duty * 0.7)
                if rate < self.cfg.tolerance * rate_before:
                    self._revert()
                else:
                    self.previous = None  # kept

    def _optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.learner.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def _revert(self) -> None:
        head, state, version = self.previous
        self._restore = self.served = state  # the learner takes it at its next step (it may be mid-step now)
        self.current, self.version, self.previous = head, self.version + 1, None
        self.judged[self.version] = list(self.judged.get(version, [0.0, 0.0]))  # its record stands
        self.reverts += 1

    # ------------------------------------------------------------------ learning side
    def step(self) -> float | None:
        """One learner step on a batch from the buffer (None: too little data yet, or a verdict awaited with the next
        head ready); publishes after `publish_every` steps once no verdict is awaited. The background thread calls
        this; tests may too."""
        with self.lock:
            if self._restore is not None:
                self.learner.load_state_dict(self._restore)  # its draft vocabulary (d2t) too
                self.optimizer, self._restore, self.unpublished = self._optimizer(), None, 0
                self.t2d = self.learner.draft_ids()
            ahead = self.previous is not None and self.unpublished >= self.cfg.publish_every
            if len(self.buffer) < self.cfg.batch or ahead:  # no data, or the next head is ready: a verdict awaited
                return None
            chunks = self.rng.sample(list(self.buffer), self.cfg.batch)
            mass = self.fade_mass().clone() if self.unpublished == 0 else None
        if mass is not None:  # a new head begins: its vocabulary first
            self.swapped += self.refresh_vocab(mass)
        reward = self.cfg.reward if self.steps >= self.cfg.reward_after else 0.0
        batch = chunk_batch(chunks, self.learner.config.target_layers, reward, self.cfg.answers_only)
        self.learner.train()
        loss, _ = ttt_loss(self.learner, self.embed, self.t2d, batch, self.cfg.ttt_steps)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.learner.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1
        self.unpublished += 1
        if self.unpublished >= self.cfg.publish_every and self.previous is None:
            self.publish()
        return float(loss.detach())

    def fade_mass(self) -> torch.Tensor:
        """The teacher's mass per token, faded for the chunks recorded since it last was (OnlineConfig.vocab_half_life).
        Called under the lock."""
        if self.cfg.vocab_half_life > 0 and self.recorded > self.faded_at:
            self.mass *= 0.5 ** ((self.recorded - self.faded_at) / self.cfg.vocab_half_life)
        self.faded_at = self.recorded
        return self.mass

    def refresh_vocab(self, mass: torch.Tensor) -> int:
        """The learner's draft vocabulary towards the traffic's (`EagleHead.swap_vocab`, OnlineConfig.vocab_swaps);
        a swapped row's optimizer moments start at zero. Returns the rows swapped."""
        if self.cfg.vocab_swaps <= 0:
            return 0
        rows = self.learner.swap_vocab(mass, self.output, self.cfg.vocab_swaps, self.cfg.vocab_min_mass)
        state = self.optimizer.state.get(self.learner.lm_head.weight, {})
        for moment in ("exp_avg", "exp_avg_sq"):
            if moment in state:
                state[moment][rows] = 0.0
        self.t2d = self.learner.draft_ids()
        return len(rows)

    def publish(self) -> None:
        """The learner's weights become the serving head (as the serving one is stored: dtype, quantization)."""
        head = self.learner.float_copy().to(self.current.device, self.current.dtype)
        head.requires_grad_(False)
        if self.quantization is not None:
            head.quantize_(self.quantization)
        head.warm_up()  # here, off the serving thread: its first forward builds its kernels' description and RoPE table
        rest = getattr(self.current, "rest_state", None)
        if rest is not None:  # the policy's view of the head carries over
            head.rest_state = rest
        state = copy.deepcopy(self.learner.state_dict())
        self.unpublished = 0
        with self.lock:
            if self.previous is None:  # a head still being judged stays the one to come back to
                self.previous = (self.current, self.served, self.version)
            self.served = state
            self.current, self.version = head, self.version + 1
            kept = (self.previous[2], self.version)  # the records that still matter (not one per head ever made)
            self.judged = {v: c for v, c in self.judged.items() if v in kept}
            self.judged[self.version] = [0.0, 0.0]

    def start(self) -> None:
        """Learn in a daemon thread until `close`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="specdecode-online-draft", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            if self.step() is None:
                self._stop.wait(0.05)
                continue
            busy = time.perf_counter() - started
            if self.duty < 1.0:  # sleep so that computing stays within its share of the time
                self._stop.wait(busy * (1.0 / self.duty - 1.0))


# (hidden states [n, layers x H], the n + 1 committed tokens, the rejected guesses [n, R] or None, the target's
# top-k (ids [n, K], -1 where none was kept; probabilities [n, K]) or None)
Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]


def chunk_batch(chunks: list[Chunk], layers: Sequence[int], reward: float = 0.0, answers_only: bool = False
                ) -> dict[str, torch.Tensor]:
    """Recorded chunks as a training batch of `ttt_loss`: the teacher is the target's top-k distribution where one
    was kept, else the committed next token (weight 1); with `reward`, each guess the target rejected there is a
    teacher of weight -reward (pushed down). answers_only: in chunks with distributions kept, the positions without
    one (the prompt's) are context only, not taught."""
    n = min(c[0].shape[0] for c in chunks)
    hidden = torch.stack([c[0][:n] for c in chunks]).float()
    hidden = hidden.view(len(chunks), n, len(layers), -1)
    tokens = torch.stack([c[1][: n + 1] for c in chunks])
    ids, weights = tokens[:, 1:, None], torch.ones(len(chunks), n, 1)
    topk = max((c[3][0].shape[1] for c in chunks if c[3] is not None), default=0)
    mask = torch.ones(len(chunks), n, dtype=torch.bool)
    if topk:  # the committed token in the first column, zero weights after it, where no distribution was kept
        ids = torch.cat((ids, torch.zeros(len(chunks), n, topk - 1, dtype=torch.long)), -1)
        weights = torch.cat((weights, torch.zeros(len(chunks), n, topk - 1)), -1)
        for row, c in enumerate(chunks):
            if c[3] is not None:
                top, probs = c[3][0][:n], c[3][1][:n]
                kept = top[:, 0] >= 0
                if answers_only:
                    mask[row] = kept
                ids[row, kept, : top.shape[1]] = top[kept]
                weights[row, kept] = 0.0
                weights[row, kept, : top.shape[1]] = probs[kept]
    width = max((c[2].shape[1] for c in chunks if c[2] is not None), default=0)
    if reward and width:
        rejected = torch.full((len(chunks), n, width), -1, dtype=torch.long)
        for row, c in enumerate(chunks):
            if c[2] is not None:
                rejected[row, :, : c[2].shape[1]] = c[2][:n]
        ids = torch.cat((ids, rejected.clamp_min(0)), -1)
        weights = torch.cat((weights, -reward * (rejected >= 0).float()), -1)
    return {"hidden": hidden, "tokens": tokens[:, :n], "mask": mask,
            "teacher_ids": ids, "teacher_probs": weights}
