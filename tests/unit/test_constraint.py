"""Unit tests of grammar-constrained decoding's parts: the constraint module (llguidance on a small
byte-level BPE tokenizer trained here), the token-mask frame of the wire protocol, and the last
stage's masked scoring."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from fleettui.runtime.constraint import (
    ConstraintError,
    ConstraintSpec,
    ReplyGrammar,
    check_constraint,
    json_object_grammar,
    json_schema_grammar,
)
from remote_worker import protocol
from remote_worker.decoding import apply_mask, score

EOS = 0
CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    'Let me call a tool. <call>{"city": "Paris"} and <call>\n{"a": 1}',
    "The capital of France is Paris. true false null 0123456789 {}[]:,",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    assert tok.token_to_id("<eos>") == EOS
    return tok


class Format:
    """What the coordinator passes: a tokenizer and the model's EOS ids (a ChatFormat's two
    fields)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset({EOS})


@pytest.fixture(scope="module")
def chat_format(tokenizer: Any) -> Format:
    return Format(tokenizer)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text).ids)


def test_a_schema_compiles_and_its_matcher_follows_a_valid_answer(
    tokenizer: Any, chat_format: Format
) -> None:
    spec = ConstraintSpec(json_schema_grammar(PERSON), "json_schema Person")
    check_constraint(spec, chat_format)
    grammar = ReplyGrammar(spec, chat_format)
    answer = ids(tokenizer, '{"name":"Ada","age":36}')
    kept, masks = grammar.plan(tuple(answer))
    assert kept == len(answer) and masks is not None and masks.shape[0] == len(answer) + 1
    assert all(grammar.allows(masks[i], token) for i, token in enumerate(answer))
    assert grammar.complete is False  # planning left the matcher at the start
    assert grammar.advance(answer) == answer
    assert grammar.complete is True and grammar.stopped
    final = grammar.plan(())[1]
    assert final is not None and [t for t in range(600) if grammar.allows(final[0], t)] == [EOS]


def test_a_draft_is_cut_at_its_first_token_the_grammar_rejects(
    tokenizer: Any, chat_format: Format
) -> None:
    grammar = ReplyGrammar(ConstraintSpec(json_schema_grammar(PERSON), "p"), chat_format)
    good = ids(tokenizer, '{"name":"Ada"')
    bad = ids(tokenizer, "Paris")
    kept, masks = grammar.plan(tuple(good + bad + good))
    assert kept == len(good) and masks is not None and len(masks) == kept + 1
    assert not grammar.allows(masks[kept], bad[0])
    assert grammar.drafts_cut == len(bad) + len(good)
    # the matcher was rolled back
    assert grammar.complete is False and grammar.advance(good) == good


def test_a_draft_ends_before_eos_and_the_matcher_stays_in_step(
    tokenizer: Any, chat_format: Format
) -> None:
    """An EOS in a draft is left to the verify; planning over it never moves the matcher (llguidance
    does not count a consumed EOS when it rolls back)."""
    grammar = ReplyGrammar(ConstraintSpec(json_schema_grammar(PERSON), "p"), chat_format)
    answer = ids(tokenizer, '{"name":"Ada","age":36}')
    assert grammar.advance(answer[:-2]) == answer[:-2]
    kept, masks = grammar.plan((*answer[-2:], EOS, EOS))
    assert kept == 2 and masks is not None and grammar.allows(masks[2], EOS)
    assert grammar.advance([*answer[-2:], EOS]) and grammar.complete and grammar.stopped


def test_any_json_object_grammar(tokenizer: Any, chat_format: Format) -> None:
    grammar = ReplyGrammar(ConstraintSpec(json_object_grammar(), "json_object"), chat_format)
    first = grammar.plan(())[1]
    # not an array
    assert first is not None and not grammar.allows(first[0], ids(tokenizer, "[")[0])
    assert grammar.advance(ids(tokenizer, '{"a":[1,{"b":null}],"c":"x"}')) and grammar.complete


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        (
            {"type": "object", "dependentSchemas": {"a": {}}},
            "unsupported JSON-schema keyword dependentSchemas",
        ),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "/nowhere"),
    ],
)
def test_an_unusable_schema_is_one_line_naming_it(
    chat_format: Format, schema: dict, named: str
) -> None:
    with pytest.raises(ConstraintError) as caught:
        check_constraint(ConstraintSpec(json_schema_grammar(schema), "bad"), chat_format)
    message = str(caught.value)
    assert named in message and "\n" not in message


def test_a_schema_that_is_not_an_object_or_not_json_is_refused() -> None:
    with pytest.raises(ConstraintError, match="must be an object"):
        json_schema_grammar([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ConstraintError, match="not JSON"):
        json_schema_grammar({"type": "number", "maximum": float("nan")})


def test_a_bad_lark_grammar_and_an_empty_trigger_are_refused(chat_format: Format) -> None:
    with pytest.raises(ConstraintError, match="unknown name"):
        check_constraint(ConstraintSpec("start: missing_rule", "lark"), chat_format)
    with pytest.raises(ConstraintError, match="trigger"):
        check_constraint(ConstraintSpec(json_object_grammar(), "t", trigger=""), chat_format)


@pytest.mark.parametrize("trigger", ["<call>", "<ca", "call>\n", "l>\n{"])
def test_a_trigger_cuts_the_reply_right_after_it(
    tokenizer: Any, chat_format: Format, trigger: str
) -> None:
    """Wherever the trigger ends inside a token, the kept tokens decode to the text up to the
    trigger's end, and the grammar constrains from there."""
    text = 'Let me call a tool. <call>\n{"a": 1} more'
    grammar = ReplyGrammar(ConstraintSpec(json_object_grammar(), "t", trigger=trigger), chat_format)
    tokens = ids(tokenizer, text)
    # free text: nothing masked, nothing cut
    assert grammar.plan(tuple(tokens)) == (
        len(tokens),
        None,
    )
    kept = grammar.advance(tokens[:5]) + grammar.advance(tokens[5:])
    end = text.index(trigger) + len(trigger)
    assert tokenizer.decode(kept) == text[:end]
    assert grammar.active and grammar.complete is False
    assert grammar.advance(ids(tokenizer, '{"a":1}')) and grammar.complete


def test_no_constrained_text_before_the_trigger(tokenizer: Any, chat_format: Format) -> None:
    grammar = ReplyGrammar(
        ConstraintSpec(json_object_grammar(), "t", trigger="<tool>"), chat_format
    )
    tokens = ids(tokenizer, "no tool here, just text")
    assert grammar.advance(tokens) == tokens and grammar.complete is None and not grammar.active


# -- the wire frame and the last stage
# -----------------------------------------------------------------


def packed(allowed: list[list[int]], vocab: int) -> np.ndarray:
    bits = np.zeros((len(allowed), (vocab + 31) // 32 * 32), np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


def step_with(decode: protocol.Decode, n: int = 3) -> protocol.Step:
    return protocol.Step(
        7, 1, 10, 10, np.zeros((0, 2), np.int64), tokens=np.arange(n, dtype=np.int64), decode=decode
    )


def test_the_token_mask_round_trips() -> None:
    mask = packed([[1, 5], [40], [0, 63, 64]], 70)
    decode = protocol.Decode(draft_tokens=np.array([5, 40], np.int64), token_mask=mask)
    back = protocol.decode(protocol.encode(step_with(decode)))
    assert isinstance(back, protocol.Step) and back.decode is not None
    assert back.decode.constrained and np.array_equal(back.decode.token_mask, mask)
    plain = protocol.decode(protocol.encode(step_with(protocol.Decode(), 1)))
    assert (
        isinstance(plain, protocol.Step)
        and plain.decode is not None
        and not plain.decode.constrained
    )


def _frames(decode: protocol.Decode) -> list[bytes]:
    return [bytes(frame) for frame in protocol.encode(step_with(decode))]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("short", "token mask: 12 bytes, expected 24"),
        ("empty row", "token mask row 1 allows no token"),
        ("no width", "a token mask without its width"),
        ("too wide", "too wide"),
    ],
)
def test_a_malformed_mask_frame_is_refused_with_one_line(damage: str, reason: str) -> None:
    mask = packed([[1], [2], [3]], 64)
    frames = _frames(protocol.Decode(draft_tokens=np.array([1, 2], np.int64), token_mask=mask))
    spec_at, mask_at = 3, 3 + protocol.DECODE_FRAMES - 1
    fields = list(protocol.DECODE.unpack(frames[spec_at]))
    if damage == "short":
        frames[mask_at] = frames[mask_at][:12]
    elif damage == "empty row":
        broken = mask.copy()
        broken[1] = 0
        frames[mask_at] = broken.tobytes()
    elif damage == "no width":
        fields[-1] = 0
    else:
        fields[-1] = protocol.MAX_MASK_WORDS + 1
    frames[spec_at] = protocol.DECODE.pack(*fields)
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.decode(frames)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_a_run_or_a_proposal_never_carries_a_mask() -> None:
    decode = protocol.Decode(token_mask=packed([[1]], 64))
    run = protocol.Step(
        7, 1, 0, 0, np.zeros((0, 2), np.int64), tokens=np.array([1]), decode=decode, run=5
    )
    with pytest.raises(protocol.ProtocolError, match="only go with a verify step"):
        protocol.decode(protocol.encode(run))


def test_the_last_stage_chooses_only_allowed_tokens() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 100)).astype(np.float32)
    allowed = [[4, 9], [17], [3, 50, 99]]
    drafts = np.array([int(np.argmax(logits[0])), 17], np.int64)  # the first draft is disallowed
    decode = protocol.Decode(draft_tokens=drafts, token_mask=packed(allowed, 100))
    tokens, accepted, _, _ = score(logits, decode)
    best = 4 if logits[0, 4] > logits[0, 9] else 9
    if drafts[0] not in allowed[0]:
        assert accepted == 0 and list(tokens) == [best]
    greedy = protocol.Decode(
        draft_tokens=np.array([best, 17], np.int64), token_mask=packed(allowed, 100)
    )
    tokens, accepted, _, _ = score(logits, greedy)
    assert accepted == 2 and int(tokens[-1]) in allowed[2]
    for seed in range(20):  # sampling and the acceptance test see the masked distribution too
        uniforms = np.random.default_rng(seed).random(6)
        sampled = protocol.Decode(
            temperature=1.5,
            draft_tokens=np.array([9, 40], np.int64),
            uniforms=uniforms,
            token_mask=packed(allowed, 100),
        )
        tokens, accepted, _, _ = score(logits, sampled)
        assert all(int(token) in allowed[row] for row, token in enumerate(tokens))


def test_a_mask_narrower_than_the_vocabulary_disallows_the_rest() -> None:
    logits = np.zeros((1, 80), np.float32)
    logits[0, 70] = 5.0  # the favourite lies past the mask's width
    masked = apply_mask(logits, protocol.Decode(token_mask=packed([[2]], 64)))
    assert int(np.argmax(masked[0])) == 2 and np.isneginf(masked[0, 70])
    with pytest.raises(ValueError, match="allows no token"):
        apply_mask(np.zeros((1, 10), np.float32), protocol.Decode(token_mask=packed([[40]], 64)))


def test_json_schema_grammar_embeds_the_schema_verbatim() -> None:
    grammar = json_schema_grammar(PERSON)
    assert grammar.startswith("start: %json")
    # compact JSON unless the schema says
    compact = {
        **PERSON,
        "x-guidance": {"whitespace_flexible": False},
    }
    assert json.loads(grammar.removeprefix("start: %json")) == compact
    flexible = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
    assert json.loads(json_schema_grammar(flexible).removeprefix("start: %json")) == flexible


def test_the_grammar_forces_the_structure_tokens(tokenizer: Any, chat_format: Format) -> None:
    grammar = ReplyGrammar(ConstraintSpec(json_schema_grammar(PERSON), "p"), chat_format)
    forced = grammar.forced(16)
    assert tokenizer.decode(forced).startswith('{"name":')  # nothing else may start the answer
    # (the matcher did not move)
    assert grammar.forced(2) == forced[:2] and grammar.complete is False
    assert grammar.plan(tuple(forced))[0] == len(forced)
    free = ReplyGrammar(ConstraintSpec(json_object_grammar(), "t", trigger="<call>"), chat_format)
    assert free.forced(16) == []  # before its trigger nothing is forced


# -- fleettui ask --json-schema: bad schema files are refused before anything starts
# --------------------


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "No such file or directory"),
        ("{nope", "not JSON"),
        ('{"type": 5}', "invalid schema at type"),
        (
            '{"type": "object", "dependentSchemas": {"a": {}}}',
            "unsupported JSON-schema keyword dependentSchemas",
        ),
        ("[1]", "must be an object"),
    ],
)
def test_ask_refuses_a_bad_schema_file_with_one_line(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], content: str | None, reason: str
) -> None:
    from fleettui.cli import main
    from fleettui.config.fleet import DEFAULT_FLEET

    schema = tmp_path / "schema.json"
    if content is not None:
        schema.write_text(content)
    assert main(["ask", str(DEFAULT_FLEET), "--json-schema", str(schema), "Describe Paris."]) == 2
    error = capsys.readouterr().err.strip()
    assert reason in error and str(schema) in error and "\n" not in error


def test_ask_reports_a_cut_or_invalid_answer_in_one_line() -> None:
    import argparse

    from fleettui.commands.ask import _check_answer
    from fleettui.runtime.generation import GenerationStats

    args = argparse.Namespace(max_tokens=8)
    answer = '{"name":"Ada","age":36}'
    assert _check_answer(answer, GenerationStats(constraint_complete=True), PERSON, args) is None
    cut = _check_answer(
        '{"name": "A',
        GenerationStats(tokens=8, finish_reason="length", constraint_complete=False),
        PERSON,
        args,
    )
    assert cut is not None and "cut by --max-tokens at 8 tokens" in cut
    wrong = _check_answer(
        '{"name": 3, "age": 1}', GenerationStats(constraint_complete=True), PERSON, args
    )
    assert wrong is not None and "does not validate" in wrong
