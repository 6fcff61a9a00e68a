"""bench.split end to end in a short mode: a real stack and the in-process engine run the
same requests, and the report holds each cell's ratio and every process's CPU per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import split


@pytest.mark.live  # a real four-process stack and an engine process
def test_a_short_run_reports_the_ratio_and_each_process_cpu(
    default_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "split.json"
    split.main(
        ["--model", str(default_model_dir), "--concurrency", "4", "--input-len", "16"]
        + ["--output-len", "8", "--temperatures", "1.0", "--rounds", "1"]
        + ["--floor-messages", "16", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    assert cell["concurrency"] == 4 and cell["temperature"] == 1.0
    assert cell["engine_tok_s"] > 0 and cell["stack_tok_s"] > 0
    assert cell["ratio"] == cell["round_ratios"][0] > 0
    assert cell["engine_alone_cpu_us_per_token"] > 0
    stack = cell["stack_cpu_us_per_token"]
    services = {"gateway", "frontend", "scheduler", "detokenizer", "engine", "load generator"}
    assert set(stack) == services
    # The engine process computes the tokens: it used the most CPU of all (the others'
    # few milliseconds here may round to a 10 ms /proc tick or to none).
    assert stack["engine"] > 0 and stack["engine"] == max(stack.values())
    # Both sides had every first token before their 8th: each phase took time.
    for side in ("engine", "stack"):
        phases = cell["phases_ms"][side]
        assert phases["first_tokens"] > 0 and phases["after"] > 0
    assert report["grpc_floor_us_per_message"]["client_read_us_per_message"] > 0


def test_scheduler_flags_reach_both_sides_and_name_the_report() -> None:
    args = split.parse_args(["--stream-interval", "4", "--overlap-schedule"])
    assert split.engine_flags(args) == ["--stream-interval", "4", "--overlap-schedule"]
    assert split.default_out(args).name == "split-interval4-overlap.json"
    plain = split.parse_args([])
    assert split.engine_flags(plain) == ["--stream-interval", "1"]
    assert split.default_out(plain).name == "split.json"


def test_the_token_count_comes_from_the_last_usage_frame_of_the_tail() -> None:
    frames = [
        b'data: {"choices":[{"text":"a"}],"usage":null}',
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}',
        b"data: [DONE]",
    ]
    stream = b"\n\n".join(frames) + b"\n\n"
    assert split.completion_tokens(stream) == 7
    assert split.completion_tokens(stream[20:]) == 7  # a tail that starts mid-frame
    assert split.completion_tokens(b"\n\n".join([frames[0], frames[2]])) == 0
