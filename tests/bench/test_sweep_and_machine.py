"""The pure parts of `bench.serve sweep` and `bench.machine`: pairing cells into ratios,
and reading a CPU's model and flags (machines of one kind differ)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from bench.machine import cpu_model_and_flags, describe
from bench.serve import cli
from bench.serve.datasets import build_dataset
from bench.serve.sweep import cell_args, create_parser, ratio_rows, server_dtype, table_lines

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 vaes
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 vaes
"""


def test_cpu_model_and_the_flags_that_matter() -> None:
    model, flags = cpu_model_and_flags(CPUINFO)
    assert model == "AMD EPYC 9R14"
    assert flags == ["avx2", "avx512f", "avx512_bf16"]  # not amx, not the noise
    info = {"cpu": model, "cpu_flags": flags, "cpu_count": 2, "torch": "2.13.0"}
    assert describe(info) == "AMD EPYC 9R14 (2 cores; avx2,avx512f,avx512_bf16); torch 2.13.0"


def cell(server: str, setting: str, temp: float, conc: int, tok_s: float, ttft: float) -> dict:
    return {
        "server": server,
        "setting": setting,
        "temperature": temp,
        "concurrency": conc,
        "output_tok_s": tok_s,
        "ttft_p50_ms": ttft,
        "ttft_p90_ms": 3 * ttft if server == "tokenline" else 2 * ttft,
        "dispatch_p50_ms": 2.0 if server == "tokenline" else None,
        "steady_dispatch_p50_ms": 1.0 if server == "tokenline" else None,
    }


def test_ratios_pair_the_same_setting_temperature_and_concurrency() -> None:
    cells = [
        cell("tokenline", "defaults", 1.0, 32, 800.0, 100.0),
        cell("tokenline", "defaults", 0.0, 32, 900.0, 90.0),
        cell("transformers", "defaults", 0.0, 32, 300.0, 360.0),
        cell("transformers", "defaults", 1.0, 32, 400.0, 400.0),
        cell("tokenline", "float32", 1.0, 32, 500.0, 100.0),  # no peer cell: no ratio
    ]
    rows = {(r["setting"], r["temperature"]): r for r in ratio_rows(cells)}
    assert set(rows) == {("defaults", 1.0), ("defaults", 0.0)}
    assert rows[("defaults", 1.0)]["throughput_ratio"] == pytest.approx(2.0)
    assert rows[("defaults", 1.0)]["ttft_p50_ratio"] == pytest.approx(0.25)
    assert rows[("defaults", 1.0)]["ttft_p90_ratio"] == pytest.approx(300.0 / 800.0)
    assert rows[("defaults", 0.0)]["throughput_ratio"] == pytest.approx(3.0)
    lines = table_lines(list(rows.values()))
    assert len(lines) == 3 and "2.00" in lines[1] and "1.00 ms" in lines[1]
    assert "p90" in lines[0] and "0.38" in lines[1]


def test_each_server_runs_at_its_own_default_or_the_named_dtype() -> None:
    assert server_dtype("defaults") == "auto"
    assert server_dtype("float32") == "float32"


def test_rounds_pair_within_a_round_and_report_medians() -> None:
    """Each round's tokenline cell is divided by the same round's peer cell (not by a
    median of the peer), and the row reports the median of those ratios."""
    cells = [
        cell("tokenline", "defaults", 1.0, 32, tok_s, 100.0) | {"round": r}
        for r, tok_s in enumerate([900.0, 600.0, 1000.0])
    ] + [
        cell("transformers", "defaults", 1.0, 32, tok_s, 400.0) | {"round": r}
        for r, tok_s in enumerate([300.0, 400.0, 400.0])
    ]
    (row,) = ratio_rows(cells)
    assert row["rounds"] == 3
    assert row["round_throughput_ratios"] == pytest.approx([3.0, 1.5, 2.5])
    assert row["throughput_ratio"] == pytest.approx(2.5)  # not 900 / 400
    assert row["tokenline_tok_s"] == pytest.approx(900.0)
    assert row["peer"] == "transformers" and row["peer_tok_s"] == pytest.approx(400.0)
    assert "3.00, 1.50, 2.50" in table_lines([row])[1]
    # A round the peer did not finish has no pair: it is left out, not divided by None.
    (partial,) = ratio_rows(cells[:3] + cells[3:5])
    assert partial["round_throughput_ratios"] == pytest.approx([3.0, 1.5])


def test_every_cell_sends_prompts_no_other_cell_sent(tokenizer: PreTrainedTokenizerBase) -> None:
    """A prompt sent again would be served from tokenline's prefix cache, not prefilled."""
    args = create_parser().parse_args(["--concurrency", "4", "8", "--min-prompts", "2"])
    seen: set[str] = set()
    grid = [(t, c) for t in (1.0, 0.0) for c in (4, 8)]
    for index, (temperature, concurrency) in enumerate(grid):
        one = cell_args(args, concurrency, temperature, index)
        assert (one.temperature, one.max_concurrency) == (temperature, concurrency)
        for seed in (one.seed, one.seed + 1):  # the measured prompts and the warm-up's
            config = cli.dataset_config(one, one.num_prompts, seed)
            prompts = {p.user for p in build_dataset(config, tokenizer)}
            assert len(prompts) == one.num_prompts
            assert not prompts & seen
            seen |= prompts
