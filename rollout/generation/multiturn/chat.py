"""Episode turns through the tokenizer's own chat template, token ids out.

    chat = ChatTemplate(tokenizer)
    prompt_ids = chat.first_prompt_ids("What is 6*7?")          # system? + user + assistant header
    env_ids = chat.observation_ids("<tool_response>42</tool_response>", role="tool",
                                   model_turn_closed=True)       # what follows the model's turn

A multi-turn sequence is built token-in/token-out: the model's tokens are appended exactly as the
server returned them (its end-of-turn token included), and only the environment's text is
tokenised. `observation_ids` therefore returns the template's text between the end of the
model's turn and the next assistant header: the rest of the assistant turn's closing (ChatML:
the "\\n" after the generated <|im_end|>; the whole closing when the turn was cut by its budget),
the observation as a message of `role`, and the generation prompt. The text is read off the
template by rendering a two-message conversation with and without the observation and taking the
difference, so any prefix-stable template works; one that renders earlier turns differently once
a turn is added (some reasoning templates) is refused with a clear error.
Roles: "tool" where the template has a tool role (its source mentions "tool"), else "user".
"""
from __future__ import annotations

from typing import Any

_USER, _ASSISTANT = "\x00user\x00", "\x00assistant\x00"


class ChatTemplate:
    def __init__(self, tokenizer: Any, system: str | None = None):
        self.tokenizer, self.system = tokenizer, system
        source = getattr(tokenizer, "chat_template", None) or ""
        if not source:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat template")
        self.has_tool_role = "tool" in source
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else ""
        self._cache: dict[tuple[str, str, bool], list[int]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if self.system is not None:
            messages = [{"role": "system", "content": self.system}] + messages
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def first_prompt_ids(self, message: str | list[dict]) -> list[int]:
        messages = list(message) if isinstance(message, list) else [{"role": "user", "content": message}]
        return self._encode(self._render(messages, generation_prompt=True))

    def role_for(self, tool_response: bool) -> str:
        return "tool" if tool_response and self.has_tool_role else "user"

    def observation_ids(self, message: str, *, role: str = "user", model_turn_closed: bool) -> list[int]:
        """Token ids that follow a model turn: the closing of that turn the model did not generate,
        `message` as a `role` message, and the next assistant header."""
        key = (message, role, model_turn_closed)
        if key not in self._cache:
            base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
            before = self._render(base, generation_prompt=False)
            after = self._render(base + [{"role": role, "content": message}], generation_prompt=True)
            if not after.startswith(before):
                raise ValueError("the chat template renders earlier turns differently once a turn is "
                                 "added; multi-turn token-in/token-out needs a prefix-stable template")
            closing = before[before.rindex(_ASSISTANT) + len(_ASSISTANT):]  # e.g. "<|im_end|>\n"
            if model_turn_closed:  # the model generated the end-of-turn token itself
                if not closing.startswith(self.eos_text):
                    raise ValueError(f"the template closes an assistant turn with {closing!r}, which "
                                     f"does not start with the EOS token {self.eos_text!r}")
                closing = closing[len(self.eos_text):]
            self._cache[key] = self._encode(closing + after[len(before):])
        return list(self._cache[key])
