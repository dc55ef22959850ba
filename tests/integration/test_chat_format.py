"""Chat templates render as in transformers; streamed detokenisation equals the full decode; stop
strings."""

from __future__ import annotations

from typing import Any

import pytest

from fleettui.runtime.chat_format import (
    ChatTemplateError,
    TextStream,
    compile_template,
    render_template,
)
from tests.support.chat_templates import LLAMA_3_1, MISTRAL_0_3, QWEN_2_5

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & \"tomorrow\" in a city: 'Zürich' ok",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse. Use <b>bold</b> & 'quotes'."},
    {"role": "user", "content": "Hello  <there> & café"},
    {"role": "assistant", "content": "  Hi!  "},
    {"role": "user", "content": "What's 2 < 3?"},
]


def transformers_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """transformers' own apply_chat_template on a tokenizer that carries only this template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        unk_token="<unk>",
        chat_template=template,
        **SPECIAL,
    )
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


def ours(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    generation = kwargs.pop("add_generation_prompt", False)
    return render_template(compile_template(template), messages, generation, **SPECIAL, **kwargs)


CASES = [
    ("llama-3.1", LLAMA_3_1, CONVERSATION, {}),
    ("llama-3.1 tools", LLAMA_3_1, CONVERSATION, {"tools": TOOLS, "date_string": "30 Nov 2026"}),
    ("llama-3.1 no system", LLAMA_3_1, CONVERSATION[1:], {}),
    ("qwen2.5", QWEN_2_5, CONVERSATION, {}),
    ("qwen2.5 default system", QWEN_2_5, CONVERSATION[1:], {}),
    ("qwen2.5 tools", QWEN_2_5, CONVERSATION, {"tools": TOOLS}),
    ("mistral", MISTRAL_0_3, CONVERSATION, {}),
    ("mistral tools", MISTRAL_0_3, CONVERSATION, {"tools": TOOLS}),
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize(
    ("name", "template", "messages", "extra"), CASES, ids=[case[0] for case in CASES]
)
def test_templates_render_exactly_as_transformers(
    name, template, messages, extra, generation_prompt
) -> None:
    expected = transformers_render(
        template, messages, add_generation_prompt=generation_prompt, **extra
    )
    got = ours(template, messages, add_generation_prompt=generation_prompt, **extra)
    assert got == expected
    if "tools" in extra:  # tojson does not escape HTML: the schema reads as written
        assert "Weather <now> & " in got and "Zürich" in got


def test_environment_has_loop_controls_strftime_now_and_generation_blocks() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}{% generation %}{{ m.content }}{% "
        "endgeneration %}|"
        "{% endfor %}{{ strftime_now('%Y') }}{{ {'a': '<&>'} | tojson }}"
    )
    messages = [
        {"role": r, "content": c}
        for r, c in [("system", "S"), ("user", "a"), ("user", "b"), ("user", "c")]
    ]
    got = ours(template, messages)
    assert got == transformers_render(template, messages)
    assert got.startswith("a|b|") and "c|" not in got and got.endswith('{"a": "<&>"}')


def test_raise_exception_is_one_clear_error() -> None:
    alternating = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ours(MISTRAL_0_3, alternating)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_template("{% for %}")


# -- streaming detokenisation
# ---------------------------------------------------------------------------


class FakeFormat:
    """A ChatFormat look-alike around a real tokenizers.Tokenizer (counts full decodes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.full_decodes = 0

    def decode(self, ids: list[int]) -> str:
        self.full_decodes += 1
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def decode_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=True)


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Any:
    """The real model's tokenizer, as exported into a compiled shard."""
    from tokenizers import Tokenizer

    from remote_worker.manifest import load_manifest
    from tests.support.shards import compiled

    directory = compiled(1, "int4")
    manifest = load_manifest(directory)
    return Tokenizer.from_file(str(directory / manifest.tokenizer / "tokenizer.json"))


TEXTS = [
    "The capital of France is Paris. Ça va? Zürich, 東京, emoji 🚀🎉 and ∑ math."
    "\n\n- a list\n- 12345",
    "  leading spaces, tabs\tand a very long wooooooooooooooooooord plus <|im_end|> text",
]


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_the_full_decode(smollm_tokenizer, text: str, chunk: int) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False).ids
    chat_format = FakeFormat(smollm_tokenizer)
    stream = TextStream(chat_format)  # type: ignore[arg-type]
    pieces = [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(stream.finish())
    assert "".join(pieces) == chat_format.decode(ids) == stream.text
    # a split UTF-8 character waits for its rest
    assert all("\ufffd" not in piece for piece in pieces)
    assert chat_format.full_decodes == 1  # only ours above: the stream never re-decodes the reply


@pytest.mark.slow
def test_stop_strings_stay_exact_across_token_boundaries(smollm_tokenizer) -> None:
    text = "Answer: Paris.\nUser: next question STOP here"
    ids = smollm_tokenizer.encode(text, add_special_tokens=False).ids
    for stop in ("\nUser:", "STOP", "Paris.\nU"):
        stream = TextStream(FakeFormat(smollm_tokenizer), (stop,))  # type: ignore[arg-type]
        shown = ""
        for token in ids:
            shown += stream.push([token])
            assert stop not in shown and not stream.stopped or shown == text[: text.index(stop)]
        shown += stream.finish()
        assert stream.stopped and shown == stream.text == text[: text.index(stop)]
    stream = TextStream(FakeFormat(smollm_tokenizer), ("never",))  # type: ignore[arg-type]
    shown = "".join(stream.push([token]) for token in ids) + stream.finish()
    assert shown == text and not stream.stopped
