"""Stage latencies reach Prometheus and the request log from a finished choice's stamps."""

from __future__ import annotations

import json
import logging

import pytest
from prometheus_client import CollectorRegistry
from tokenline.v1 import common_pb2, detokenizer_pb2

from services.common.logs import log_formatter
from services.common.stages import STAGES, stage_durations
from services.frontend.metrics import FrontendMetrics
from services.frontend.request_log import log_finished, request_fields

# One request's stamps, as the frontend, scheduler and detokenizer set them.
TIMES = common_pb2.StageTimes(
    received=10.0,
    templated=10.001,
    tokenized=10.003,
    dispatched=10.004,
    queued=10.006,
    scheduled=10.010,
    first_token=10.050,
    finished=10.450,
    detokenized=10.452,
)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_the_tiling_stages_add_up_to_end_to_end() -> None:
    got = stage_durations(TIMES)
    assert set(got) == set(STAGES)
    tiling = [s for s in STAGES if s not in ("time_to_first_token", "end_to_end")]
    assert sum(got[s] for s in tiling) == pytest.approx(got["end_to_end"])
    assert got["prefill"] == pytest.approx(0.040)
    assert got["detokenize"] == pytest.approx(0.002)


def test_every_stage_is_observed_from_the_stamps() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    metrics.observe_finished(final_row())
    for stage in STAGES:
        assert sample(registry, "tokenline_frontend_stage_seconds_count", stage=stage) == 1
    ttft = sample(registry, "tokenline_frontend_stage_seconds_sum", stage="time_to_first_token")
    assert ttft == pytest.approx(0.050)
    finished = sample(registry, "tokenline_frontend_finished_choices_total", finish_reason="length")
    assert finished == 1


def test_missing_or_skewed_stamps_are_skipped_not_counted_as_zero() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    # A detokenizer clock behind the scheduler's: "detokenize" would be negative.
    skewed = detokenizer_pb2.StrRow(rid="r")
    skewed.times.CopyFrom(common_pb2.StageTimes(received=1.0, finished=2.0, detokenized=1.5))
    metrics.observe_finished(skewed)
    assert sample(registry, "tokenline_frontend_stage_seconds_count", stage="end_to_end") == 1
    assert sample(registry, "tokenline_frontend_stage_seconds_count", stage="detokenize") is None
    assert sample(registry, "tokenline_frontend_stage_seconds_count", stage="queue") is None


def test_gauges_read_their_owners_and_tokenizer_calls_are_recorded() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    live = [3]
    metrics.track(lambda: live[0], lambda: 7)
    metrics.observe_batch(64, 0.004)
    assert sample(registry, "tokenline_frontend_live_requests") == 3
    live[0] = 0
    assert sample(registry, "tokenline_frontend_live_requests") == 0
    assert sample(registry, "tokenline_frontend_aborts_sent") == 7
    assert sample(registry, "tokenline_frontend_tokenizer_batch_size_sum") == 64
    assert sample(registry, "tokenline_frontend_tokenizer_seconds_sum") == pytest.approx(0.004)


def final_row() -> detokenizer_pb2.StrRow:
    row = detokenizer_pb2.StrRow(rid="req-1", text="hi")
    row.finish_reason.kind = common_pb2.FinishReason.KIND_LENGTH
    row.usage.CopyFrom(
        common_pb2.Usage(prompt_tokens=12, completion_tokens=5, total_tokens=17, cached_tokens=4)
    )
    row.times.CopyFrom(TIMES)
    return row


@pytest.mark.parametrize("json_lines", [False, True], ids=["text", "json"])
def test_one_log_line_per_finished_request(
    json_lines: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tokenline.requests"):
        log_finished(final_row(), "client-7")
    (record,) = caplog.records
    line = log_formatter(json_lines).format(record)
    expected = request_fields(final_row(), "client-7")
    assert expected["stages_ms"]["queue"] == pytest.approx(4.0)
    if json_lines:
        got = json.loads(line)
        assert got["message"].startswith("request finished")
        assert got["logger"] == "tokenline.requests" and got["level"] == "INFO"
        assert {k: got[k] for k in expected} == expected
    else:
        assert "\n" not in line
        for key in (
            "rid=req-1",
            "label=client-7",
            "finish_reason=length",
            "prompt_tokens=12",
            "cached_tokens=4",
        ):
            assert key in line
        for stage, ms in expected["stages_ms"].items():
            assert f"{stage}_ms={ms}" in line


def test_usage_is_counted_by_key_name_and_not_without_keys() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    row = final_row()
    row.usage.prompt_tokens, row.usage.completion_tokens = 7, 3
    metrics.observe_finished(row, "alice")
    metrics.observe_finished(row)  # keys off: no per-key series
    assert sample(registry, "tokenline_frontend_key_choices_total", key="alice") == 1
    prompt = sample(registry, "tokenline_frontend_key_tokens_total", key="alice", kind="prompt")
    assert prompt == 7
    assert sample(registry, "tokenline_frontend_key_choices_total", key="") is None
