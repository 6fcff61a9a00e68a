"""The model's end-of-sequence ids, read the same way by every service.

``eos_token_id`` appears in config.json and generation_config.json (an int, a list or
absent; instruct models list their end-of-turn tokens in the latter), and on the
tokenizer. vLLM stops on their union; so does tokenline, in this order.
"""

from __future__ import annotations

from typing import Any


def eos_id_union(*values: Any) -> tuple[int, ...]:
    """Each value an id, a list of ids or None; the ids in first-seen order, once each."""
    found: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in found:
                found.append(int(item))
    return tuple(found)
