"""DetokenizerManager: the rid -> DecodeStatus table, batched decoding, routing.

Transport-free: ``handle_batch`` takes one scheduler step (rows as protos, since
they pass through nearly unchanged) and returns, per frontend id, the StrRows
to send. A state is created on a row with ``has_init`` and deleted on the row
that carries a finish reason, whatever the reason, or when the scheduler
stream that created it ends. Frontends make rids unique across the cluster, so a
second ``has_init`` for a live rid is a fault somewhere upstream: it is refused,
never allowed to replace (or mix its rows into) the live state. A pooling request's one
row (its ``embedding``) has no text to decode: it passes through and no state is made.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from tokenline.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

from services.detokenizer.decode_status import DecodeStatus
from services.detokenizer.incremental import create_decode_status
from services.detokenizer.stop_strings import first_stop_at
from services.detokenizer.text_decoder import DecodeFlags, TextDecoder

logger = logging.getLogger(__name__)

# frontend id -> the rows to send it, built in place in the message that carries them
Routed = dict[str, detokenizer_pb2.BatchStrOutput]


@dataclass(slots=True)
class DetokenizerStats:
    num_dropped_rows: int = 0  # rows for a rid with no live state (or no subscriber)
    num_refused_requests: int = 0  # new rids refused because the table was full
    num_unstable_decodes: int = 0  # finals whose full decode did not extend what was sent
    num_duplicate_rids: int = 0  # a has_init for a rid that was already live: refused


@dataclass(slots=True)
class _RowWork:
    """One live row's decode work this step."""

    row: scheduler_pb2.TokenIDRow
    state: DecodeStatus
    is_final: bool
    seqs: tuple[list[int], ...] = ()  # what the state asked to have decoded
    texts: tuple[str, ...] = ()  # their decodes


class DetokenizerManager:
    """Owns every DecodeStatus; at most ``max_states`` live at once.

    A new rid past the limit gets an abort row naming ``--max-decode-states``;
    a live state is never evicted, since that would silently corrupt its output.
    """

    def __init__(self, decoder: TextDecoder, max_states: int = 65536) -> None:
        self.decoder = decoder
        self.max_states = max_states
        self.states: dict[str, DecodeStatus] = {}
        self.stats = DetokenizerStats()

    def handle_batch(self, batch: scheduler_pb2.BatchTokenIDOutput, source: str = "") -> Routed:
        """Decode one scheduler step; ``source`` names the stream it came from."""
        routed: Routed = defaultdict(detokenizer_pb2.BatchStrOutput)
        work: list[_RowWork] = []
        for row in batch.rows:
            if len(row.embedding):
                routed[row.reply_to].rows.append(pooled_row(row))
                continue
            state = self._live_state(row, source, routed)
            if state is not None:
                work.append(self._prepare(row, state))
        self._decode(work)
        for item in work:
            self._fill_row(item, routed[item.state.reply_to].rows.add())
        return dict(routed)

    def release_source(self, source: str, message: str) -> Routed:
        """End every live request that ``source`` created with an abort row.

        Called when that scheduler stream ends: rows may have been lost with it,
        so finishing the text later could be silently wrong.
        """
        routed: Routed = defaultdict(detokenizer_pb2.BatchStrOutput)
        rids = [rid for rid, state in self.states.items() if state.source == source]
        for rid in rids:
            state = self.states.pop(rid)
            routed[state.reply_to].rows.append(abort_row(rid, message))
        if rids:
            logger.warning("stream %s ended; aborted %d live requests", source, len(rids))
        return dict(routed)

    def _live_state(
        self, row: scheduler_pb2.TokenIDRow, source: str, routed: Routed
    ) -> DecodeStatus | None:
        if row.has_init:
            if (live := self.states.get(row.rid)) is not None:
                self._refuse_duplicate(row, live, routed)
                return None
            if len(self.states) >= self.max_states:
                routed[row.reply_to].rows.append(self._refuse(row.rid))
                return None
            self.states[row.rid] = self._create_state(row, source)
        state = self.states.get(row.rid)
        if state is None or state.source != source:  # unknown, or a refused duplicate's
            self.stats.num_dropped_rows += 1
            return None
        return state

    def _refuse_duplicate(
        self, row: scheduler_pb2.TokenIDRow, live: DecodeStatus, routed: Routed
    ) -> None:
        """Keep the live state; the newcomer's frontend, when it is another one, hears
        why (an abort row to the same frontend would end the live request instead)."""
        self.stats.num_duplicate_rids += 1
        logger.error("rid=%s is already live; refusing a second request with it", row.rid)
        if row.reply_to != live.reply_to:
            message = f"request id {row.rid!r} is already live in the detokenizer"
            routed[row.reply_to].rows.append(abort_row(row.rid, message))

    def _create_state(self, row: scheduler_pb2.TokenIDRow, source: str) -> DecodeStatus:
        flags = DecodeFlags(row.skip_special_tokens, row.spaces_between_special_tokens)
        return create_decode_status(
            list(row.prompt_tail_ids),
            self.decoder,
            flags,
            reply_to=row.reply_to,
            source=source,
            stop=tuple(s for s in row.stop if s),
            no_stop_trim=row.no_stop_trim,
        )

    def _refuse(self, rid: str) -> detokenizer_pb2.StrRow:
        self.stats.num_refused_requests += 1
        message = (
            f"detokenizer state table full ({self.max_states} live requests); "
            "raise --max-decode-states"
        )
        logger.warning("refusing rid=%s: %s", rid, message)
        return abort_row(rid, message)

    def _prepare(self, row: scheduler_pb2.TokenIDRow, state: DecodeStatus) -> _RowWork:
        item = _RowWork(row, state, is_final=row.HasField("finish_reason"))
        new_ids = list(row.new_token_ids)
        if item.is_final and self._drops_matched_token(row, state):
            new_ids.pop()
        item.seqs = state.add_ids(new_ids, self.decoder, final=item.is_final)
        return item

    def _decode(self, work: list[_RowWork]) -> None:
        """One decode call per flag group, so no request is decoded with another's flags."""
        groups: dict[DecodeFlags, list[_RowWork]] = defaultdict(list)
        for item in work:
            if item.seqs:
                groups[item.state.flags].append(item)
        for flags, items in groups.items():
            texts = self.decoder.decode_batch([s for item in items for s in item.seqs], flags)
            start = 0
            for item in items:
                item.texts = tuple(texts[start : start + len(item.seqs)])
                start += len(item.seqs)

    @staticmethod
    def _drops_matched_token(row: scheduler_pb2.TokenIDRow, state: DecodeStatus) -> bool:
        fr = row.finish_reason
        return (
            fr.WhichOneof("matched") == "matched_token_id"
            and not state.no_stop_trim
            and len(row.new_token_ids) > 0
            and row.new_token_ids[-1] == fr.matched_token_id
        )

    def _fill_row(self, item: _RowWork, out: detokenizer_pb2.StrRow) -> None:
        row, state = item.row, item.state
        out.rid = row.rid
        out.output_ids.extend(row.new_token_ids)
        if len(row.logprobs):
            out.logprobs.extend(row.logprobs)
        if len(row.input_token_logprobs):
            out.input_token_logprobs.extend(row.input_token_logprobs)
        if not item.is_final:
            out.text = state.stream_delta(item.texts, self.decoder)
            return
        out.text = self._final_remainder(item)
        out.finish_reason.CopyFrom(row.finish_reason)
        out.times.CopyFrom(row.times)
        out.times.detokenized = time.time()
        out.usage.CopyFrom(usage_of(row))
        del self.states[row.rid]

    def _final_remainder(self, item: _RowWork) -> str:
        """The output text not sent yet, as the full decode ends it, stop string trimmed."""
        state, fr = item.state, item.row.finish_reason
        remainder, is_stable = state.final_remainder(item.texts, self.decoder)
        if not is_stable:
            self._count_unstable(item.row.rid)
        if fr.WhichOneof("matched") == "matched_str" and not state.no_stop_trim:
            # Sent text never holds the start of a stop, so the first match is in here.
            cut = first_stop_at(remainder, (*state.stop, fr.matched_str), 0)
            remainder = remainder if cut is None else remainder[:cut]
        return remainder

    def _count_unstable(self, rid: str) -> None:
        self.stats.num_unstable_decodes += 1
        logger.error(
            "rid=%s: the full decode does not extend the text sent; "
            "this tokenizer's decode is not local enough for incremental decoding",
            rid,
        )


def abort_row(rid: str, message: str) -> detokenizer_pb2.StrRow:
    return detokenizer_pb2.StrRow(
        rid=rid,
        finish_reason=common_pb2.FinishReason(
            kind=common_pb2.FinishReason.KIND_ABORT, message=message
        ),
    )


def pooled_row(row: scheduler_pb2.TokenIDRow) -> detokenizer_pb2.StrRow:
    """A pooling request's only row, as it came: its vector, finish, usage and times."""
    out = detokenizer_pb2.StrRow(rid=row.rid, finish_reason=row.finish_reason, usage=usage_of(row))
    out.embedding.extend(row.embedding)
    out.times.CopyFrom(row.times)
    out.times.detokenized = time.time()
    return out


def usage_of(row: scheduler_pb2.TokenIDRow) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        total_tokens=row.prompt_tokens + row.completion_tokens,
        cached_tokens=row.cached_tokens,
    )
