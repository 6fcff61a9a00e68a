"""Streamed background responses and their replay (``GET /v1/responses/{id}?stream=true``)
through the openai SDK against the shared live stack: a caller that leaves does not stop
the run, and ``retrieve(id, stream=True, starting_after=k)`` gives exactly the events after
k, ending in the terminal one, whose deltas add up to the stored text."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from services.launch import LocalStack
from tests.live_stack import finish_counts, wait_for_finishes

TERMINAL = ("response.completed", "response.incomplete")


def _background_stream(client: openai.OpenAI, model_id: str, seed: int, **kwargs: Any) -> Any:
    return client.responses.create(
        model=model_id,
        input=f"Tell a long story, {seed}.",
        max_output_tokens=kwargs.pop("max_output_tokens", 48),
        temperature=0.8,
        background=True,
        stream=True,
        extra_body={"seed": seed},
        **kwargs,
    )


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_left_background_stream_runs_on_and_replays_after_k(
    client: openai.OpenAI, model_id: str, stack: LocalStack
) -> None:
    before = finish_counts(stack)
    stream = _background_stream(client, model_id, 11)
    seen: list[Any] = []
    for event in stream:
        seen.append(event)
        if event.type == "response.content_part.added":
            break  # leave before any text
    stream.close()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert seen[0].type == "response.created" and seen[0].response.background is True
    response_id, k = seen[0].response.id, seen[-1].sequence_number

    replayed = list(client.responses.retrieve(response_id, stream=True, starting_after=k))
    assert [e.sequence_number for e in replayed] == list(range(k + 1, k + 1 + len(replayed)))
    assert replayed[-1].type in TERMINAL
    done = client.responses.retrieve(response_id)
    assert done.status == replayed[-1].response.status != "cancelled"
    assert _text(replayed) == done.output_text and done.output_text
    # The run went to its end: the scheduler saw a finish, not the abort a cancel makes.
    assert "abort" not in wait_for_finishes(stack, before, 1)

    full = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in full] == list(range(len(full)))
    assert full[0].type == "response.created" and full[-1].type in TERMINAL
    assert [e.to_dict() for e in full[k + 1 :]] == [e.to_dict() for e in replayed]
    assert [e.type for e in full[: k + 1]] == [e.type for e in seen]


def test_a_background_stream_read_to_its_end_is_the_stored_response(
    client: openai.OpenAI, model_id: str
) -> None:
    events = list(_background_stream(client, model_id, 12, max_output_tokens=12))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in TERMINAL
    stored = client.responses.retrieve(events[0].response.id)
    assert _text(events) == stored.output_text
    assert events[-1].response.usage.output_tokens == stored.usage.output_tokens


def test_replay_of_an_unknown_id_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        list(client.responses.retrieve("resp_nope", stream=True))
    assert "resp_nope" in info.value.body["message"]  # type: ignore[index]


def test_replay_of_a_response_not_made_in_the_background_is_a_400_naming_stream(
    client: openai.OpenAI, model_id: str
) -> None:
    stored = client.responses.create(model=model_id, input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        list(client.responses.retrieve(stored.id, stream=True))
    body: Any = info.value.body
    assert body["param"] == "stream" and stored.id in body["message"]


@pytest.mark.parametrize(
    ("query", "param"),
    [({"stream": "true", "starting_after": "100000"}, "starting_after"),  # past its last
     ({"stream": "true", "starting_after": "-1"}, "starting_after"),
     ({"stream": "true", "starting_after": "abc"}, "starting_after"),
     ({"starting_after": "0"}, "starting_after"),  # without stream
     ({"stream": "yes"}, "stream"),
     ({"stream": "true", "include_obfuscation": "true"}, "include_obfuscation")],
)  # fmt: skip
def test_a_bad_replay_parameter_is_a_400_naming_it(
    client: openai.OpenAI, model_id: str, stack: LocalStack, query: dict[str, str], param: str
) -> None:
    events = list(_background_stream(client, model_id, 13, max_output_tokens=2))
    url = f"{stack.base_url}/responses/{events[0].response.id}"
    answer = httpx.get(url, params=query, headers={"Authorization": "Bearer unused"}, timeout=30)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
