"""One streaming OpenAI request, timed per SSE chunk.

aiohttp rather than the openai SDK: the SDK retries 5xx and 429 on its own (which
would hide failures and stretch latencies) and parses every frame into objects;
here each `data:` line is stamped with `perf_counter()` the moment it arrives.
aiohttp rather than httpx (as vLLM's `bench serve`): the load generator shares the
machine with the server it measures; reading 32 streams, httpx's pure-Python HTTP stack
took 11 % of a core, aiohttp's C parser 5 %.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from bench.serve.datasets import BenchPrompt

Endpoint = Literal["chat", "completions"]
ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """What every request of a run carries besides its prompt."""

    base_url: str
    model: str
    endpoint: Endpoint = "chat"
    api_key: str = "unused"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    debug_stages: bool = False  # ask tokenline for each request's stage breakdown


@dataclass(slots=True)
class RequestResult:
    """Timings of one request. Times in seconds; `start_s` from the run's start."""

    start_s: float
    success: bool = False
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    is_usage_from_server: bool = False
    text: str = ""
    error: str = ""
    stages_ms: dict[str, float] = field(default_factory=dict)  # tokenline's, when asked


def request_url(settings: RequestSettings) -> str:
    path = "chat/completions" if settings.endpoint == "chat" else "completions"
    return f"{settings.base_url.rstrip('/')}/{path}"


def request_body(settings: RequestSettings, prompt: BenchPrompt) -> dict[str, Any]:
    """The JSON body; `ignore_eos` only when asked (strict peers reject unknown fields)."""
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": prompt.output_len,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.endpoint == "completions":
        body["prompt"] = prompt.completion_text()
    else:
        system = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
        body["messages"] = [*system, {"role": "user", "content": prompt.user}]
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a chat or completion chunk carries ('' for role/usage chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class ChunkTimer:
    """Folds the stream's chunks into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, sent_at: float) -> None:
        self.result = result
        self.sent_at = sent_at
        self.last_at: float | None = None
        self.parts: list[str] = []

    def on_chunk(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            raise StreamError(_error_message(chunk))
        debug = chunk.get("debug")
        if debug:
            self.result.stages_ms = dict(debug.get("stages_ms") or {})
        usage = chunk.get("usage")
        if usage:
            self.result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.result.output_tokens = int(usage.get("completion_tokens") or 0)
            self.result.is_usage_from_server = True
        text = chunk_text(chunk)
        if not text:
            return
        if self.last_at is None:
            self.result.ttft_s = now - self.sent_at
        else:
            self.result.itl_s.append(now - self.last_at)
        self.last_at = now
        self.parts.append(text)

    def finish(self, now: float) -> RequestResult:
        if self.last_at is None:
            raise StreamError("the stream ended without generated text")
        self.result.e2e_s = now - self.sent_at
        self.result.text = "".join(self.parts)
        self.result.success = True
        return self.result


class StreamError(Exception):
    """The server answered, but not with a usable stream."""


def _error_message(payload: dict[str, Any]) -> str:
    error = payload.get("error")
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:ERROR_TEXT_LIMIT]


async def send_request(
    client: aiohttp.ClientSession, settings: RequestSettings, prompt: BenchPrompt, run_start: float
) -> RequestResult:
    """Send one streaming request; failures are recorded in the result, never raised."""
    sent_at = time.perf_counter()
    result = RequestResult(start_s=sent_at - run_start)
    timer = ChunkTimer(result, sent_at)
    headers = {"Authorization": f"Bearer {settings.api_key}"}
    if settings.debug_stages:
        headers["X-Tokenline-Debug"] = "1"
    try:
        async with client.post(
            request_url(settings), json=request_body(settings, prompt), headers=headers
        ) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                raise StreamError(f"HTTP {response.status}: {body[:ERROR_TEXT_LIMIT]}")
            await _read_events(response, timer)
        return timer.finish(time.perf_counter())
    except StreamError as exc:
        result.error = str(exc)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]
    return result


def new_session(limit: int, timeout_s: float) -> aiohttp.ClientSession:
    """One session for a run: up to ``limit`` connections, kept alive."""
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0)
    # read_bufsize bounds one line (one SSE frame); a frame with usage and stages is small.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**18)


async def _read_events(response: aiohttp.ClientResponse, timer: ChunkTimer) -> None:
    """Each `data:` line to the timer, stamped on arrival; stops at `[DONE]` or EOF."""
    async for raw in response.content:
        now = time.perf_counter()
        if not raw.startswith(b"data:"):
            continue
        data = raw[len(b"data:") :].strip()
        if data == b"[DONE]":
            return
        timer.on_chunk(json.loads(data), now)
