"""The model's own chat template: ChatInput -> prompt text, or straight to ids.

Normally the template renders text and the dynamic batch tokenizer encodes it
(``add_special_tokens=False``: the template already wrote BOS and every control
token). That round trip is only exact when encoding the rendered text gives back
each control token as its own id. Where it does not (a tokenizer that splits
special tokens, or one whose ``apply_chat_template`` builds ids itself, such as
mistral-common's), tokenization happens inside ``apply_chat_template``. The
choice is made once at start-up by two checks: every control token the
template writes must encode to its single id, and a probe conversation must
give the same ids both ways.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jinja2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError
from services.frontend.chat.messages import ChatInput, ContentFormat

logger = logging.getLogger(__name__)

ChatTokenization = Literal["auto", "text", "template"]
_PROBE_MARK = "tokenline-probe-7f3a"
_PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Bye."},
]


class ChatTemplate:
    """Renders a request's conversation exactly as transformers' apply_chat_template."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, tokenization: ChatTokenization = "auto"
    ) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.content_format: ContentFormat = detect_content_format(tokenizer)
        if tokenization == "auto":
            self.tokenizes_in_template = loses_control_tokens(tokenizer)
        else:
            self.tokenizes_in_template = tokenization == "template"
        logger.info(
            "chat template: content=%s, tokenized %s",
            self.content_format,
            "inside apply_chat_template" if self.tokenizes_in_template else "from rendered text",
        )

    def render(self, chat: ChatInput) -> str:
        return self._apply(chat, tokenize=False)

    def tokenize(self, chat: ChatInput) -> list[int]:
        """Ids built by apply_chat_template itself; may be slow: run it off the loop."""
        return list(self._apply(chat, tokenize=True))

    def _apply(self, chat: ChatInput, tokenize: bool) -> Any:
        # HF types `tools` as dicts or callables; ours are always JSON-schema dicts.
        tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if chat.tools is None else list(chat.tools)
        )
        try:
            return self.tokenizer.apply_chat_template(
                chat.messages,
                tools=tools,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                tokenize=tokenize,
                return_dict=False,
                **chat.kwargs,
            )
        except (ValueError, TypeError, KeyError, IndexError, jinja2.TemplateError) as exc:
            # A template's raise_exception() is how it says the conversation is invalid.
            raise InvalidArgumentError(f"chat template: {exc}", field="messages") from exc


def create_chat_template(
    tokenizer: PreTrainedTokenizerBase, template_file: str, tokenization: ChatTokenization
) -> ChatTemplate | None:
    """The tokenizer's chat template, or ``template_file``'s in its place (vLLM's
    ``--chat-template``); None when there is neither, and chat is refused."""
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise SystemExit(f"--chat-template {template_file}: no such file")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
        logger.info("chat template from %s", path)
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    return ChatTemplate(tokenizer, tokenization)


def detect_content_format(tokenizer: PreTrainedTokenizerBase) -> ContentFormat:
    """'openai' when the template prints text parts given as a list, else 'string'."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": _PROBE_MARK}]}
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any failure means lists are not supported
        return "string"
    return "openai" if _PROBE_MARK in text else "string"


def loses_control_tokens(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when encoding the rendered text would not reproduce the template's ids."""
    template = str(tokenizer.chat_template)
    specials = set(tokenizer.all_special_tokens)
    for token_id, added in tokenizer.added_tokens_decoder.items():
        # The control tokens a template can write: those in its source, and the
        # special tokens it reaches through variables such as bos_token.
        if added.content not in specials and added.content not in template:
            continue
        if tokenizer.encode(added.content, add_special_tokens=False) != [token_id]:
            logger.info("control token %r does not round-trip through text", added.content)
            return True
    return not _probe_round_trips(tokenizer)


def _probe_round_trips(tokenizer: PreTrainedTokenizerBase) -> bool:
    try:
        text = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(
            _PROBE, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    except Exception:  # noqa: BLE001 - a template that rejects the probe decides nothing
        return True
    return list(ids) == tokenizer.encode(text, add_special_tokens=False)
