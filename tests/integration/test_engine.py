"""Tests for remote_worker.engine on real fp32 shards of SmolLM2-135M: mask rollback, compaction,
isolation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

NO_RANGES = np.zeros((0, 2), np.int64)


def compiled_shards(stages: int, precision: str = "fp32") -> Path:
    """Real shards from the shard compiler (compiled once a test run)."""
    from tests.support.shards import compiled

    return compiled(stages, precision)


def chat_prompt(shard_dir: Path, question: str) -> np.ndarray:
    from tests.support.shards import chat_ids

    return np.array(chat_ids(shard_dir, question), np.int64)


class Chain:
    """Two stage engines driven in-process, the way the workers' daisy chain drives them."""

    def __init__(self, engines: list) -> None:
        self.engines = engines

    def open(self, session: int) -> None:
        for engine in self.engines:
            engine.open(session)

    def close(self, session: int) -> None:
        for engine in self.engines:
            engine.close(session)

    def cache_len(self, session: int) -> int:
        lengths = {engine.cache_len(session) for engine in self.engines}
        assert len(lengths) == 1, "stages disagree on the physical cache length"
        return lengths.pop()

    def step(
        self, session: int, pos0: int, tokens: np.ndarray, ranges: np.ndarray = NO_RANGES
    ) -> np.ndarray:
        cache_len = self.cache_len(session)
        data = np.asarray(tokens, np.int64)
        for engine in self.engines:
            data = engine.step(session, pos0, cache_len, ranges, data)
        return data

    def compact(self, session: int) -> int:
        cache_len = self.cache_len(session)
        return {engine.compact(session, cache_len) for engine in self.engines}.pop()


@pytest.fixture(scope="module")
def shard_dir() -> Path:
    return compiled_shards(2)


@pytest.fixture(scope="module")
def chain(shard_dir: Path) -> Chain:
    from remote_worker.engine import StageEngine

    return Chain(
        [
            StageEngine(shard_dir, index, inference_precision="f32", kv_cache_precision="f32")
            for index in (0, 1)
        ]
    )


def plain_greedy(chain: Chain, session: int, prompt: np.ndarray, count: int) -> list[int]:
    chain.open(session)
    token = int(chain.step(session, 0, prompt)[-1].argmax())
    tokens, position = [token], len(prompt)
    for _ in range(count - 1):
        token = int(chain.step(session, position, [token])[-1].argmax())
        tokens.append(token)
        position += 1
    chain.close(session)
    return tokens


def test_exact_settings_are_in_effect(chain: Chain) -> None:
    for engine in chain.engines:
        properties = engine.effective_properties()
        assert (
            "32" in properties["INFERENCE_PRECISION_HINT"]
            and "32" in properties["KV_CACHE_PRECISION"]
        )
        assert properties["NUM_STREAMS"] == "1"


def test_the_split_model_answers_sensibly(chain: Chain, shard_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokens = plain_greedy(chain, 1, chat_prompt(shard_dir, "What is the capital of France?"), 8)
    text = Tokenizer.from_file(str(shard_dir / "tokenizer" / "tokenizer.json")).decode(tokens)
    assert "Paris" in text


def speculative_greedy(
    chain: Chain,
    session: int,
    prompt: np.ndarray,
    count: int,
    reference: list[int],
    script: list[str],
    compact_after: set[int] = frozenset(),
) -> list[int]:
    """Greedy decoding with a scripted 3-token draft verified in one pass and rolled back by mask
    only.

    The draft is built from the reference tokens: "junk" (all wrong), "two" (2 right then 1 wrong),
    "one" (1 right then 2 wrong) or "all" (all right, so a bonus token follows).
    """
    chain.open(session)
    token = int(chain.step(session, 0, prompt)[-1].argmax())
    tokens, position, pending = [token], len(prompt), NO_RANGES
    for round_index in range(len(script)):
        if len(tokens) >= count:
            break
        right = {"junk": 0, "one": 1, "two": 2, "all": 3}[script[round_index]]
        draft = reference[len(tokens) : len(tokens) + 3]
        draft = draft[:right] + [(t + 1000 + i) % 49152 for i, t in enumerate(draft[right:])]
        start = chain.cache_len(session)
        logits = chain.step(session, position, np.array([token, *draft], np.int64), pending)
        best = logits.argmax(axis=1)
        accepted = 0
        while accepted < 3 and best[accepted] == draft[accepted]:
            accepted += 1
        assert accepted == right
        tokens += [*draft[:accepted], int(best[accepted])]
        position += 1 + accepted
        token = tokens[-1]
        # the slots of the rejected drafts stay in the cache; they are masked from the next step on
        pending = (
            np.array([[start + 1 + accepted, start + 4]], np.int64) if accepted < 3 else NO_RANGES
        )
        if round_index in compact_after:
            assert len(pending) == 0, "compact only when no rejection is waiting to be masked"
            # every masked slot dropped: physical == logical
            assert chain.compact(session) == position
    chain.close(session)
    return tokens[:count]


def test_mask_rollback_equals_plain_greedy(chain: Chain, shard_dir: Path) -> None:
    prompt = chat_prompt(shard_dir, "Name three colours of the rainbow.")
    reference = plain_greedy(chain, 2, prompt, 24)
    script = ["junk", "two", "one", "all", "junk", "junk", "two", "all", "one", "junk"]
    assert speculative_greedy(chain, 3, prompt, 18, reference, script) == reference[:18]


def test_compaction_keeps_output_identical(chain: Chain, shard_dir: Path) -> None:
    prompt = chat_prompt(shard_dir, "Name three colours of the rainbow.")
    reference = plain_greedy(chain, 4, prompt, 24)
    script = ["junk", "two", "one", "all", "junk", "junk", "two", "all", "one", "junk"]
    assert (
        speculative_greedy(chain, 5, prompt, 18, reference, script, compact_after={3, 7})
        == reference[:18]
    )


def test_interleaved_sessions_equal_each_alone(chain: Chain, shard_dir: Path) -> None:
    prompts = [
        chat_prompt(shard_dir, "What is the capital of France?"),
        chat_prompt(shard_dir, "Write a haiku about the sea."),
    ]
    alone = [plain_greedy(chain, 10 + index, prompt, 10) for index, prompt in enumerate(prompts)]
    sessions = [20, 21]
    for session in sessions:
        chain.open(session)
    # session 20 first holds another conversation and is reset while session 21 is live
    chain.step(20, 0, prompts[1][:7])
    chain.step(21, 0, prompts[0][:5])
    for engine in chain.engines:
        engine.reset(20)
        engine.reset(21)
    next_tokens = [
        int(chain.step(session, 0, prompt)[-1].argmax())
        for session, prompt in zip(sessions, prompts, strict=True)
    ]
    together = [[token] for token in next_tokens]
    positions = [len(prompt) for prompt in prompts]
    for _ in range(9):
        for index, session in enumerate(sessions):
            token = int(chain.step(session, positions[index], [together[index][-1]])[-1].argmax())
            together[index].append(token)
            positions[index] += 1
    for session in sessions:
        chain.close(session)
    assert together == alone
    assert together[0] != together[1]


def test_engine_refuses_inconsistent_requests(chain: Chain) -> None:
    from remote_worker.engine import EngineError

    first = chain.engines[0]
    with pytest.raises(EngineError, match="not open"):
        first.step(99, 0, 0, NO_RANGES, np.array([1], np.int64))
    first.open(30)
    first.step(30, 0, 0, NO_RANGES, np.array([1, 2, 3], np.int64))
    with pytest.raises(EngineError, match="expects 2 cached slots"):
        first.step(30, 3, 2, NO_RANGES, np.array([4], np.int64))
    with pytest.raises(EngineError, match="mask ranges"):
        first.step(30, 3, 3, np.array([[2, 4]], np.int64), np.array([4], np.int64))
    with pytest.raises(EngineError, match="vocabulary"):
        first.step(30, 3, 3, NO_RANGES, np.array([49152], np.int64))
    with pytest.raises(EngineError, match="hidden states"):
        chain.engines[1].open(30)
        chain.engines[1].step(30, 0, 0, NO_RANGES, np.zeros((1, 7), np.float32))
    assert first.cache_len(30) == 3  # refused requests left the cache alone
    first.reset(30)
    assert first.cache_len(30) == 0
    first.close(30)
    chain.engines[1].close(30)
    assert not first.has(30)


def test_the_head_projects_only_the_rows_asked_for_and_they_equal_the_full_projection(
    chain: Chain, shard_dir: Path
) -> None:
    """slice_logits: a prefill's head sees one row (n x vocabulary floats were thrown away before);
    the rows kept are exactly those rows of the whole projection, at any keep (a verify keeps K +
    1)."""
    first, last = chain.engines
    assert last.slices_logits and not first.slices_logits
    prompt = chat_prompt(shard_dir, "Why is the sky blue?")
    n = len(prompt)
    outputs = {}
    for session, keep in ((40, 0), (41, 1), (42, 3), (43, n + 5)):
        chain.open(session)
        hidden = first.step(session, 0, 0, NO_RANGES, prompt)
        outputs[keep] = last.step(session, 0, 0, NO_RANGES, hidden, keep_last=keep).copy()
        chain.close(session)
    assert outputs[0].shape == (n, 49152) and outputs[n + 5].shape == (n, 49152)
    assert outputs[1].shape == (1, 49152) and outputs[3].shape == (3, 49152)
    np.testing.assert_array_equal(outputs[1], outputs[0][-1:])
    np.testing.assert_array_equal(outputs[3], outputs[0][-3:])
    np.testing.assert_array_equal(outputs[n + 5], outputs[0])


def test_a_warm_up_mid_answer_leaves_no_session_behind_and_changes_no_token(
    chain: Chain, shard_dir: Path
) -> None:
    """warm_up (what a worker runs before it reports ready) steps a scratch session and closes it:
    an answer in progress on the same engines goes on token-identically, and the engines hold only
    its session."""
    prompt = chat_prompt(shard_dir, "Name three rivers in Europe.")
    expected = plain_greedy(chain, 60, prompt, 6)
    chain.open(61)
    tokens = [int(chain.step(61, 0, prompt)[-1].argmax())]
    for engine in chain.engines:
        assert engine.warm_up() > 0 and engine.warm_up_seconds > 0
        assert set(engine.sessions) == {61}
    position = len(prompt)
    for _ in range(5):
        tokens.append(int(chain.step(61, position, [tokens[-1]])[-1].argmax()))
        position += 1
    chain.close(61)
    assert tokens == expected
    assert all(engine.sessions == {} for engine in chain.engines)
