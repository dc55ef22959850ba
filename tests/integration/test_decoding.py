"""Tests for remote_worker.decoding: greedy verification and distribution-preserving speculative
sampling."""

from __future__ import annotations

import numpy as np
import pytest

from remote_worker.decoding import propose_distribution, sample, score, target_distribution
from remote_worker.protocol import Decode

VOCAB = 6


def _logits_with_argmax(argmaxes: list[int], vocab: int = 10) -> np.ndarray:
    logits = np.zeros((len(argmaxes), vocab), np.float32)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_without_drafts_is_argmax() -> None:
    tokens, accepted, top_ids, top_logprobs = score(_logits_with_argmax([7]), Decode())
    assert tokens.tolist() == [7] and accepted == 0
    assert top_ids.shape == (0, 0) and top_logprobs.shape == (0, 0)


def test_greedy_accepts_matching_prefix_then_corrects() -> None:
    logits = _logits_with_argmax([3, 4, 9, 1])
    decode = Decode(draft_tokens=np.array([3, 4, 5], np.int64))
    tokens, accepted, _, _ = score(logits, decode)
    assert accepted == 2 and tokens.tolist() == [3, 4, 9]


def test_greedy_first_draft_rejected() -> None:
    tokens, accepted, _, _ = score(
        _logits_with_argmax([2, 4]), Decode(draft_tokens=np.array([3], np.int64))
    )
    assert accepted == 0 and tokens.tolist() == [2]


def test_greedy_all_accepted_adds_bonus() -> None:
    logits = _logits_with_argmax([3, 4, 8])
    tokens, accepted, _, _ = score(logits, Decode(draft_tokens=np.array([3, 4], np.int64)))
    assert accepted == 2 and tokens.tolist() == [3, 4, 8]


def test_top_logprobs_are_untempered_and_sorted_after_the_emitted_token() -> None:
    """Column 0 is the emitted token's own log-prob (sampled here, so not necessarily the
    likeliest), then the most probable ones in order, all of the untempered distribution."""
    logits = np.log(np.array([[0.1, 0.6, 0.3]], np.float32))
    for uniform, emitted in ((0.01, 0), (0.5, 1), (0.99, 2)):
        tokens, _, top_ids, top_logprobs = score(
            logits, Decode(temperature=2.0, top_logprobs=3, uniforms=np.full(2, uniform))
        )
        assert tokens.tolist() == [emitted] and top_ids.tolist() == [[emitted, 1, 2]]
        np.testing.assert_allclose(
            np.exp(top_logprobs), [[[0.1, 0.6, 0.3][emitted], 0.6, 0.3]], rtol=1e-5
        )
    # the emitted token's only
    tokens, _, top_ids, top_logprobs = score(logits, Decode(top_logprobs=1))
    assert top_ids.tolist() == [[1]] and np.exp(top_logprobs[0, 0]) == pytest.approx(0.6, rel=1e-5)


def test_top_logprobs_have_one_row_per_emitted_token_of_a_verify() -> None:
    logits = _logits_with_argmax([3, 5, 8])  # draft 3 accepted, draft 4 rejected: tokens 3, 5
    tokens, accepted, top_ids, _ = score(
        logits, Decode(draft_tokens=np.array([3, 4], np.int64), top_logprobs=2)
    )
    assert accepted == 1 and tokens.tolist() == [3, 5]
    assert top_ids.tolist() == [[3, 3], [5, 5]]


def test_score_rejects_wrong_row_count() -> None:
    with pytest.raises(ValueError, match="positions"):
        score(np.zeros((1, 10), np.float32), Decode(draft_tokens=np.array([1], np.int64)))


def test_target_distribution_filters() -> None:
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1, 0.0 + 1e-12]))
    np.testing.assert_allclose(
        target_distribution(logits, 1.0), np.exp(logits) / np.exp(logits).sum(), atol=1e-9
    )
    top2 = target_distribution(logits, 1.0, top_k=2)
    np.testing.assert_allclose(top2, [0, 0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], atol=1e-9)
    # 0.4 + 0.3 < 0.75 -> 0.15 is the crossing token
    nucleus = target_distribution(logits, 1.0, top_p=0.75)
    np.testing.assert_allclose(nucleus, [0, 0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0], atol=1e-9)


def test_nucleus_on_a_large_vocabulary_matches_full_sort() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=50_000) * 3
    probs = target_distribution(logits, 0.7, top_p=0.9)
    full = _softmax(logits / 0.7)
    order = np.argsort(-full)
    before = np.cumsum(full[order]) - full[order]
    expected = np.zeros_like(full)
    expected[order[before < 0.9]] = full[order[before < 0.9]]
    np.testing.assert_allclose(probs, expected / expected.sum(), atol=1e-12)


def test_propose_distribution_truncates_and_renormalises() -> None:
    logits = np.log(np.array([0.1, 0.5, 0.25, 0.15]))
    ids, probs = propose_distribution(logits, Decode(temperature=1.0), support=2)
    assert ids.tolist() == [1, 2] and ids.dtype == np.int64 and probs.dtype == np.float32
    np.testing.assert_allclose(probs, [0.5 / 0.75, 0.25 / 0.75], rtol=1e-6)


def test_sample_is_an_inverse_cdf_and_skips_empty_ids() -> None:
    ids = np.array([10, 11, 12, 13])
    probs = np.array([0.0, 0.5, 0.0, 0.5])
    assert [sample(ids, probs, u) for u in (0.0, 0.49, 0.5, 0.999999)] == [11, 11, 13, 13]
    assert sample(ids, probs, np.nextafter(1.0, 0.0)) == 13


def test_same_uniforms_same_tokens() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    draft_ids = np.stack([rng.permutation(50)[:8] for _ in range(3)])
    draft_probs = rng.dirichlet(np.ones(8), size=3).astype(np.float32)
    decode = Decode(
        temperature=0.8,
        top_p=0.95,
        draft_tokens=draft_ids[:, 0].copy(),
        draft_ids=draft_ids,
        draft_probs=draft_probs,
        uniforms=rng.random(8),
    )
    first = score(logits, decode)
    second = score(logits, decode)
    assert first[0].tolist() == second[0].tolist() and first[1] == second[1]


def _softmax(values: np.ndarray) -> np.ndarray:
    weights = np.exp(values - values.max())
    return weights / weights.sum()


def _chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    total = counts.sum()
    assert np.all(counts[expected_probs == 0] == 0), (
        "emitted a token the target gives probability 0"
    )
    mask = expected_probs > 0
    expected = expected_probs[mask] * total
    return float((((counts[mask] - expected) ** 2) / expected).sum())


# chi-square critical value for 5 degrees of freedom at p = 1e-4 (fixed seed, so this never flakes)
CRITICAL = 25.7

P0 = np.log(np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))
P1 = np.log(np.array([0.05, 0.10, 0.40, 0.05, 0.10, 0.30]))
Q_LOGITS = np.log(np.array([0.05, 0.05, 0.50, 0.30, 0.05, 0.05]))


def _run(
    draws: int, seed: int, temperature: float, top_k: int = 0, top_p: float = 1.0, support: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Emit tokens with a two-token draft; count the first token, and the second one after an
    acceptance."""
    rng = np.random.default_rng(seed)
    logits = np.stack([P0, P1, P0]).astype(np.float32)
    base = Decode(temperature=temperature, top_k=top_k, top_p=top_p)
    first_counts = np.zeros(VOCAB, np.int64)
    second_counts = np.zeros(VOCAB, np.int64)
    uniforms = rng.random((draws, 8))
    for index in range(draws):
        row = uniforms[index]
        if support:
            ids, probs = propose_distribution(Q_LOGITS, base, support)
            drafts = np.array([sample(ids, probs, row[6]), sample(ids, probs, row[7])], np.int64)
            draft_ids, draft_probs = np.stack([ids, ids]), np.stack([probs, probs])
        else:  # deterministic draft (prompt lookup): always proposes 2, 3
            drafts = np.array([2, 3], np.int64)
            draft_ids, draft_probs = np.zeros((2, 0), np.int64), np.zeros((2, 0), np.float32)
        decode = Decode(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            draft_tokens=drafts,
            draft_ids=draft_ids,
            draft_probs=draft_probs,
            uniforms=row[:6],
        )
        tokens, accepted, _, _ = score(logits, decode)
        first_counts[tokens[0]] += 1
        if accepted >= 1:
            second_counts[tokens[1]] += 1
    return first_counts, second_counts


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "support"),
    [
        (1.0, 0, 1.0, 6),  # full-support draft
        # draft truncated to its 2 most probable ids
        pytest.param(1.0, 0, 1.0, 2, marks=pytest.mark.slow),
        (0.7, 4, 1.0, 3),  # target filtered by top-k, draft by the same rule then truncated
        (1.3, 0, 0.8, 6),  # nucleus target
        (1.0, 0, 1.0, 0),  # deterministic draft: point mass
    ],
)
def test_speculative_sampling_preserves_the_target_distribution(
    temperature: float, top_k: int, top_p: float, support: int
) -> None:
    draws = 200_000 if support == 2 else 40_000
    first, second = _run(
        draws,
        seed=support * 7 + top_k,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        support=support,
    )
    p0 = target_distribution(P0, temperature, top_k, top_p)
    p1 = target_distribution(P1, temperature, top_k, top_p)
    assert _chi_square(first, p0) < CRITICAL
    assert second.sum() > 1000
    assert _chi_square(second, p1) < CRITICAL


def test_draft_equal_to_target_is_always_accepted() -> None:
    p = np.log(np.array([0.5, 0.3, 0.2]))
    ids, probs = propose_distribution(p, Decode(temperature=1.0), support=3)
    decode = Decode(
        temperature=1.0,
        draft_tokens=np.array([2], np.int64),
        draft_ids=ids[None],
        draft_probs=probs[None],
        uniforms=np.array([0.999, 0.1, 0.1, 0.1]),
    )
    tokens, accepted, _, _ = score(np.stack([p, p]).astype(np.float32), decode)
    assert accepted == 1 and tokens[0] == 2


# -----------------------------------------------------------------------------------------------
# penalties
def _penalty_decode(**fields: object) -> Decode:
    return Decode(**fields)  # type: ignore[arg-type]


def test_frequency_and_presence_penalties_follow_openai() -> None:
    from remote_worker.decoding import penalize

    logits = np.array([[1.0, 2.0, 3.0, 0.5]], np.float32)
    decode = _penalty_decode(
        frequency_penalty=0.5,
        presence_penalty=0.25,
        penalty_ids=np.array([0, 2, 3], np.int64),
        # id 0 is only in the prompt: no OpenAI penalty
        penalty_counts=np.array([0, 3, 1], np.int32),
    )
    np.testing.assert_allclose(
        penalize(logits, decode), [[1.0, 2.0, 3.0 - 1.5 - 0.25, 0.5 - 0.5 - 0.25]]
    )


def test_repetition_penalty_follows_hf_over_the_whole_context() -> None:
    from remote_worker.decoding import penalize

    logits = np.array([[2.0, -2.0, 3.0, 1.0]], np.float32)
    decode = _penalty_decode(
        repetition_penalty=2.0,
        penalty_ids=np.array([0, 1], np.int64),
        penalty_counts=np.zeros(2, np.int32),
    )
    np.testing.assert_allclose(penalize(logits, decode), [[1.0, -4.0, 3.0, 1.0]])
    assert penalize(logits, Decode()) is logits  # no penalty: no copy


def _sequential_penalized_greedy(
    logits: np.ndarray, base: dict[int, int], seen: set[int], **p: float
) -> list:
    """Plain decoding, one token at a time, each position penalized by what was emitted before
    it."""
    counts, context, tokens = dict(base), set(seen), []
    for row in logits:
        values = row.astype(np.float64).copy()
        for token in context:
            values[token] = values[token] / p["r"] if values[token] > 0 else values[token] * p["r"]
        for token, count in counts.items():
            if count:
                values[token] -= count * p["f"] + p["p"]
        token = int(np.argmax(values))
        tokens.append(token)
        counts[token] = counts.get(token, 0) + 1
        context.add(token)
    return tokens


@pytest.mark.parametrize("seed", range(5))
def test_penalties_are_exact_under_speculation(seed: int) -> None:
    """Verify position j counts the drafts before j: accepting the sequential choices reproduces
    them."""
    rng = np.random.default_rng(seed)
    vocab, k = 12, 5
    logits = rng.normal(size=(k + 1, vocab)).astype(np.float32)
    logits[:, 3] += 2.5  # a token plain greedy would repeat without penalties
    ids = np.array([1, 3, 7], np.int64)
    counts = np.array([0, 2, 1], np.int32)
    options = {"f": 0.4, "p": 0.3, "r": 1.3}
    expected = _sequential_penalized_greedy(logits, {1: 0, 3: 2, 7: 1}, {1, 3, 7}, **options)
    fields = {
        "frequency_penalty": options["f"],
        "presence_penalty": options["p"],
        "repetition_penalty": options["r"],
        "penalty_ids": ids,
        "penalty_counts": counts,
    }
    tokens, accepted, _, _ = score(
        logits, Decode(draft_tokens=np.array(expected[:k], np.int64), **fields)
    )
    assert accepted == k and tokens.tolist() == expected
    wrong = list(expected[:k])
    wrong[2] = (wrong[2] + 1) % vocab
    tokens, accepted, _, _ = score(logits, Decode(draft_tokens=np.array(wrong, np.int64), **fields))
    assert accepted == 2 and tokens.tolist() == expected[:3]
    unpenalized, _, _, _ = score(logits, Decode(draft_tokens=np.array(expected[:k], np.int64)))
    assert unpenalized.tolist() != expected  # the penalties changed the choice


def test_sampling_uses_penalized_distribution() -> None:
    logits = np.array([[5.0, 0.0, 0.0]], np.float32)
    decode = Decode(
        temperature=1.0,
        uniforms=np.array([0.5, 0.5]),
        presence_penalty=2.0,
        frequency_penalty=2.0,
        penalty_ids=np.array([0], np.int64),
        penalty_counts=np.array([2], np.int32),
    )
    tokens, _, _, _ = score(logits, decode)  # 5 - 4 - 2 = -1: token 0 is now the least likely
    assert tokens.tolist() == [1]
    plain, _, _, _ = score(logits, Decode(temperature=1.0, uniforms=np.array([0.5, 0.5])))
    assert plain.tolist() == [0]


def test_a_runs_next_decode_is_what_the_coordinator_would_send() -> None:
    """Each token of a run uses its own two uniforms, and the penalties count the tokens emitted so
    far exactly as the coordinator's Decode of the next round would (context ids and reply
    counts)."""
    from fleettui.runtime.generation import GenerationParams, penalties
    from remote_worker.decoding import run_next, run_step

    params = GenerationParams(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.3)
    prompt, reply = [5, 9, 9, 2], [9, 11]
    uniforms = np.random.default_rng(3).random(8)
    decode = Decode(0.8, uniforms=uniforms, **penalties(params, prompt + reply, reply))
    assert run_step(decode).uniforms.tolist() == uniforms[:2].tolist()
    for token in (11, 3, 3):
        decode = run_next(decode, token)
        reply.append(token)
        expected = penalties(params, prompt + reply, reply)
        assert decode.penalty_ids.tolist() == expected["penalty_ids"].tolist()
        assert decode.penalty_counts.tolist() == expected["penalty_counts"].tolist()
        assert decode.penalty_counts.dtype == np.int32
    assert decode.uniforms.tolist() == uniforms[6:].tolist()
    greedy = run_next(Decode(), 4)
    assert greedy.uniforms.size == 0 and not greedy.penalized
