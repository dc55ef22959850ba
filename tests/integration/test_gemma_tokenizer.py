"""Tests of Gemma-3-270M's SentencePiece tokenizer as exported from its GGUF: ids equal
transformers', bos added, and streamed text never shows a broken UTF-8 character (byte-fallback
pieces are held until they complete)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleettui.runtime.chat_format import ChatFormat, TextStream
from shard_compiler.sources import ModelConfig, ModelSource, gguf_metadata
from shard_compiler.tokenizer import export_tokenizer
from tests.support.gemma import PROMPTS, gguf_path, reference_tokenizer

pytestmark = pytest.mark.slow

BOS = 2


class _Manifest:
    """The fields of a Manifest that ChatFormat reads (the tokenizer export alone, no shards)."""

    tokenizer, chat_template, model_name = "tokenizer", "", "gemma-3-270m"
    eos_token_ids, bos_token_id = (1,), BOS


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatFormat:
    folder = tmp_path_factory.mktemp("gemma-tokenizer")
    config = ModelConfig(
        "gemma3_text",
        "Gemma3ForCausalLM",
        18,
        640,
        2048,
        262144,
        4,
        1,
        256,
        1e-6,
        1e6,
        None,
        32768,
        True,
        BOS,
        (1,),
        0,
    )
    info = export_tokenizer(
        ModelSource("gemma-3-270m", "gguf", gguf_path()), config, {}, folder / "tokenizer"
    )
    # a base model: no template in its GGUF
    assert info.chat_template == "" and info.bos_token_id == BOS
    return ChatFormat(folder, _Manifest())  # type: ignore[arg-type]


def test_the_gguf_asks_for_bos_and_has_262144_tokens(chat: ChatFormat) -> None:
    meta = gguf_metadata(gguf_path(), ["tokenizer.ggml.model", "tokenizer.ggml.add_bos_token"])
    assert meta == {"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": True}
    assert (
        chat.tokenizer.id_to_token(262143) is not None
        and chat.tokenizer.id_to_token(262144) is None
    )
    assert chat.tokenizer.id_to_token(BOS) == "<bos>"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_raw_prompt_ids_equal_transformers_after_bos(chat: ChatFormat, prompt: str) -> None:
    expected = reference_tokenizer()(prompt, add_special_tokens=False).input_ids
    assert chat.encode_text(prompt) == [BOS, *expected]
    assert chat.encode(prompt) == expected  # a rendered template's text: nothing added


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_is_whole_characters_and_adds_up(chat: ChatFormat, prompt: str) -> None:
    ids = chat.encode_text(prompt)
    stream = TextStream(chat)
    deltas = [stream.push([token]) for token in ids]
    deltas.append(stream.finish())
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == prompt == chat.decode(ids)
    assert b"".join(chat.token_bytes(token) for token in ids[1:]) == prompt.encode()


def test_a_character_split_over_byte_fallback_pieces_streams_only_when_whole(
    chat: ChatFormat,
) -> None:
    ids = chat.encode("𝔘")  # a character the vocabulary lacks: four <0x..> byte pieces
    assert [chat.tokenizer.id_to_token(token) for token in ids] == [
        "<0xF0>",
        "<0x9D>",
        "<0x94>",
        "<0x98>",
    ]
    stream = TextStream(chat)
    assert [stream.push([token]) for token in ids] == ["", "", "", "𝔘"]


GEMMA_3 = (Path(__file__).parents[1] / "data" / "chat_templates" / "gemma3.jinja").read_text()
TURNS = [
    ("system", "Answer briefly.  Ünïcode ☕"),
    ("user", "What is  the capital of France?\n"),
    ("assistant", " Paris. "),
    ("user", "And of Japan? 🙂"),
]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize("turns", [TURNS, TURNS[1:]], ids=["system", "no system"])
def test_the_gemma3_template_gives_transformers_ids(chat: ChatFormat, turns, generation) -> None:
    from fleettui.runtime.chat_format import ChatMessage, compile_template

    reference = reference_tokenizer()
    reference.chat_template = GEMMA_3
    messages = [{"role": role, "content": content} for role, content in turns]
    expected = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation, return_dict=True
    )["input_ids"]
    # as a -it GGUF's tokenizer.chat_template would give it
    chat.template = compile_template(GEMMA_3)
    try:
        ids = chat.encode(
            chat.render([ChatMessage(role, text) for role, text in turns], generation)
        )
    finally:
        chat.template = None
    assert ids == list(expected)
    assert ids[0] == BOS and 105 in ids  # <bos> once, <start_of_turn> as its own token
