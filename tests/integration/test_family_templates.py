"""Each family's real chat template gives the same token ids here as transformers'
`apply_chat_template`, and a template stored beside a model (chat_template.jinja) is the one its
shards carry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleettui.runtime.chat_format import ChatFormat, ChatMessage
from tests.support.chat_templates import LLAMA_3_1, QWEN_2_5
from tests.support.shards import reference_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
QWEN_3 = (TEMPLATES / "qwen3.jinja").read_text()
PHI_3 = (TEMPLATES / "phi3.jinja").read_text()
CONVERSATION = [
    {"role": "system", "content": "You are terse.  Café ☕ & <b>tags</b>."},
    {"role": "user", "content": "What's 2 + 2?\n\nAnswer in   one word."},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nFour."},
    {"role": "user", "content": "And 3 × 3? 🙂"},
]
CASES = [
    ("llama-3.1", LLAMA_3_1, CONVERSATION, {}),
    ("qwen2.5", QWEN_2_5, CONVERSATION, {}),
    ("qwen2.5 no system", QWEN_2_5, CONVERSATION[1:], {}),
    ("qwen3 thinking by default", QWEN_3, CONVERSATION, {}),
    ("qwen3 enable_thinking=False", QWEN_3, CONVERSATION, {"enable_thinking": False}),
    ("qwen3 enable_thinking=True", QWEN_3, CONVERSATION[1:], {"enable_thinking": True}),
    ("phi-3", PHI_3, CONVERSATION, {}),
]


class _Manifest:
    """The fields of a Manifest that ChatFormat reads."""

    def __init__(self, template: str) -> None:
        self.tokenizer, self.chat_template, self.model_name = "tokenizer", template, "smollm2"
        self.bos_token_id, self.eos_token_ids = 1, (2,)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer (the one real tokenizer every test run has) in a shard-like folder."""
    root = tmp_path_factory.mktemp("family-templates")
    (root / "tokenizer").mkdir()
    reference_tokenizer().backend_tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    return root


def transformers_ids(
    template: str, messages: list[dict[str, Any]], generation: bool, **options: Any
) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    backend = reference_tokenizer().backend_tokenizer
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=backend.id_to_token(1), eos_token=backend.id_to_token(2)
    )
    tokenizer.chat_template = template
    result = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation, return_dict=True, **options
    )
    return list(result["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize(
    ("name", "template", "messages", "options"), CASES, ids=[case[0] for case in CASES]
)
def test_rendered_ids_equal_transformers(
    folder, name, template, messages, options, generation
) -> None:
    chat = ChatFormat(folder, _Manifest(template))  # type: ignore[arg-type]
    turns = [ChatMessage(m["role"], m["content"]) for m in messages]
    expected = transformers_ids(template, messages, generation, **options)
    assert chat.encode(chat.render(turns, generation, **options)) == expected
    if generation and name.startswith("qwen3"):
        empty_think = chat.render(turns, **options).endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        assert empty_think == (options.get("enable_thinking") is False)


def test_a_folder_template_file_is_the_one_exported(tmp_path: Path) -> None:
    """A Hugging Face folder's chat_template.jinja (transformers' own place for it) reaches the
    shards."""
    from shard_compiler.sources import ModelConfig, ModelSource
    from shard_compiler.tokenizer import export_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    reference_tokenizer().backend_tokenizer.save(str(model / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
    }
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    (model / "chat_template.jinja").write_text(QWEN_3)
    config = ModelConfig(
        "qwen3",
        "Qwen3ForCausalLM",
        1,
        64,
        128,
        49152,
        2,
        1,
        32,
        1e-6,
        1e6,
        None,
        4096,
        False,
        1,
        (2,),
        None,
    )
    info = export_tokenizer(ModelSource("model", "hf", model), config, {}, tmp_path / "out")
    assert info.chat_template == QWEN_3
    assert (
        json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["chat_template"]
        == QWEN_3
    )
