"""Stop strings: no fragment ever reaches a client; the final text is cut at the first match."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.stop_strings import first_stop_at, stop_prefix_overlap
from tests.detokenizer.families import Family, chunk, chunkings
from tests.detokenizer.harness import LENGTH, push, row, stop_str, stop_token, stream

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ASCII = "abcdefghij xyz.,!?'"
CJK = "你好世界中文日本語東京の。，"
MIXED_TEXT = st.text(alphabet=st.sampled_from(ASCII + CJK), min_size=2, max_size=40)
DECOY = st.text(alphabet=st.sampled_from(ASCII + CJK), min_size=1, max_size=20)


def earliest(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s in text]
    return min(found) if found else None


def run_until_stop(
    family: Family, ids: list[int], cuts: list[int], stops: list[str], no_stop_trim: bool = False
) -> tuple[list[str], str]:
    """Play the scheduler: finish on the first step whose output contains a stop string.

    Returns each row's text and the decoded output at finish.
    """
    manager = DetokenizerManager(family.decoder)
    chunks, out_ids, deltas = chunk(ids, cuts), [], []
    for i, step in enumerate(chunks):
        out_ids += step
        text = family.decode(out_ids, True)
        pos = earliest(text, stops)
        finish = LENGTH if i == len(chunks) - 1 else None
        if pos is not None:
            finish = stop_str(next(s for s in stops if text.find(s) == pos))
        first = i == 0
        r = row("r", step, init=first, finish=finish, stop=stops, no_stop_trim=no_stop_trim)
        deltas += [out.text for out in push(manager, r)["fe"]]
        if finish is not None:
            break
    assert not manager.states
    return deltas, family.decode(out_ids, True)


@PROPERTY
@given(data=st.data())
def test_stop_string_never_leaks_and_final_is_cut_at_first_match(
    family: Family, data: st.DataObject
) -> None:
    ids = family.encode(data.draw(MIXED_TEXT, label="text"))
    full = family.decode(ids, True)
    assume(full)
    # A stop taken from the decoded text (so it crosses token boundaries), plus a decoy.
    start = data.draw(st.integers(0, len(full) - 1), label="start")
    length = data.draw(st.integers(1, min(20, len(full) - start)), label="length")
    stops = [full[start : start + length], data.draw(DECOY, label="decoy")]
    deltas, final = run_until_stop(family, ids, data.draw(chunkings(), label="cuts"), stops)
    cut = earliest(final, stops)
    expected = final if cut is None else final[:cut]
    sent = ""
    for delta in deltas:
        sent += delta
        assert expected.startswith(sent), (sent, expected, stops)
    assert sent == expected


@PROPERTY
@given(data=st.data())
def test_no_stop_trim_keeps_the_stop_string(family: Family, data: st.DataObject) -> None:
    ids = family.encode(data.draw(MIXED_TEXT, label="text"))
    full = family.decode(ids, True)
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1), label="start")
    stops = [full[start : start + data.draw(st.integers(1, 20), label="length")]]
    cuts = data.draw(chunkings(), label="cuts")
    deltas, final = run_until_stop(family, ids, cuts, stops, no_stop_trim=True)
    assert "".join(deltas) == final
    assert stops[0] in final


def test_held_tail_is_released_once_it_cannot_match(bytelevel: Family) -> None:
    ids = [bytelevel.encode(c)[0] for c in "xabd!"]
    manager = DetokenizerManager(bytelevel.decoder)
    deltas = stream(manager, [[i] for i in ids], stop=["abc"])
    assert deltas == ["x", "", "", "abd", "!"]


def test_matched_stop_token_is_dropped_unless_no_stop_trim(bytelevel: Family) -> None:
    eos = 1  # <｜end▁of▁sentence｜>, visible when special tokens are not skipped
    ids = [*bytelevel.encode("hi there"), eos]
    finish = stop_token(eos)
    trimmed = stream(DetokenizerManager(bytelevel.decoder), [ids], finish=finish, skip=False)
    kept = stream(
        DetokenizerManager(bytelevel.decoder), [ids], finish=finish, skip=False, no_stop_trim=True
    )
    assert "".join(trimmed) == "hi there"
    assert "".join(kept) == bytelevel.decode(ids, False) != "hi there"


def test_stop_prefix_overlap() -> None:
    assert stop_prefix_overlap("hello wor", ["world"]) == 3
    assert stop_prefix_overlap("hello", ["world"]) == 0
    assert stop_prefix_overlap("ababa", ["abac", "b"]) == 3
    assert stop_prefix_overlap("你好世", ["世界", "好世界"]) == 2
    assert stop_prefix_overlap("x", ["x"]) == 0  # a whole stop is not a proper prefix


def test_first_stop_at() -> None:
    assert first_stop_at("a STOP b stop", ["stop", "STOP"], 0) == 2
    assert first_stop_at("a STOP b stop", ["stop", "STOP"], 3) == 9
    assert first_stop_at("abc", ["x", ""], 0) is None
