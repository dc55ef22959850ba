"""Provides the model's tokenizer and chat template for the coordinator (no torch, no transformers).

Chat templates render in the same Jinja environment as transformers' `apply_chat_template` (a
sandbox with trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a
`tojson` that does not escape HTML), so a model's own template gives the same prompt here as in
transformers. Replies are detokenised incrementally with tokenizers' `DecodeStream`: each token
costs one step, not a re-decode of the whole reply."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from remote_worker.manifest import Manifest


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message: its id (`call_...`), the function's name, its
    arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls (its content may then be empty)
    tool_call_id: str | None = None  # a tool message: the call it answers


NO_TEMPLATE_HINT = "send a raw prompt (/v1/completions, `fleettui ask --raw`)"


class ChatTemplateError(ValueError):
    """A chat template refused the conversation (its own `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping (templates put tool schemas into prompts with it)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def template_environment() -> Any:
    """The Jinja environment transformers renders chat templates in (`{% generation %}` renders
    its body)."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        here: its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller: Any) -> str:
            return str(caller())

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def compile_template(text: str) -> Any:
    """A chat template (Jinja source) compiled in `template_environment()`."""
    import jinja2

    try:
        return template_environment().from_string(text)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from None


def render_template(
    template: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **context: Any,
) -> str:
    """Render a compiled template as transformers does (`context`: bos_token, eos_token, tools,
    date_string ...)."""
    import jinja2

    try:
        return str(
            template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context
            )
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template: {error}") from None


@functools.cache  # one table for every token of every reply
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(byte): byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


class ChatFormat:
    """Encodes conversations with the shard's own chat template and tokenizer; decodes replies."""

    def __init__(self, shard_dir: Path, manifest: Manifest) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(
            str(Path(shard_dir) / manifest.tokenizer / "tokenizer.json")
        )
        self.template = compile_template(manifest.chat_template) if manifest.chat_template else None
        self.model_name = manifest.model_name
        self.eos_token_ids = frozenset(manifest.eos_token_ids)
        self.bos_token = self._token_text(manifest.bos_token_id)
        self.eos_token = self._token_text(
            manifest.eos_token_ids[0] if manifest.eos_token_ids else None
        )

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(int(token_id)) or ""

    @property
    def has_chat_template(self) -> bool:
        """False for a base model: it continues text (completions) and has no conversation
        format."""
        return self.template is not None

    def render(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, **options: Any
    ) -> str:
        """The conversation in the model's own template; OPTIONS reach it as variables
        (enable_thinking=False)."""
        if self.template is None:  # never a made-up format: a base model's "chat" would be noise
            raise ChatTemplateError(
                f"{self.model_name} has no chat template (a base model): {NO_TEMPLATE_HINT}"
            )
        return render_template(
            self.template,
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **options,
        )

    def encode_chat(self, messages: list[ChatMessage], **options: Any) -> list[int]:
        return self.encode(self.render(messages, **options))

    def encode_question(self, text: str) -> list[int]:
        """One user prompt as the model takes it (the bench's): in its chat template, or raw for
        a base model."""
        return (
            self.encode_chat([ChatMessage("user", text)])
            if self.template
            else self.encode_text(text)
        )

    def encode(self, text: str) -> list[int]:
        """Ids of TEXT as it is (a rendered chat template already holds its special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """Ids of a raw prompt, with what the tokenizer adds to one (bos for Llama 3 and Gemma,
        none for SmolLM2)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a UTF-8
        character)."""
        piece = self.tokenizer.id_to_token(int(token_id)) or ""
        if type(self.tokenizer.decoder).__name__ == "ByteLevel":
            table = _byte_level_table()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        if (
            len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
        ):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def decode_stream(self) -> Any:
        """A fresh incremental decoder (tokenizers' DecodeStream) for one reply."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 and stop
    strings.

    Each pushed token is one `DecodeStream.step` (incomplete UTF-8 yields nothing until it
    completes), so a reply of n tokens costs O(n), not O(n^2). Stop strings stay exact: text that
    may be the start of a stop string is held back until it is known not to be; a stop string ends
    the text right before it."""

    def __init__(self, chat_format: ChatFormat, stop_strings: tuple[str, ...] = ()) -> None:
        self._tokenizer = chat_format.tokenizer
        self._decoder = chat_format.decode_stream()
        self._stop_strings = tuple(stop for stop in stop_strings if stop)
        self._raw = ""  # everything decoded so far (append-only)
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the new text that is safe to show (empty while a stop string may
        start)."""
        if self.stopped:
            return ""
        for token in token_ids:
            chunk = self._decoder.step(self._tokenizer, int(token))
            if chunk:
                self._raw += chunk
        text = self._raw
        # No stop string can start inside text already shown: a possible start was held back.
        cut = min(
            (
                index
                for stop in self._stop_strings
                if (index := text.find(stop, self._emitted)) >= 0
            ),
            default=-1,
        )
        if cut >= 0:
            text = text[:cut]
            self.stopped = True
        hold = 0
        if not self.stopped:
            for stop in self._stop_strings:
                for size in range(min(len(stop) - 1, len(text) - self._emitted), 0, -1):
                    if text.endswith(stop[:size]):
                        hold = max(hold, size)
                        break
        visible = text[: len(text) - hold]
        delta = visible[self._emitted :]
        self._emitted = max(self._emitted, len(visible))
        self.text = visible
        return delta

    def finish(self) -> str:
        """Flush what was held back for a possible stop string."""
        if self.stopped:
            return ""
        delta = self._raw[self._emitted :]
        self._emitted = len(self._raw)
        self.text = self._raw
        return delta
