"""DetokenizerManager: per-rid DecodeStatus table, batched decoding, routing.

Transport-free: ``handle_batch`` takes scheduler rows (as protos, since rows are
passed through nearly unchanged) and returns, per frontend id, the StrRows to
send. States are created on a row with ``has_init`` and deleted at finish.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from typing import Protocol

from tokenline.v1 import common_pb2, detokenizer_pb2, scheduler_pb2

from services.detokenizer.incremental import DecodeStatus, trim_stop

logger = logging.getLogger(__name__)


class BatchDecoder(Protocol):
    def batch_decode(
        self,
        sequences: list[list[int]],
        skip_special_tokens: bool = ...,
        spaces_between_special_tokens: bool = ...,
    ) -> list[str]: ...


class DetokenizerManager:
    def __init__(self, decoder: BatchDecoder, max_states: int = 65536) -> None:
        self.decoder = decoder
        self.max_states = max_states
        self.states: OrderedDict[str, DecodeStatus] = OrderedDict()
        self.num_dropped_rows = 0

    def handle_batch(
        self, batch: scheduler_pb2.BatchTokenIDOutput
    ) -> dict[str, list[detokenizer_pb2.StrRow]]:
        live: list[tuple[scheduler_pb2.TokenIDRow, DecodeStatus]] = []
        routed: dict[str, list[detokenizer_pb2.StrRow]] = defaultdict(list)
        for row in batch.rows:
            if row.has_init and row.rid not in self.states:
                refusal = self._create_state(row)
                if refusal is not None:
                    routed[row.reply_to].append(refusal)
                    continue
            state = self.states.get(row.rid)
            if state is None:
                self.num_dropped_rows += 1
                continue
            state.decode_ids.extend(row.new_token_ids)
            state.num_output_tokens += len(row.new_token_ids)
            live.append((row, state))
        for (row, state), visible in zip(live, self._decode_all(live), strict=True):
            routed[state.reply_to].append(self._make_row(row, state, visible))
        return routed

    def _create_state(self, row: scheduler_pb2.TokenIDRow) -> detokenizer_pb2.StrRow | None:
        if len(self.states) >= self.max_states:
            # Evicting a live state would corrupt someone's output; refuse instead.
            message = (
                f"detokenizer state table full ({self.max_states} live requests); "
                "raise --max-decode-states"
            )
            logger.warning("refusing rid=%s: %s", row.rid, message)
            return detokenizer_pb2.StrRow(
                rid=row.rid,
                finish_reason=common_pb2.FinishReason(
                    kind=common_pb2.FinishReason.KIND_ABORT, message=message
                ),
            )
        self.states[row.rid] = DecodeStatus.create(
            list(row.prompt_tail_ids),
            skip_special_tokens=row.skip_special_tokens,
            spaces_between_special_tokens=row.spaces_between_special_tokens,
            no_stop_trim=row.no_stop_trim,
            stop=list(row.stop),
            reply_to=row.reply_to,
        )
        return None

    def _decode_all(self, live: list[tuple[scheduler_pb2.TokenIDRow, DecodeStatus]]) -> list[str]:
        """Visible text per live row; one batch_decode call per flag group."""
        groups: dict[tuple[bool, bool], list[int]] = defaultdict(list)
        for i, (row, state) in enumerate(live):
            if row.HasField("finish_reason") and self._drops_matched_token(row, state):
                state.decode_ids.pop()
            groups[state.group_key].append(i)
        visible = [""] * len(live)
        for (skip, spaces), idxs in groups.items():
            windows = [live[i][1].windows() for i in idxs]
            texts = self.decoder.batch_decode(
                [w for pair in windows for w in pair],
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            for j, i in enumerate(idxs):
                row, state = live[i]
                final = row.HasField("finish_reason")
                visible[i] = state.advance(texts[2 * j], texts[2 * j + 1], final=final)
        return visible

    @staticmethod
    def _drops_matched_token(row: scheduler_pb2.TokenIDRow, state: DecodeStatus) -> bool:
        fr = row.finish_reason
        return (
            fr.WhichOneof("matched") == "matched_token_id"
            and not state.no_stop_trim
            and state.decode_ids[-1:] == [fr.matched_token_id]
            and len(state.decode_ids) > state.read_offset
        )

    def _make_row(
        self, row: scheduler_pb2.TokenIDRow, state: DecodeStatus, visible: str
    ) -> detokenizer_pb2.StrRow:
        out = detokenizer_pb2.StrRow(
            rid=row.rid, output_ids=row.new_token_ids, logprobs=row.logprobs
        )
        if not row.HasField("finish_reason"):
            out.text = state.take_delta(visible, final=False)
            return out
        fr = row.finish_reason
        if fr.WhichOneof("matched") == "matched_str" and not state.no_stop_trim:
            visible = trim_stop(visible, fr.matched_str, state.sent_offset)
        out.text = state.take_delta(visible, final=True)
        out.finish_reason.CopyFrom(fr)
        out.times.CopyFrom(row.times)
        out.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
                total_tokens=row.prompt_tokens + row.completion_tokens,
                cached_tokens=row.cached_tokens,
            )
        )
        del self.states[row.rid]
        return out
