"""bench.soak at a tiny scale (8 loops for 2 s) so the soak's code cannot rot, plus its
client's response checks and request mix (bench/soak_client.py) on their own."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import soak
from bench.soak_client import Choice, RequestSpec, Tally, check_choices, pick_spec


def spec(n: int = 1, stop: tuple[str, ...] = ()) -> RequestSpec:
    return RequestSpec("chat", False, n, 16, False, stop, "hi", None, None)


USAGE = SimpleNamespace(completion_tokens=4)


def test_check_choices_flags_what_a_client_would_notice() -> None:
    ok = Choice("abc", "stop", "e")
    assert check_choices(spec(n=2, stop=("e",)), {0: ok, 1: Choice("xy", "length")}, USAGE) == ""
    assert "choices" in check_choices(spec(n=2), {0: ok}, USAGE)
    assert "usage" in check_choices(spec(), {0: ok}, None)
    assert "finish_reason" in check_choices(spec(), {0: Choice("abc", None)}, USAGE)
    assert "stop string" in check_choices(spec(stop=("b",)), {0: ok}, USAGE)
    assert "stop_reason" in check_choices(spec(stop=("x",)), {0: ok}, USAGE)


def test_the_mix_is_seeded_and_holds_every_kind() -> None:
    assert pick_spec(random.Random("0-1"), 0.2) == pick_spec(random.Random("0-1"), 0.2)
    rng = random.Random(7)
    specs = [pick_spec(rng, 0.2) for _ in range(2000)]
    assert {s.kind for s in specs} == {
        "chat-stream", "chat-unary", "completions-stream", "completions-unary"
    }  # fmt: skip
    assert {s.n for s in specs} == {1, 2, 3}
    assert all(8 <= s.max_tokens <= 64 for s in specs)
    cancels = sum(s.is_cancel for s in specs) / len(specs)
    assert 0.15 < cancels < 0.25
    assert any(s.stop for s in specs) and any(s.greedy for s in specs)


@pytest.mark.live  # a real four-process stack
def test_tiny_soak_counts_every_request_and_leaves_nothing_live(
    default_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "soak.json"
    code = soak.main(
        ["--concurrency", "8", "--duration-s", "2", "--warmup-s", "0.5"]
        + ["--cancel-fraction", "0.5", "--model-dir", str(default_model_dir), "--out", str(out)]
    )
    report = json.loads(out.read_text())
    counts = report["counts"]
    assert report["unexpected_failures"] == 0, report["errors"]
    assert counts["started"] == sum(report["kinds"].values())
    assert counts["started"] == sum(v for k, v in counts.items() if k != "started")
    assert counts["completed"] > 0 and counts["cancelled"] > 0
    assert report["completion_tokens"] > 0 and report["latency_ms"]["e2e_p50"] > 0
    assert report["live_state_after"] == {
        "frontend_requests": 0, "scheduler_requests": 0, "kv_tokens_held": 0, "decode_states": 0
    }  # fmt: skip
    assert set(report["rss"]) == set(soak.RSS_TRACKED)  # the engine process included
    assert all(r["warm_mib"] > 0 and r["end_mib"] > 0 for r in report["rss"].values())
    assert len(report["rss_timeline"]) >= 2
    # RSS growth is not asserted: 2 s are all warm-up. The verdict must match the criteria.
    assert report["passed"] == all(report["criteria"].values())
    assert code == (0 if report["passed"] else 1)


def test_rss_growth_reads_the_floor_not_the_transient_peaks() -> None:
    """A flat floor with peaks (a step's buffers) is no growth, however the peaks fall;
    a floor that rises by 8 % is."""

    def timeline(floor_at: Callable[[int], float], peaks: set[int]) -> list[dict[str, float]]:
        return [
            {"t_s": float(t)} | dict.fromkeys(soak.RSS_TRACKED, floor_at(t) + 80 * (t in peaks))
            for t in range(60)
        ]

    def growth(rows: list[dict[str, float]]) -> float:
        load = soak.LoadResult(Tally(), window_s=60.0, rss_timeline=rows)
        return soak.rss_growth(load, 10.0, dict.fromkeys(soak.RSS_TRACKED, 0.0))["engine"]["growth"]

    # Peaks on 3 of the last 5 samples (a median of five would read +7 %), none early.
    flat = timeline(lambda t: 1120.0, peaks={55, 57, 59})
    assert growth(flat) == 0.0
    rising = timeline(lambda t: 1120.0 + 1.6 * t, peaks={11, 13})
    assert growth(rising) > soak.MAX_RSS_GROWTH
