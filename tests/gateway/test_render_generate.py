"""GenerateResponse protos → SGLang's /generate JSON (gateway/render/generate.py), no server."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tokenline.v1 import common_pb2, generate_pb2

from gateway.render.generate import GenerateRenderer, GenerateView, input_logprobs
from gateway.responses import GenerateOutput, GenerateResponse
from gateway.schemas import GenerateBody

Kind = common_pb2.FinishReason


@pytest.fixture(autouse=True)
def fake() -> None:
    """No frontend here: override the gateway suite's autouse fake-frontend reset."""


def _output(
    index: int = 0,
    text: str = "",
    ids: tuple[int, ...] = (),
    finish: common_pb2.FinishReason | None = None,
    **meta: Any,
) -> generate_pb2.GenerateOutput:
    out = generate_pb2.GenerateOutput(rid=f"r-{index}", index=index, text=text, output_ids=ids)
    out.meta_info.prompt_tokens = 5
    out.meta_info.completion_tokens = len(ids)
    if finish is not None:
        out.finish_reason.CopyFrom(finish)
        out.meta_info.cached_tokens = meta.get("cached", 0)
        out.meta_info.e2e_latency = meta.get("e2e", 0.25)
    return out


def _response(*outputs: generate_pb2.GenerateOutput) -> generate_pb2.GenerateResponse:
    return generate_pb2.GenerateResponse(outputs=outputs)


def _view(body: dict[str, Any]) -> GenerateView:
    request = generate_pb2.GenerateReqInput()
    n = body.get("sampling_params", {}).get("n")
    if n is not None:
        request.sampling_params.n = n
    return GenerateView.of(GenerateBody.model_validate(body), request)


@pytest.mark.parametrize(
    ("body", "is_single"),
    [
        ({"text": "a"}, True),
        ({"text": ["a"]}, False),
        ({"text": ["a", "b"]}, False),
        ({"input_ids": [1, 2]}, True),
        ({"input_ids": [[1, 2]]}, False),
        ({"text": "a", "sampling_params": {"n": 2}}, False),
        ({"text": "a", "sampling_params": {"n": 1}}, True),
    ],
)
def test_single_or_batch_follows_sglang(body: dict[str, Any], is_single: bool) -> None:
    assert _view(body).is_single is is_single


def test_single_prompt_is_one_object_with_sglang_meta_info() -> None:
    eos = Kind(kind=Kind.KIND_STOP, matched_token_id=1)
    done = _output(text="hi", ids=(7, 1), finish=eos, cached=3, e2e=0.5)
    body = GenerateRenderer(GenerateView(is_single=True)).whole(_response(done))
    assert body == {
        "text": "hi",
        "output_ids": [7, 1],
        "meta_info": {
            "id": "r-0",
            "finish_reason": {"type": "stop", "matched": 1},
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "cached_tokens": 3,
            "e2e_latency": 0.5,
        },
    }
    GenerateResponse.model_validate(body)


def test_batch_is_a_list_in_input_order() -> None:
    stop = Kind(kind=Kind.KIND_STOP, matched_str="\n\n")
    length = Kind(kind=Kind.KIND_LENGTH)
    abort = Kind(kind=Kind.KIND_ABORT, message="aborted by /abort_request")
    outputs = [
        _output(0, "a", (4,), stop),
        _output(1, "bc", (5, 6), length),
        _output(2, "", (), abort),
    ]
    body = GenerateRenderer(GenerateView(is_single=False)).whole(_response(*outputs))
    assert isinstance(body, list) and [o["meta_info"]["id"] for o in body] == ["r-0", "r-1", "r-2"]
    reasons = [o["meta_info"]["finish_reason"] for o in body]
    assert reasons == [
        {"type": "stop", "matched": "\n\n"},
        {"type": "length", "matched": None, "length": 2},
        {"type": "abort", "matched": None, "message": "aborted by /abort_request"},
    ]
    assert all("index" not in o for o in body)


def test_stream_frames_carry_the_output_so_far() -> None:
    renderer = GenerateRenderer(GenerateView(is_single=True))
    first = renderer.frame(_response(_output(text="He", ids=(1,))))
    second = renderer.frame(_response(_output(text="llo", ids=(2, 3))))
    last = renderer.frame(_response(_output(text="!", ids=(4,), finish=Kind(kind=2))))
    assert [f["text"] for f in (first, second, last)] == ["He", "Hello", "Hello!"]
    assert last["output_ids"] == [1, 2, 3, 4] and last["meta_info"]["completion_tokens"] == 4
    assert first["meta_info"]["finish_reason"] is None
    assert "cached_tokens" not in first["meta_info"] and "e2e_latency" not in first["meta_info"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "length": 4}
    for frame in (first, second, last):
        GenerateOutput.model_validate(frame)


def test_batch_stream_frames_keep_each_output_apart_and_name_its_index() -> None:
    renderer = GenerateRenderer(GenerateView(is_single=False))
    frames = [
        renderer.frame(_response(_output(0, "a", (1,)))),
        renderer.frame(_response(_output(1, "x", (9,)))),
        renderer.frame(_response(_output(0, "b", (2,)))),
    ]
    assert [(f["index"], f["text"], f["output_ids"]) for f in frames] == [
        (0, "a", [1]),
        (1, "x", [9]),
        (0, "ab", [1, 2]),
    ]


def _entry(token_id: int, logprob: float, text: str | None = None) -> common_pb2.TokenLogprob:
    entry = common_pb2.TokenLogprob(token_id=token_id, logprob=logprob)
    if text is not None:
        entry.text = text
    return entry


def test_logprobs_are_sglang_triples_and_tops_only_when_asked() -> None:
    out = _output(text="ab", ids=(3, 4), finish=Kind(kind=1, matched_token_id=4))
    first = _entry(3, -0.5, "a")
    first.top.add(token_id=3, logprob=-0.5, text="a")
    first.top.add(token_id=8, logprob=-1.5, text="z")
    out.logprobs.extend([first, _entry(4, -math.inf)])
    with_top = GenerateRenderer(GenerateView(True, True, 2)).whole(_response(out))["meta_info"]
    assert with_top["output_token_logprobs"] == [(-0.5, 3, "a"), (-9999.0, 4, None)]
    assert with_top["output_top_logprobs"] == [[(-0.5, 3, "a"), (-1.5, 8, "z")], []]
    without = GenerateRenderer(GenerateView(True, True, 0)).whole(_response(out))["meta_info"]
    assert "output_top_logprobs" not in without
    plain = GenerateRenderer(GenerateView(True)).whole(_response(out))["meta_info"]
    assert "output_token_logprobs" not in plain


def test_prompt_logprobs_are_triples_with_null_for_the_first_token() -> None:
    out = _output(text="a", ids=(3,), finish=Kind(kind=1))
    first = _entry(10, 0.0, "<s>")
    first.no_logprob = True
    second = _entry(11, -2.0)
    second.top.add(token_id=12, logprob=-1.0)
    out.input_token_logprobs.extend([first, second])
    meta = GenerateRenderer(GenerateView(True, True, 1)).whole(_response(out))["meta_info"]
    assert meta["input_token_logprobs"] == [(None, 10, "<s>"), (-2.0, 11, None)]
    assert meta["input_top_logprobs"] == [[], [(-1.0, 12, None)]]
    assert input_logprobs(out) is not None
