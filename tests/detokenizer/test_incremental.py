"""Incremental decoding against the full decode, for three real tokenizer families.

The property everywhere: cut the ids into any steps, and every delta extends a
prefix of ``tokenizer.decode`` of the same ids with the same flags, and the
deltas together are exactly that decode. So nothing is sent twice or taken
back, and a U+FFFD is only ever sent where the full decode has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.text_decoder import TextDecoder
from tests.detokenizer.families import (
    TORTURE,
    Family,
    chunk,
    chunkings,
    id_sequences,
    texts,
)
from tests.detokenizer.harness import stream

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPLACEMENT = "\ufffd"


def assert_deltas_build(deltas: Sequence[str], full: str) -> None:
    sent = ""
    for delta in deltas:
        assert full.startswith(sent + delta), (sent, delta, full)
        sent += delta
    assert sent == full


def run(
    family: Family, ids: list[int], cuts: list[int], **init: object
) -> tuple[list[str], DetokenizerManager]:
    manager = DetokenizerManager(family.decoder)
    deltas = stream(manager, chunk(ids, cuts), **init)
    assert not manager.states
    assert manager.stats.num_unstable_decodes == 0
    return deltas, manager


@PROPERTY
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_deltas_concatenate_to_the_full_decode(
    family: Family, data: st.DataObject, skip: bool, spaces: bool
) -> None:
    ids = data.draw(id_sequences(family), label="ids")
    cuts = data.draw(chunkings(), label="cuts")
    deltas, _ = run(family, ids, cuts, skip=skip, spaces=spaces)
    assert_deltas_build(deltas, family.decode(ids, skip))


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_prompt_tail_gives_context_and_never_leaks(
    family: Family, data: st.DataObject, skip: bool
) -> None:
    prompt = family.encode(data.draw(texts().filter(str.strip), label="prompt"))[-5:]
    ids = data.draw(id_sequences(family), label="ids")
    cuts = data.draw(chunkings(), label="cuts")
    # A prompt ending in an open byte run gives its bytes to neither side: the output's
    # bytes decode as if the run were not there (the two tests below pin that down).
    assume(not prompt or prompt[-1] not in set(family.byte_token_ids))
    prompt_text = family.decode(prompt, skip)
    # Prompts whose text this output never changes (otherwise see the test below).
    assume(
        all(
            family.decode(prompt + ids[:k], skip).startswith(prompt_text)
            for k in range(len(ids) + 1)
        )
    )
    deltas, _ = run(family, ids, cuts, skip=skip, prompt_tail=prompt)
    assert_deltas_build(deltas, family.decode(prompt + ids, skip)[len(prompt_text) :])


@pytest.mark.parametrize("name", ["bytelevel", "sentencepiece"])
def test_prompt_ending_mid_character_contributes_no_text(
    name: str, request: pytest.FixtureRequest
) -> None:
    """The prompt's half of a split character stays the prompt's: the output's
    continuation byte decodes as U+FFFD, exactly as without that half."""
    family: Family = request.getfixturevalue(name)
    head = family.encode("hello world")
    lead = [family.byte_token_ids[b] for b in "你".encode()[:2]]
    output = [family.byte_token_ids["你".encode()[2]], *family.encode("ok 世界")]
    deltas, _ = run(family, output, list(range(len(output))), prompt_tail=head + lead)
    expected = family.decode(head + output, True)[len(family.decode(head, True)) :]
    assert "".join(deltas) == expected
    assert expected.startswith(REPLACEMENT) and "你" not in expected and "hello" not in expected


@pytest.mark.parametrize(
    ("output", "pieces"),
    [
        ([413, 51], ["▁", "<0x30>"]),  # the hypothesis example: "00000" then " 0"
        ([35, 51], ["<0x20>", "<0x30>"]),  # a space that is itself a byte piece
    ],
)
@pytest.mark.parametrize("cuts", [[], [1]])
@pytest.mark.parametrize("skip", [False, True])
def test_prompt_tail_of_one_byte_run_keeps_the_outputs_leading_space(
    sentencepiece: Family, output: list[int], pieces: list[str], cuts: list[int], skip: bool
) -> None:
    """A prompt tail that is one open byte run is cut back to nothing; the output must
    still decode as text that follows the prompt, not as the start of the text, where
    the Llama decoder strips a leading space ("0" was sent instead of " 0")."""
    family = sentencepiece
    prompt = [51] * 5
    assert family.tokenizer.convert_ids_to_tokens([*prompt, *output]) == ["<0x30>"] * 5 + pieces
    deltas, _ = run(family, output, cuts, skip=skip, prompt_tail=prompt)
    assert_deltas_build(deltas, family.decode(prompt + output, skip)[len("00000") :])
    assert "".join(deltas) == " 0"


@pytest.mark.parametrize("text", TORTURE)
@settings(max_examples=20, deadline=None)
@given(cuts=chunkings(max_cuts=40), skip=st.booleans())
def test_torture_strings_with_special_tokens(
    family: Family, text: str, cuts: list[int], skip: bool
) -> None:
    first, second = family.added_ids[:2]
    half = len(text) // 2
    ids = [first, *family.encode(text[:half]), second, *family.encode(text[half:]), first]
    full = family.decode(ids, skip)
    assert REPLACEMENT not in full
    deltas, _ = run(family, ids, cuts, skip=skip)
    assert_deltas_build(deltas, full)
    assert all(REPLACEMENT not in d for d in deltas)


def test_torture_strings_stream_token_by_token_without_waiting(bytelevel: Family) -> None:
    """Each character is sent by the step that completes it, not held to the end."""
    text = "".join(TORTURE)
    ids = bytelevel.encode(text)
    manager = DetokenizerManager(bytelevel.decoder)
    deltas = stream(manager, [[i] for i in ids] + [[]])
    assert deltas[-1] == ""
    assert "".join(deltas) == text


CLEANUP_PIECES = [
    "'", "s", "t", "n", "m", "ve", "re", ".", ",", "!", "?", "##s", "##t", "##n", "don",
    "it", "a", "do", "not", "e", "r", "v", "[CLS]", "[SEP]", "hello",
]  # fmt: skip


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_string_cleanup_is_streamed_exactly(
    wordpiece_cleanup: Family, data: st.DataObject, skip: bool
) -> None:
    """clean_up_tokenization_spaces rewrites "it ' s" into "it's" only once "s" arrives."""
    family = wordpiece_cleanup
    assert family.decoder.cleanup is not None
    pool = family.tokenizer.convert_tokens_to_ids(CLEANUP_PIECES)
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=30), label="ids")
    cuts = data.draw(chunkings(), label="cuts")
    deltas, _ = run(family, ids, cuts, skip=skip)
    assert_deltas_build(deltas, family.decode(ids, skip))


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_window_engine_on_byte_level_bpe(
    bytelevel: Family, data: st.DataObject, skip: bool
) -> None:
    """The generic window engine, which ByteLevel tokenizers normally bypass, on them too."""
    family = replace(bytelevel, decoder=TextDecoder(bytelevel.tokenizer, use_byte_engine=False))
    ids = data.draw(id_sequences(family), label="ids")
    deltas, _ = run(family, ids, data.draw(chunkings(), label="cuts"), skip=skip)
    assert_deltas_build(deltas, family.decode(ids, skip))


def test_engine_and_decoder_facts_per_family(
    bytelevel: Family, sentencepiece: Family, wordpiece: Family
) -> None:
    assert bytelevel.decoder.token_bytes is not None  # byte engine
    assert sentencepiece.decoder.token_bytes is None and wordpiece.decoder.token_bytes is None
    assert len(sentencepiece.decoder.byte_ids) == 256 and not bytelevel.decoder.byte_ids
    assert bytelevel.decoder.cleanup is None  # transformers skips it for BPE
