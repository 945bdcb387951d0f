"""Chat rendering with the target's own answer tokens: a conversation's ids through its chat
template, each assistant turn spliced in as the ids the target generated (never a re-encoding of
its decoded text), with the half-open spans of the tokens the target wrote; and the template's
user-turn prefix that Magpie samples a user message from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxspec.api import Model
from jaxspec.errors import CheckpointError, InvalidRequestError
from jaxspec.tokenizer import Tokenizer


# Private-use characters no real message holds: an assistant turn's content while rendering
# (replaced by its token ids afterwards), and the user message Magpie lets the target write.
_ASSISTANT_SLOT = "\ue000{}\ue001"
_ASSISTANT_SLOT_PATTERN = re.compile("\ue000(\\d+)\ue001")
USER_SENTINEL = "\ue002user message\ue003"
ENDINGS = ("complete", "assistant", "user")


def _chat_tokenizer(target: Model) -> Tokenizer:
    tokenizer = target.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise InvalidRequestError("the corpus is chat text: the target needs a tokenizer with a chat template")
    return tokenizer


def _cut_at_user_sentinel(text: str) -> str:
    if text.count(USER_SENTINEL) != 1:
        raise CheckpointError("the chat template does not write a user message's content once, verbatim; "
                              "Magpie needs the template text up to the user's message")
    return text[: text.index(USER_SENTINEL)]


def magpie_prefix(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]] = ()) -> str:
    """The chat template's text up to where the next user message begins: `messages` (may be
    none) and then an open user turn, cut where the template writes its content. For ChatML
    this ends with "<|im_start|>user\\n"; SmolLM2's template puts its default system prompt first."""
    conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.render_chat(conversation + [{"role": "user", "content": USER_SENTINEL}],
                                 add_generation_prompt=False)
    return _cut_at_user_sentinel(text)


def chat_tokens(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                ending: str = "complete") -> tuple[list[int], list[tuple[int, int]]]:
    """(token ids, assistant spans) of a conversation rendered by the chat template.

    An assistant message may carry "token_ids", the target's own ids for it (its end-of-turn
    token included when it finished): they are used verbatim, and the template's own copy of a
    closing token they end with is not repeated. Without them its content is encoded and the
    template's end-of-turn token after it counts as the assistant's. Everything else is the
    template's text, encoded piece by piece between assistant turns (no BOS beyond what the
    template writes, as `encode_chat`). Spans are half-open [start, end) ranges of assistant tokens.

    `ending`: "complete" (the last message is the assistant's; the tokens end with it),
    "assistant" (the last is the user's; the tokens end with the generation prompt the target
    answers from) or "user" (the tokens end where the next user message's content begins: the
    Magpie prompt). Rendering the whole conversation once, rather than turn by turn, gives the
    right tokens for templates that render earlier turns differently once more follow.
    """
    if ending not in ENDINGS:
        raise InvalidRequestError(f"ending must be one of {ENDINGS}; got {ending!r}")
    messages = list(messages)
    last_role = messages[-1]["role"] if messages else None
    if ending == "complete" and last_role != "assistant":
        raise InvalidRequestError("a complete conversation ends with an assistant message")
    if ending == "assistant" and last_role != "user":
        raise InvalidRequestError("a conversation awaiting the assistant ends with a user message")
    if ending == "user" and last_role == "user":
        raise InvalidRequestError("a conversation awaiting the user cannot end with a user message")
    rendered, answers = [], []
    for message in messages:
        if message["role"] == "assistant":
            ids = message.get("token_ids")
            answers.append((message["content"], None if ids is None else [int(t) for t in ids]))
            rendered.append({"role": "assistant", "content": _ASSISTANT_SLOT.format(len(answers) - 1)})
        else:
            rendered.append({"role": message["role"], "content": message["content"]})
    if ending == "user":
        rendered.append({"role": "user", "content": USER_SENTINEL})
    text = tokenizer.render_chat(rendered, add_generation_prompt=ending == "assistant")
    if ending == "user":
        text = _cut_at_user_sentinel(text)
    pieces = _ASSISTANT_SLOT_PATTERN.split(text)  # template text, slot number, template text, ...
    if [int(slot) for slot in pieces[1::2]] != list(range(len(answers))):
        raise CheckpointError("the chat template does not write each assistant message's content once, in order")
    end_of_turn = set(tokenizer.eos_token_ids)
    tokens = tokenizer.encode(pieces[0], add_special_tokens=False)
    spans: list[tuple[int, int]] = []
    for slot, (content, ids) in enumerate(answers):
        start = len(tokens)
        tokens += ids if ids is not None else tokenizer.encode(content, add_special_tokens=False)
        after = tokenizer.encode(pieces[2 * slot + 2], add_special_tokens=False)
        last = slot == len(answers) - 1
        closing = after[:1] if after and after[0] in end_of_turn else []
        if ids is not None and ids and closing and ids[-1] == closing[0]:
            after = after[1:]  # the target wrote the template's closing token itself
        elif ids is None and closing:
            tokens.append(after.pop(0))  # the end of a turn it did not write the ids of: still its turn
        spans.append((start, len(tokens)))
        if not (last and ending == "complete"):
            tokens += after
    return tokens, spans
