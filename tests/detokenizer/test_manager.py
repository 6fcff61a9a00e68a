"""DetokenizerManager: state lifecycle, capacity, flag groups and routing (DeepSeek tokenizer)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry
from tokenline.v1 import common_pb2

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.metrics import DetokenizerMetrics
from services.detokenizer.server import DetokenizerServicer
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder
from tests.detokenizer.families import Family
from tests.detokenizer.harness import ABORT, LENGTH, push, row, stop_str

KIND_ABORT = common_pb2.FinishReason.KIND_ABORT


class SpyDecoder(TextDecoder):
    """The real decoder, recording each batch call's flags and sequence count."""

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        self.calls: list[tuple[DecodeFlags, int]] = []

    def decode_batch(self, seqs: Sequence[list[int]], flags: DecodeFlags) -> list[str]:
        self.calls.append((flags, len(seqs)))
        return super().decode_batch(seqs, flags)


@pytest.mark.parametrize("finish", [LENGTH, stop_str("world"), ABORT], ids=str)
def test_state_is_deleted_on_the_final_row(bytelevel: Family, finish) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    ids = bytelevel.encode("hello world")
    push(manager, row("r", ids[:1], init=True, stop=["world"]))
    assert "r" in manager.states
    last = row("r", ids[1:], finish=finish)
    last.times.finished = time.time()
    (final,) = push(manager, last)["fe"]
    assert final.finish_reason == finish
    assert final.HasField("usage")
    assert not manager.states
    # The scheduler's stamps pass through; the detokenizer adds its own, after them.
    assert final.times.finished == last.times.finished
    assert last.times.finished <= final.times.detokenized <= time.time()


def test_abort_before_any_token_creates_and_deletes_in_one_row(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    (final,) = push(manager, row("r", [], init=True, finish=ABORT))["fe"]
    assert final.text == "" and final.finish_reason.kind == KIND_ABORT
    assert not manager.states


def test_rows_for_unknown_rids_are_dropped_and_counted(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    push(manager, row("done", [100], init=True, finish=LENGTH))
    assert push(manager, row("done", [101]), row("never", [5])) == {}
    assert manager.stats.num_dropped_rows == 2


def test_full_table_refuses_new_request_naming_the_flag(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder, max_states=1)
    hello, world = bytelevel.encode("hello"), bytelevel.encode(" world")
    push(manager, row("a", hello, init=True))
    (refusal,) = push(manager, row("b", hello, init=True))["fe"]
    assert refusal.rid == "b" and refusal.finish_reason.kind == KIND_ABORT
    assert "--max-decode-states" in refusal.finish_reason.message
    assert push(manager, row("b", world)) == {}  # the refused request's later rows
    (a_final,) = push(manager, row("a", world, finish=LENGTH))["fe"]
    assert a_final.text == " world"  # the live state was untouched
    assert "c" in {r.rid for r in push(manager, row("c", hello, init=True))["fe"]}
    assert manager.stats.num_refused_requests == 1


def test_each_flag_group_gets_its_own_decode_call(sentencepiece: Family) -> None:
    """With the window engine (SentencePiece byte fallback), the one that calls decode."""
    family = sentencepiece
    spy = SpyDecoder(family.tokenizer)
    manager = DetokenizerManager(spy)
    bos = family.tokenizer.bos_token_id
    ids = [bos, *family.encode("hello")]
    routed = push(
        manager,
        row("skip", ids, init=True, skip=True, finish=LENGTH),
        row("keep", ids, init=True, skip=False, finish=LENGTH),
        row("keep-nospace", ids, init=True, skip=False, spaces=False, finish=LENGTH),
        row("skip-too", ids, init=True, skip=True, finish=LENGTH),
    )
    texts = {r.rid: r.text for r in routed["fe"]}
    assert texts["skip"] == texts["skip-too"] == family.decode(ids, True) == "hello"
    assert texts["keep"] == family.decode(ids, False) != "hello"
    assert sorted(n for _, n in spy.calls) == [2, 2, 4]  # two final windows per row
    assert len({flags for flags, _ in spy.calls}) == 3


def test_rows_are_routed_to_the_frontend_that_owns_the_rid(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    ids = bytelevel.encode("hi")
    routed = push(
        manager,
        row("a", ids, init=True, reply_to="fe-1"),
        row("b", ids, init=True, reply_to="fe-2"),
        row("c", ids, init=True, reply_to="fe-1"),
    )
    assert {k: [r.rid for r in v] for k, v in routed.items()} == {
        "fe-1": ["a", "c"],
        "fe-2": ["b"],
    }


def test_ending_a_source_aborts_only_its_requests(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    ids = bytelevel.encode("hi")
    push(manager, row("a", ids, init=True), source="s1")
    push(manager, row("b", ids, init=True, reply_to="fe-2"), source="s2")
    routed = manager.release_source("s1", "scheduler stream ended")
    (aborted,) = routed["fe"].rows
    assert aborted.rid == "a" and aborted.finish_reason.message == "scheduler stream ended"
    assert list(manager.states) == ["b"]


def test_a_second_request_with_a_live_rid_is_refused_not_mixed_in(bytelevel: Family) -> None:
    manager = DetokenizerManager(bytelevel.decoder)
    hello, other = bytelevel.encode("hello"), bytelevel.encode(" other")
    push(manager, row("r", hello, init=True, reply_to="fe-1"), source="s1")
    # Another frontend's request with the same rid, from another scheduler:
    routed = push(manager, row("r", other, init=True, reply_to="fe-2"), source="s2")
    (refused,) = routed["fe-2"]
    assert (
        refused.finish_reason.kind == KIND_ABORT and "already live" in refused.finish_reason.message
    )
    assert "fe-1" not in routed  # the live request is not told anything
    assert push(manager, row("r", other, finish=LENGTH), source="s2") == {}  # dropped
    (final,) = push(manager, row("r", [], finish=LENGTH), source="s1")["fe-1"]
    assert final.text == "" and final.finish_reason.kind == LENGTH.kind
    assert manager.stats.num_duplicate_rids == 1 and not manager.states


def test_metrics_read_the_manager_at_scrape_time(bytelevel: Family) -> None:
    registry = CollectorRegistry()
    manager = DetokenizerManager(bytelevel.decoder, max_states=1)
    DetokenizerMetrics(registry).track(manager, DetokenizerServicer(manager))
    push(manager, row("a", [100], init=True), row("b", [100], init=True), row("x", [5]))
    value = registry.get_sample_value
    assert value("tokenline_detokenizer_live_states") == 1
    assert value("tokenline_detokenizer_refused_requests") == 1
    assert value("tokenline_detokenizer_dropped_rows") == 1
