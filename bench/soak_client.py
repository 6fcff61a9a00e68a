"""The soak's client side (bench/soak.py): the request mix, one request sent, cancelled
or checked, and the tally of outcomes. Only the official ``openai`` client is used, as a
user's program would."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import openai

MAX_N = 3  # the most choices a request asks for
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "mix", "strange", "potions", "under", "an", "old", "bridge", "near",
    "river", "where", "children", "play", "every", "summer", "evening",
)  # fmt: skip
SYSTEM_PROMPT = "You are a terse assistant. Answer in one short sentence."  # a shared prefix
# Single letters match often in the tiny model's gibberish; two-letter ones test hold-back.
STOP_SETS = (("e",), ("a", "o"), ("er",), ("in", "th"), (" ",), ("\n",))

Endpoint = Literal["chat", "completions"]
Status = Literal["completed", "cancelled", "overloaded", "failed", "invalid", "unfinished"]
UNEXPECTED: tuple[Status, ...] = ("overloaded", "failed", "invalid", "unfinished")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request a loop sends, drawn from its seeded RNG."""

    endpoint: Endpoint
    stream: bool
    n: int
    max_tokens: int
    greedy: bool  # temperature 0; otherwise the OpenAI default (1.0)
    stop: tuple[str, ...]
    prompt: str
    cancel_after_chunks: int | None  # streams: close after this many chunks
    cancel_after_s: float | None  # unary: cancel the call after this long

    @property
    def kind(self) -> str:
        return f"{self.endpoint}-{'stream' if self.stream else 'unary'}"

    @property
    def is_cancel(self) -> bool:
        return self.cancel_after_chunks is not None or self.cancel_after_s is not None

    def create_kwargs(self, model: str) -> dict[str, Any]:
        """Arguments for the openai client's ``create``."""
        kwargs: dict[str, Any] = {"model": model, "n": self.n, "max_tokens": self.max_tokens}
        if self.endpoint == "chat":
            kwargs["messages"] = [{"role": "user", "content": self.prompt}]
            if len(self.prompt) % 2:  # half share a system prefix: the radix cache is used
                kwargs["messages"].insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        else:
            kwargs["prompt"] = self.prompt
        if self.greedy:
            kwargs["temperature"] = 0.0
        if self.stop:
            kwargs["stop"] = list(self.stop)
        if self.stream:
            kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
        return kwargs


def pick_spec(rng: random.Random, cancel_fraction: float) -> RequestSpec:
    """The mix: chat/completions and stream/unary evenly, 30 % with stops, 30 % n > 1,
    20 % greedy, ``cancel_fraction`` cancelled after 0-4 chunks or 0-2 s."""
    stream = rng.random() < 0.5
    cancel = rng.random() < cancel_fraction
    return RequestSpec(
        endpoint=rng.choice(("chat", "completions")),
        stream=stream,
        n=rng.choice((2, 3)) if rng.random() < 0.3 else 1,
        max_tokens=rng.randint(8, 64),
        greedy=rng.random() < 0.2,
        stop=rng.choice(STOP_SETS) if rng.random() < 0.3 else (),
        prompt=" ".join(rng.choices(WORDS, k=rng.randint(3, 40))),
        cancel_after_chunks=rng.randint(0, 4) if cancel and stream else None,
        cancel_after_s=rng.uniform(0.0, 2.0) if cancel and not stream else None,
    )


@dataclass(slots=True)
class Outcome:
    status: Status
    kind: str
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    detail: str = ""


@dataclass(slots=True)
class Choice:
    """What a response said about one choice, streamed or not."""

    text: str = ""
    finish_reason: str | None = None
    stop_reason: object = None  # the matched stop string, or a token id, or None


def check_choices(spec: RequestSpec, choices: dict[int, Choice], usage: Any) -> str:
    """Why a finished response is wrong, or "" when it passes the minimal checks."""
    if sorted(choices) != list(range(spec.n)):
        return f"choices {sorted(choices)} for n={spec.n}"
    if usage is None:
        return "no usage"
    for i, choice in choices.items():
        if choice.finish_reason not in ("stop", "length"):
            return f"choice {i}: finish_reason {choice.finish_reason!r}"
        if any(stop in choice.text for stop in spec.stop):
            return f"choice {i}: text holds a stop string of {spec.stop}"
        if isinstance(choice.stop_reason, str) and choice.stop_reason not in spec.stop:
            return f"choice {i}: stop_reason {choice.stop_reason!r} not in {spec.stop}"
    return ""


def finished(spec: RequestSpec, start: float, choices: dict[int, Choice], usage: Any) -> Outcome:
    latency = time.monotonic() - start
    problem = check_choices(spec, choices, usage)
    tokens = usage.completion_tokens if usage is not None else 0
    return Outcome("invalid" if problem else "completed", spec.kind, latency, None, tokens, problem)


def error_outcome(spec: RequestSpec, start: float, exc: Exception) -> Outcome:
    """Overload (429/503) apart from every other error."""
    status: Status = "failed"
    if isinstance(exc, openai.APIStatusError) and exc.status_code in (429, 503):
        status = "overloaded"
    detail = f"{type(exc).__name__}: {exc}"[:300]
    return Outcome(status, spec.kind, time.monotonic() - start, detail=detail)


async def run_stream(client: openai.AsyncOpenAI, model: str, spec: RequestSpec) -> Outcome:
    """Read a stream to its end, or close it after ``cancel_after_chunks`` chunks."""
    start, ttft, usage = time.monotonic(), None, None
    choices: dict[int, Choice] = {}
    create = client.chat.completions if spec.endpoint == "chat" else client.completions
    stream = await create.create(**spec.create_kwargs(model))
    async with stream:  # leaving it early closes the connection: the gateway aborts
        if spec.cancel_after_chunks == 0:
            return Outcome("cancelled", spec.kind, time.monotonic() - start)
        num_chunks = 0
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text = choice.delta.content if spec.endpoint == "chat" else choice.text
                if text and ttft is None:
                    ttft = time.monotonic() - start
                seen = choices.setdefault(choice.index, Choice())
                seen.text += text or ""
                if choice.finish_reason:
                    seen.finish_reason = choice.finish_reason
                    seen.stop_reason = getattr(choice, "stop_reason", None)
            num_chunks += 1
            if num_chunks == spec.cancel_after_chunks:
                break
        else:
            outcome = finished(spec, start, choices, usage)
            outcome.ttft_s = ttft
            return outcome
    return Outcome("cancelled", spec.kind, time.monotonic() - start, ttft)


async def run_unary(client: openai.AsyncOpenAI, model: str, spec: RequestSpec) -> Outcome:
    """One unary call; cancelled (its task, hence its connection) after ``cancel_after_s``."""
    start = time.monotonic()
    create = client.chat.completions if spec.endpoint == "chat" else client.completions
    call = asyncio.ensure_future(create.create(**spec.create_kwargs(model)))
    done, _ = await asyncio.wait({call}, timeout=spec.cancel_after_s)
    if not done:
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        return Outcome("cancelled", spec.kind, time.monotonic() - start)
    resp = call.result()
    choices = {
        c.index: Choice(
            (c.message.content or "") if spec.endpoint == "chat" else c.text,
            c.finish_reason,
            getattr(c, "stop_reason", None),
        )
        for c in resp.choices
    }
    return finished(spec, start, choices, resp.usage)


async def run_request(client: openai.AsyncOpenAI, model: str, spec: RequestSpec) -> Outcome:
    start = time.monotonic()
    try:
        run = run_stream if spec.stream else run_unary
        return await run(client, model, spec)
    except Exception as exc:  # noqa: BLE001 - every error is counted, none ends the loop
        return error_outcome(spec, start, exc)


@dataclass(slots=True)
class Tally:
    """Every outcome of the run, in one place (one event loop: no locks)."""

    outcomes: list[Outcome] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)  # requests started, by kind
    num_cancels_asked: int = 0

    def counts(self) -> dict[str, int]:
        counts = Counter(o.status for o in self.outcomes)
        statuses = ("completed", "cancelled", *UNEXPECTED)
        return {"started": sum(self.kinds.values()), **{s: counts[s] for s in statuses}}

    def errors(self, limit: int = 10) -> list[str]:
        """The first distinct details of unexpected outcomes."""
        details = dict.fromkeys(o.detail for o in self.outcomes if o.status in UNEXPECTED)
        return list(details)[:limit]


async def client_loop(
    client: openai.AsyncOpenAI,
    model: str,
    rng: random.Random,
    deadline: float,
    cancel_fraction: float,
    tally: Tally,
) -> None:
    """Send one request after another until ``deadline``."""
    while time.monotonic() < deadline:
        spec = pick_spec(rng, cancel_fraction)
        tally.kinds[spec.kind] += 1
        tally.num_cancels_asked += spec.is_cancel
        tally.outcomes.append(await run_request(client, model, spec))
