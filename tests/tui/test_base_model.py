"""Tests of a base model (no chat template): chat refused in one line, completions and completion
mode served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import Input

from fleettui.runtime.chat_format import ChatFormat, ChatMessage, ChatTemplateError
from fleettui.runtime.generation import GenerationParams
from fleettui.ui.app import FleetApp
from fleettui.ui.widgets.chat import ChatPane
from remote_worker.manifest import Manifest
from tests.support.tui_fakes import FakeController, demo_fleet
from tests.tui.test_tui import SIZE, wait_until


def _tokenizer_folder(tmp_path: Path) -> Path:
    """A word-level tokenizer that adds <s> to a raw prompt (as Gemma's does), in a shard-like
    folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "[UNK]", "once", "upon", "a", "time"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    (tmp_path / "tokenizer").mkdir()
    tokenizer.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    return tmp_path


class _Manifest:
    """The fields of a Manifest that ChatFormat reads."""

    def __init__(self, template: str) -> None:
        self.tokenizer, self.chat_template, self.model_name = "tokenizer", template, "base-model"
        self.eos_token_ids, self.bos_token_id = (1,), 0


def _format(tmp_path: Path, template: str) -> ChatFormat:
    manifest: Manifest = _Manifest(template)  # type: ignore[assignment]
    return ChatFormat(_tokenizer_folder(tmp_path), manifest)


def test_a_model_without_a_template_refuses_chat_in_one_line_and_encodes_raw_prompts_with_bos(
    tmp_path,
):
    chat = _format(tmp_path, "")
    assert not chat.has_chat_template
    with pytest.raises(ChatTemplateError) as refused:
        chat.encode_chat([ChatMessage("user", "once upon a time")])
    message = str(refused.value)
    assert (
        "\n" not in message and "base-model has no chat template" in message and "--raw" in message
    )
    # bos, as the tokenizer adds to a prompt
    assert chat.encode_text("once upon a time") == [
        0,
        3,
        4,
        5,
        6,
    ]
    assert chat.encode("once upon") == [3, 4]  # a rendered template's text: as it is


def test_a_model_with_a_template_renders_it(tmp_path):
    chat = _format(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat.has_chat_template
    assert chat.encode_chat([ChatMessage("user", "once upon")]) == [0, 3, 4]


def _base_controller(*args, **kwargs) -> FakeController:
    controller = FakeController(*args, **kwargs)
    controller.chat_template = False
    return controller


async def test_the_tui_chats_with_a_base_model_in_completion_mode_and_says_so():
    app = FleetApp(demo_fleet(), _base_controller, GenerationParams(max_tokens=16))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        pane = app.query_one(ChatPane)
        assert pane.completion_mode and "completion mode" in str(pane.border_title)
        assert "continue" in app.query_one("#prompt", Input).placeholder.lower()
        await pilot.press(*"Once", "enter")
        session = pane.active
        await wait_until(
            pilot, lambda: session.replies and session.replies[-1].done, 10, "the continuation"
        )
        # the fake's raw (completion) path
        assert session.replies[-1].text == "and so on after 'Once'"


async def test_the_tui_chats_with_a_chat_model_as_before():
    app = FleetApp(demo_fleet(), FakeController, GenerationParams(max_tokens=16))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.ready, 10, "ready")
        pane = app.query_one(ChatPane)
        assert not pane.completion_mode and pane.border_title == "chat"


def test_published_configs_name_their_source():
    folder = Path(__file__).parents[2] / "fleettui" / "model" / "published"
    readme = (folder / "README.md").read_text()
    for path in folder.glob("*.json"):
        assert f"`{path.name}`: https://huggingface.co/" in readme
        assert isinstance(json.loads(path.read_text()), dict)
