"""After a known request mix, every service's /metrics and the frontend's request log
count exactly what was sent, and the Grafana dashboard only queries series that exist."""

from __future__ import annotations

import re
import time
import urllib.request
from collections import Counter

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launch import LocalStack
from tests.metric_names import dashboard_metric_names

SERVICES = ("gateway", "frontend", "scheduler", "detokenizer")
# StageTimes in the order a request reaches them.
LIFE = ("received", "templated", "tokenized", "dispatched", "queued", "scheduled")
LIFE += ("first_token", "finished", "detokenized")
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(stack: LocalStack, service: str) -> Series:
    with urllib.request.urlopen(stack.ports.metrics_url(service), timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(series: Series, name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in series.items() if n == name and want <= ls)


class Delta:
    """What changed in one service's metrics between two scrapes."""

    def __init__(self, before: Series, after: Series) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


def since(stack: LocalStack, service: str, before: Series) -> Delta:
    """What changed in ``service``'s metrics from ``before`` to a scrape now."""
    return Delta(before, scrape(stack, service))


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "metrics did not settle in time"
        time.sleep(0.1)


def request_log_lines(stack: LocalStack) -> list[str]:
    assert stack.log_dir is not None
    text = (stack.log_dir / "frontend.log").read_text(errors="replace")
    return [line for line in text.splitlines() if "request finished" in line]


def test_a_known_mix_is_counted_exactly(
    stack: LocalStack, client: openai.OpenAI, model_id: str
) -> None:
    before = {s: scrape(stack, s) for s in SERVICES}
    logged_before = len(request_log_lines(stack))

    # The mix: three chats, one streamed completion, one refused request.
    usages, finishes = [], Counter()
    for i, max_tokens in enumerate((3, 5, 8)):
        chat = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": f"Count to {i + 3}, please."}],
            max_tokens=max_tokens,
            temperature=0,
            extra_headers={"X-Tokenline-Debug": "1"},
        )
        usages.append(chat.usage)
        finishes[chat.choices[0].finish_reason] += 1
        # The stage breakdown, on request: stamps in order, stages tiling the request.
        debug = chat.model_extra["debug"]
        times, stages = debug["times"], debug["stages_ms"]
        stamps = [times[name] for name in LIFE]
        assert stamps == sorted(stamps) and stamps[0] > 0
        tiling = sum(v for k, v in stages.items() if k not in ("time_to_first_token", "end_to_end"))
        assert tiling == pytest.approx(stages["end_to_end"], abs=0.01)
    chunks = list(
        client.completions.create(
            model=model_id,
            prompt="Once upon a time",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"X-Tokenline-Debug": "1"},
        )
    )
    usages.append(chunks[-1].usage)
    (finish_chunk,) = [c for c in chunks if c.model_extra.get("debug")]
    assert finish_chunk.choices[0].finish_reason == "length"
    assert finish_chunk.model_extra["debug"]["stages_ms"]["decode"] > 0
    (finish,) = filter(None, (c.choices[0].finish_reason for c in chunks if c.choices))
    finishes[finish] += 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], temperature=-1
        )

    num = len(usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    # The scheduler hands its stats over after each step; wait for the last one.
    ended = "tokenline:e2e_request_latency_seconds_count"
    wait_for(lambda: since(stack, "scheduler", before["scheduler"])(ended) == num)
    d = {s: since(stack, s, before[s]) for s in SERVICES}

    sched = d["scheduler"]
    for reason in ("stop", "length", "abort"):
        expected = finishes.get(reason, 0)
        assert sched("tokenline:request_success_total", finished_reason=reason) == expected
    assert sched("tokenline:prompt_tokens_total") == prompt_tokens
    assert sched("tokenline:generation_tokens_total") == generated
    assert sched("tokenline:prefix_cache_queries_total") == prompt_tokens
    assert sched("tokenline:prefix_cache_hits_total") == cached
    assert sched("tokenline:time_to_first_token_seconds_count") == num
    assert sched("tokenline:inter_token_latency_seconds_count") == generated - num
    for stage in ("queue", "prefill", "decode"):
        assert sched(f"tokenline:request_{stage}_time_seconds_count") == num
    assert sched("tokenline:request_generation_tokens_sum") == generated
    # One at a time, each request is a batch of one (dispatch/add_request_batcher.py).
    assert sched("tokenline_grpc_server_handled_total", grpc_method="AddRequests") == num
    assert (
        sched("tokenline_grpc_server_handled_total", grpc_method="AddRequests", grpc_code="OK")
        == num
    )

    front = d["frontend"]
    for stage in ("template", "tokenize", "dispatch", "queue", "prefill", "decode", "detokenize"):
        assert front("tokenline_frontend_stage_seconds_count", stage=stage) == num, stage
    for reason in ("stop", "length"):
        expected = finishes.get(reason, 0)
        assert front("tokenline_frontend_finished_choices_total", finish_reason=reason) == expected
    assert front("tokenline_frontend_tokenizer_batch_size_sum") >= num
    handled = "tokenline_grpc_server_handled_total"
    assert front(handled, grpc_method="ChatCompletion", grpc_code="OK") == 3
    assert front(handled, grpc_method="ChatCompletion", grpc_code="INVALID_ARGUMENT") == 1
    # The gateway's streams ride its one Multiplex call: counted per stream and per batch.
    assert front("tokenline_frontend_mux_streams_total", kind="completion", grpc_code="OK") == 1
    assert front("tokenline_frontend_mux_batch_frames_sum") == len(chunks) + 1  # + its end

    detok = d["detokenizer"]
    # The streamed completion (the last request) sends a row per token; each unary request
    # sends one final row with all of its tokens (the scheduler's stream_interval rule).
    streamed = usages[-1].completion_tokens
    assert detok("tokenline_detokenizer_rows_total") == (num - 1) + streamed
    assert detok("tokenline_detokenizer_batch_seconds_count") >= streamed

    gateway = d["gateway"]
    route = "/v1/chat/completions"
    assert gateway("tokenline_gateway_requests_total", route=route, status="200") == 3
    assert gateway("tokenline_gateway_requests_total", route=route, status="400") == 1
    assert gateway("tokenline_gateway_requests_total", route="/v1/completions", status="200") == 1

    # One log line per finished request, carrying its counts and stage times.
    logged = request_log_lines(stack)[logged_before:]
    assert len(logged) == num
    for line in logged:
        assert re.search(r"rid=\S+ label=\S+ finish_reason=(stop|length)", line)
        assert "prefill_ms=" in line and "detokenize_ms=" in line
    assert sorted(int(re.search(r"completion_tokens=(\d+)", line)[1]) for line in logged) == sorted(
        u.completion_tokens for u in usages
    )


def test_an_abandoned_stream_is_counted_as_an_abort(
    stack: LocalStack, client: openai.OpenAI, model_id: str
) -> None:
    before = scrape(stack, "scheduler")
    stream = client.completions.create(
        model=model_id,
        prompt="Tell me a very long story",
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()
    aborted = "tokenline:request_success_total"
    wait_for(lambda: since(stack, "scheduler", before)(aborted, finished_reason="abort") == 1)
    d = since(stack, "scheduler", before)
    assert d("tokenline:request_success_total", finished_reason="length") == 0
    assert d("tokenline:e2e_request_latency_seconds_count") == 1
    assert 3 <= d("tokenline:generation_tokens_total") < 2000


def test_the_dashboard_queries_only_series_the_stack_exports(stack: LocalStack) -> None:
    exported = {name for s in SERVICES for name, _ in scrape(stack, s)}
    missing = dashboard_metric_names() - exported
    assert not missing, f"the dashboard queries series no service exports: {sorted(missing)}"


def test_gauges_report_an_idle_stack(stack: LocalStack) -> None:
    wait_for(lambda: total(scrape(stack, "scheduler"), "tokenline:num_requests_running") == 0)
    series = scrape(stack, "scheduler")
    assert total(series, "tokenline:num_requests_running") == 0
    assert total(series, "tokenline:num_requests_waiting") == 0
    usage = total(series, "tokenline:kv_cache_usage_perc")
    assert 0.0 <= usage < 0.01  # nothing runs: only evictable cache may remain
    detok = scrape(stack, "detokenizer")
    assert total(detok, "tokenline_detokenizer_live_states") == 0
    assert total(detok, "tokenline_detokenizer_subscribers") == 1
