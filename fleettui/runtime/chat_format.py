"""Provides the model's tokenizer and chat template for the coordinator (no torch, no transformers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from remote_worker.manifest import Manifest


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant
    content: str


class ChatFormat:
    """Encodes conversations with the shard's own chat template and tokenizer; decodes replies."""

    def __init__(self, shard_dir: Path, manifest: Manifest) -> None:
        import jinja2.sandbox
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(shard_dir) / manifest.tokenizer / "tokenizer.json"))
        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_template_error
        self.template = environment.from_string(manifest.chat_template) if manifest.chat_template else None
        self.eos_token_ids = frozenset(manifest.eos_token_ids)
        self.bos_token = self._token_text(manifest.bos_token_id)
        self.eos_token = self._token_text(manifest.eos_token_ids[0] if manifest.eos_token_ids else None)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(int(token_id)) or ""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return "".join(message.content for message in messages)
        return self.template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        return self.encode(self.render(messages))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True))


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 and stop strings."""

    def __init__(self, chat_format: ChatFormat, stop_strings: tuple[str, ...] = ()) -> None:
        self._format = chat_format
        self._stop_strings = stop_strings
        self._ids: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the new text that is safe to show (empty while a stop string may start)."""
        self._ids.extend(int(t) for t in token_ids)
        text = self._format.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        for stop in self._stop_strings:
            index = text.find(stop)
            if index >= 0:
                text = text[:index]
                self.stopped = True
        hold = 0
        if not self.stopped:
            for stop in self._stop_strings:
                for size in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:size]):
                        hold = max(hold, size)
                        break
        visible = text[: len(text) - hold]
        delta = visible[self._emitted :] if len(visible) > self._emitted else ""
        self._emitted = max(self._emitted, len(visible))
        self.text = visible
        return delta

    def finish(self) -> str:
        """Flush what was held back for a possible stop string."""
        if self.stopped:
            return ""
        text = self._format.decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        self.text = text
        return delta
