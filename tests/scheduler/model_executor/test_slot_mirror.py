"""SlotMirror: each step's slot tensors equal the host lists, whatever happened to them
between steps, while a list that only grew keeps its buffer and gets only its new slots."""

from __future__ import annotations

import torch

from services.scheduler.model_executor.slot_mirror import SlotMirror


def as_lists(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.tolist() for t in tensors]


def test_growing_lists_keep_their_buffers_and_match_every_step() -> None:
    mirror = SlotMirror("cpu")
    a, b = list(range(100, 130)), [7, 3, 9]
    first = mirror.tensors([a, b])  # first seen: views of the step's one tensor
    assert as_lists(first) == [a, b]
    assert first[0].untyped_storage().data_ptr() == first[1].untyped_storage().data_ptr()
    a.append(999)
    b.append(998)
    second = mirror.tensors([a, b])  # back and grown: a buffer each, with room to grow
    assert as_lists(second) == [a, b]
    buffers = [t.untyped_storage().data_ptr() for t in second]
    for step in range(39):  # decode steps: one slot each, both lists grow in place
        a.append(1000 + step)
        b.append(2000 + step)
        now = mirror.tensors([a, b])
        assert as_lists(now) == [a, b]
    # 31 -> 70 and 4 -> 43 entries: the first list outgrew its buffer of 64, once.
    assert now[0].untyped_storage().data_ptr() != buffers[0]
    assert now[1].untyped_storage().data_ptr() == buffers[1]
    assert first[0].tolist() == list(range(100, 130))  # earlier steps' views are intact
    assert second[0].tolist() == [*range(100, 130), 999]


def test_a_replaced_list_is_converted_whole() -> None:
    mirror = SlotMirror("cpu")
    slots = [5, 6, 7, 8]
    mirror.tensors([slots])
    replaced = [40, 41, 7]  # a cached prefix matched: a new, shorter list
    assert as_lists(mirror.tensors([replaced])) == [replaced]
    slots[0] = 99  # the old list object is no longer the request's: it is not read
    assert as_lists(mirror.tensors([replaced])) == [replaced]


def test_only_the_lists_of_the_last_step_stay_mirrored() -> None:
    mirror = SlotMirror("cpu")
    finished, running = [1, 2, 3], [4, 5]
    mirror.tensors([finished, running])
    running.append(6)
    assert as_lists(mirror.tensors([running])) == [[4, 5, 6]]
    assert len(mirror._mirrors) == 1  # the finished request's buffer is gone
    assert as_lists(mirror.tensors([finished, running])) == [[1, 2, 3], [4, 5, 6]]


def test_a_step_of_nothing_new_and_an_empty_step() -> None:
    mirror = SlotMirror("cpu")
    slots = [3, 1, 2]
    mirror.tensors([slots])
    again = mirror.tensors([slots])  # a step that added no slot to this list
    assert as_lists(again) == [slots] and again[0].dtype == torch.int64
    assert mirror.tensors([]) == []
