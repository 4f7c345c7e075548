"""Prompts of a LocalLM: chat messages to the exact token ids generation and training use."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
RENDER_CACHE_SIZE = 2048  # distinct chat prompts kept tokenized (see PromptRendering.render)
_ROLE_LABEL = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def base_transcript(messages: Sequence[Mapping[str, str]]) -> str:
    """Plain text for a model without a chat template.

    A lone user message is sent verbatim (the completion adapter writes the whole prompt itself);
    otherwise the system text comes first and each turn is labelled, ending with ``Assistant:``.

    Example:
        >>> base_transcript([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        'Be brief.\\n\\nUser: Hi\\n\\nAssistant:'
    """
    if len(messages) == 1 and messages[0].get("role", "user") == "user":
        return str(messages[0].get("content") or "")
    blocks = []
    for message in messages:
        role, content = message.get("role", "user"), str(message.get("content") or "")
        label = _ROLE_LABEL.get(role, role.title())
        blocks.append(content if role in ("system", "developer") else f"{label}: {content}")
    if messages and messages[-1].get("role") != "assistant":
        blocks.append("Assistant:")
    return "\n\n".join(blocks)


class PromptRendering:
    """LocalLM's prompt side: the chat template (or a base transcript) and tokenization.

    Rendered chat prompts are cached by content: GRPO sends each prompt G times per step, and an
    evaluation repeats a predictor's instructions and demos on every call; tokenizing is deterministic.
    """

    tokenizer: Any
    chat: bool
    _render_messages: Callable[[tuple[tuple[str, str], ...]], tuple[int, ...]]

    def render_text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt string for chat messages (``[{"role": ..., "content": ...}]``)."""
        if self.chat:
            msgs = [{"role": m.get("role", "user"), "content": str(m.get("content") or "")} for m in messages]
            prefill = bool(msgs) and msgs[-1]["role"] == "assistant"
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not prefill,
                                                      continue_final_message=prefill)
        return base_transcript(messages)

    def render(self, prompt: Prompt) -> list[int]:
        """Prompt token ids exactly as generation builds them.

        ``prompt`` is raw text (tokenized with the tokenizer's special tokens, e.g. ``<bos>``), a list of
        chat messages (rendered by :meth:`render_text`), or token ids (returned as they are).
        """
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        items: list[Any] = list(prompt)
        if all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        key = tuple((str(m.get("role", "user")), str(m.get("content") or "")) for m in items)
        return list(self._render_messages(key))

    def _tokenize_messages(self, messages: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
        text = self.render_text([{"role": role, "content": content} for role, content in messages])
        # A chat template writes its own special tokens; a base transcript needs the tokenizer's.
        return tuple(self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"])
