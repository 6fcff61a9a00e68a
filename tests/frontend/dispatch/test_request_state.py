"""ReqState lifecycle, coalescing of rows, and the rid table."""

from __future__ import annotations

import asyncio

import pytest
from tokenline.v1 import common_pb2, detokenizer_pb2

from services.common.errors import AlreadyExistsError
from services.frontend.dispatch.request_state import (
    ChoiceNews,
    ReqStage,
    ReqState,
    ReqStateTable,
    merged_times,
)


def row(text: str, ids: list[int], final: bool = False) -> detokenizer_pb2.StrRow:
    out = detokenizer_pb2.StrRow(
        rid="r",
        text=text,
        output_ids=ids,
        logprobs=[common_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in ids],
    )
    if final:
        out.finish_reason.kind = common_pb2.FinishReason.KIND_STOP
        out.usage.completion_tokens = 4
        out.times.scheduled = 2.0
        out.times.finished = 5.0
    return out


def new_state() -> ReqState:
    news = ChoiceNews(asyncio.get_running_loop())
    return ReqState(rid="r", index=3, sink=news, times=common_pb2.StageTimes(received=1))


async def test_rows_gathered_before_a_take_come_out_as_one_row() -> None:
    state = new_state()
    for piece, ids in [("Hel", [1]), ("lo ", [2, 3]), ("世界", [4])]:
        state.push(row(piece, ids))
    assert await state.sink.take() == [3]  # one notice, not three
    merged = state.take()
    assert merged.text == "Hello 世界" and list(merged.output_ids) == [1, 2, 3, 4]
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert not merged.HasField("finish_reason") and state.stage is ReqStage.RECEIVING
    state.push(row("!", [5], final=True))
    last = state.take()
    assert last.text == "!" and last.finish_reason.kind == common_pb2.FinishReason.KIND_STOP
    assert state.stage is ReqStage.FINISHED and not state.may_be_held


async def test_a_consumer_that_keeps_up_gets_the_detokenizers_row_uncopied() -> None:
    state = new_state()
    sent = row("Hel", [1])
    state.push(sent)
    assert state.take() is sent  # one non-final row: nothing to merge
    state.push(row("lo", [2], final=True))
    last = state.take()
    assert last.text == "lo" and last.times.received == 1  # a final row merges the stamps


async def test_final_times_keep_the_frontend_stamps_and_add_the_schedulers() -> None:
    state = new_state()
    state.push(row("a", [1], final=True))
    times = state.take().times
    assert times.received == 1 and times.scheduled == 2.0 and times.finished == 5.0
    assert times.first_token > 0  # the frontend's own stamp, the scheduler sent none


async def test_rows_after_the_final_one_are_ignored() -> None:
    state = new_state()
    state.push(row("a", [1], final=True))
    assert await state.sink.take() == [3]
    state.take()
    state.push(row("late", [9]))
    assert state.sink.pending() == [] and state.take().text == ""


async def test_the_stage_says_whether_the_scheduler_may_hold_the_rid() -> None:
    state = new_state()
    assert state.stage is ReqStage.CREATED and not state.may_be_held
    state.fail("detokenizer lost")  # nothing was sent: nothing to fail or abort
    assert state.stage is ReqStage.CREATED and state.error is None
    state.stage = ReqStage.SENT
    state.push(row("x", [1]))  # a row can beat the AddRequest reply
    assert state.stage is ReqStage.RECEIVING and state.may_be_held
    state.fail("detokenizer lost")
    assert state.stage is ReqStage.FAILED and state.error and state.may_be_held  # still there
    assert state.is_over
    state.push(row("late", [2]))  # ignored once over
    assert state.take().text == "x"


async def test_duplicate_rids_are_refused_all_or_nothing() -> None:
    table = ReqStateTable()
    sink = ChoiceNews(asyncio.get_running_loop())
    times = common_pb2.StageTimes(received=1)
    first = table.create_all(["a", "b"], sink, times)
    with pytest.raises(AlreadyExistsError):
        table.create_all(["c", "b"], sink, times)
    assert len(table) == 2 and table.get("c") is None
    with pytest.raises(AlreadyExistsError):
        table.create_all(["d", "d"], sink, times)
    assert len(table) == 2
    first[0].times.dispatched = 9  # each choice owns its stamps
    assert first[1].times.dispatched == 0


async def test_remove_drops_only_the_registered_state() -> None:
    table = ReqStateTable()
    news = ChoiceNews(asyncio.get_running_loop())
    (state,) = table.create_all(["a"], news, common_pb2.StageTimes())
    stranger = ReqState(rid="a", index=0, sink=news)
    table.remove(stranger)
    assert table.get("a") is state
    table.remove(state)
    assert len(table) == 0 and table.get("a") is None


def test_merged_times_prefers_nonzero_remote_stamps() -> None:
    local = common_pb2.StageTimes(received=1, tokenized=2, first_token=4)
    remote = common_pb2.StageTimes(received=0, first_token=3.5, finished=6)
    out = merged_times(local, remote)
    assert (out.received, out.tokenized, out.first_token, out.finished) == (1, 2, 3.5, 6)


async def test_choice_news_wakes_its_consumer_with_every_index_in_order() -> None:
    news = ChoiceNews(asyncio.get_running_loop())
    waiting = asyncio.ensure_future(news.take())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing posted yet
    news.post(2)
    news.post(0)  # before the consumer runs: both come in one take
    assert await waiting == [2, 0]
    assert news.pending() == []
    news.post(1)
    assert news.pending() == [1] and await news.take() == [1]
