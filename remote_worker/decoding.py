"""Provides the last stage's token choice: greedy and distribution-preserving speculative sampling
(pure numpy).

The rules implement `protocol.Decode`: position j of the scored logits judges draft token j, the
first rejected draft is replaced by a correction token and, when every draft is accepted, position K
yields a bonus token. Sampling uses the standard speculative rule (accept x with probability min(1,
p(x)/q(x)), on rejection sample from normalize(max(0, p - q))), so the emitted tokens follow the
target distribution p exactly whatever the draft proposed. All randomness comes from the uniforms
the coordinator sends, so a seed reproduces a run.

A draft that sent no distribution (support 0: a greedy draft or prompt lookup) proposed
deterministically, so its q is a point mass on the drafted token."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from remote_worker.protocol import Decode, Step

# top-p looks at this many most probable ids first, then falls back to a full sort
_CANDIDATES = 1024


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - float(np.max(logits))
    weights = np.exp(shifted)
    probs: np.ndarray = weights / weights.sum()
    return probs


def target_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> np.ndarray:
    """Probabilities (float64 [V]) after temperature, top-k and top-p filtering; zero outside the
    kept set."""
    if temperature <= 0.0:
        raise ValueError("target_distribution needs temperature > 0 (greedy uses argmax)")
    vocab = logits.shape[-1]
    probs = _softmax(np.asarray(logits, np.float64) / temperature)
    if 0 < top_k < vocab:
        keep = np.argpartition(-probs, top_k - 1)[:top_k]
        filtered = np.zeros_like(probs)
        filtered[keep] = probs[keep]
        probs = filtered / filtered.sum()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return probs


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest most-probable prefix whose mass reaches top_p (the token crossing it
    included)."""
    vocab = probs.shape[0]
    order = None
    if vocab > _CANDIDATES:
        candidates = np.argpartition(-probs, _CANDIDATES - 1)[:_CANDIDATES]
        candidates = candidates[np.argsort(-probs[candidates], kind="stable")]
        if probs[candidates].sum() >= top_p:  # the kept prefix lies inside the candidates
            order = candidates
    if order is None:
        order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    before = np.cumsum(sorted_probs) - sorted_probs  # mass strictly before each token
    kept = order[before < top_p]
    filtered = np.zeros_like(probs)
    filtered[kept] = probs[kept]
    normalised: np.ndarray = filtered / filtered.sum()
    return normalised


def sample(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """The id whose cumulative-probability interval contains u (inverse CDF; zero-probability ids
    never win)."""
    cumulative = np.cumsum(np.asarray(probs, np.float64))
    total = cumulative[-1]
    if not total > 0.0:
        raise ValueError("sample: the distribution has no mass")
    index = int(np.searchsorted(cumulative, u * total, side="right"))
    index = min(index, len(cumulative) - 1)
    while (
        probs[index] <= 0.0 and index > 0
    ):  # rounding at the very top edge: step back to a real id
        index -= 1
    return int(ids[index])


def propose_distribution(
    logits: np.ndarray, decode: Decode, support: int
) -> tuple[np.ndarray, np.ndarray]:
    """The draft's proposal: the `support` most probable ids of the filtered distribution,
    renormalised.

    Always returns exactly min(support, V) ids (trailing ones may have probability 0), int64 and
    float32."""
    if support <= 0:
        raise ValueError("propose_distribution: support must be positive when sampling")
    probs = target_distribution(logits, decode.temperature, decode.top_k, decode.top_p)
    count = min(support, probs.shape[0])
    ids = np.argpartition(-probs, count - 1)[:count]
    ids = ids[np.argsort(-probs[ids], kind="stable")]
    kept = probs[ids]
    return ids.astype(np.int64), (kept / kept.sum()).astype(np.float32)


def penalize(logits: np.ndarray, decode: Decode) -> np.ndarray:
    """The scored rows with the penalties applied (a float32 copy; the input itself when there are
    none).

    Row j sees the context counts of `decode` plus draft tokens 0..j-1, as if they had been emitted:
    the same logits plain decoding would have penalized at that position, so speculation stays
    exact. Order as in vLLM: repetition (HF/CTRL: positive / r, negative x r over prompt + reply),
    then frequency x count and presence (OpenAI, over the reply)."""
    if not decode.penalized:
        return logits
    vocab = logits.shape[1]
    ids = np.asarray(decode.penalty_ids, np.int64)
    drafts = np.asarray(decode.draft_tokens, np.int64)
    if (ids.size and int(ids.max()) >= vocab) or (drafts.size and int(drafts.max()) >= vocab):
        raise ValueError(f"penalties: token ids outside the vocabulary of {vocab}")
    counts = np.zeros(vocab, np.float32)
    counts[ids] = np.asarray(decode.penalty_counts, np.float32)
    seen = np.zeros(vocab, bool)
    seen[ids] = True
    penalized = np.array(logits, np.float32, copy=True)
    repetition = float(decode.repetition_penalty)
    for row in range(logits.shape[0]):
        if row:  # the previous draft token counts for every later position
            token = int(drafts[row - 1])
            counts[token] += 1.0
            seen[token] = True
        values = penalized[row]
        if repetition != 1.0:
            context = np.flatnonzero(seen)
            picked = values[context]
            values[context] = np.where(picked > 0, picked / repetition, picked * repetition)
        if decode.frequency_penalty or decode.presence_penalty:
            reply = np.flatnonzero(counts)
            values[reply] -= counts[reply] * decode.frequency_penalty + decode.presence_penalty
    return penalized


def apply_mask(logits: np.ndarray, decode: Decode) -> np.ndarray:
    """The scored rows with every token the grammar's mask disallows at -inf (the input itself
    without a mask). Ids past the mask's width are disallowed; a row that allows no id of this
    vocabulary is an error."""
    if not decode.constrained:
        return logits
    rows, vocab = logits.shape
    if decode.token_mask.shape[0] != rows:
        raise ValueError(
            f"token mask: {decode.token_mask.shape[0]} rows for {rows} scored positions"
        )
    bits = np.unpackbits(decode.token_mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = np.zeros((rows, vocab), bool)
    allowed[:, : bits.shape[1]] = bits.astype(bool)
    empty = np.flatnonzero(~allowed.any(axis=1))
    if len(empty):
        raise ValueError(
            f"token mask row {int(empty[0])} allows no token of the vocabulary of {vocab}"
        )
    masked: np.ndarray = np.where(allowed, np.asarray(logits, np.float32), np.float32(-np.inf))
    return masked


def run_step(decode: Decode) -> Decode:
    """The Decode of a run's current token: its own two uniforms of the run's 2 per token
    (greedy: none)."""
    return decode if len(decode.uniforms) <= 2 else replace(decode, uniforms=decode.uniforms[:2])


def run_next(decode: Decode, token: int) -> Decode:
    """The Decode of a run's next token once `token` was emitted: the uniforms after this token's
    two, and `token` counted in the penalties' context and reply, as the coordinator would have sent
    them."""
    if not decode.penalized:
        return replace(decode, uniforms=decode.uniforms[2:]) if len(decode.uniforms) else decode
    uniforms = decode.uniforms[2:] if len(decode.uniforms) else decode.uniforms
    ids, counts = decode.penalty_ids, decode.penalty_counts
    index = int(np.searchsorted(ids, token))
    if index < len(ids) and int(ids[index]) == token:
        counts = counts.copy()
        counts[index] += 1
    else:
        ids = np.insert(ids, index, token)
        counts = np.insert(counts, index, 1).astype(np.int32)
    return replace(decode, uniforms=uniforms, penalty_ids=ids, penalty_counts=counts)


def next_run_step(step: Step, token: int, looped: bool = False) -> Step:
    """A run's next step: `token` fed right after `step`, no masks, one token fewer to go (`looped`:
    sent back to stage 0 by the last stage of several)."""
    assert step.decode is not None  # the protocol refuses a run without a decode
    return Step(
        step.session,
        step.seq,
        step.pos0 + step.n,
        step.cache_len + step.n,
        np.zeros((0, 2), np.int64),
        tokens=np.array([token], np.int64),
        decode=run_next(step.decode, token),
        run=step.run - 1,
        looped=looped,
    )


def _uniforms(decode: Decode, count: int) -> np.ndarray:
    if len(decode.uniforms) >= count:
        return np.asarray(decode.uniforms, np.float64)
    # The coordinator normally sends them; without any, draw fresh ones (not reproducible).
    return np.random.default_rng().random(count)


def _top(logits: np.ndarray, tokens: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, log-probs) per row of the untempered distribution: the row's emitted token first, then
    the `count - 1` most probable tokens."""
    rows = logits.shape[0]
    ids = np.empty((rows, count), np.int64)
    logprobs = np.empty((rows, count), np.float32)
    for row in range(rows):
        values = logits[row].astype(np.float64)
        peak = values.max()
        log_total = peak + np.log(np.exp(values - peak).sum())
        ids[row, 0] = tokens[row]
        if count > 1:
            top = np.argpartition(-values, count - 2)[: count - 1]
            ids[row, 1:] = top[np.argsort(-values[top], kind="stable")]
        logprobs[row] = values[ids[row]] - log_total
    return ids, logprobs


def _draft_q(decode: Decode, j: int, vocab: int) -> np.ndarray:
    """The draft's proposal distribution for draft j as a dense float64 [V] vector."""
    q = np.zeros(vocab, np.float64)
    support = decode.draft_ids.shape[1] if decode.draft_ids.ndim == 2 else 0
    if support == 0:
        q[int(decode.draft_tokens[j])] = 1.0  # deterministic draft: a point mass
        return q
    ids = decode.draft_ids[j]
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"draft {j}: proposal ids outside the vocabulary of {vocab}")
    np.add.at(q, ids, np.asarray(decode.draft_probs[j], np.float64))
    total = q.sum()
    if total > 0.0:
        q /= total
    return q


_NO_TOP_IDS, _NO_TOP_LOGPROBS = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)


def score(logits: np.ndarray, decode: Decode) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Judge the drafts against `logits` ([K+1, V], one row per scored position), penalties and the
    token mask applied first.

    Returns (tokens int64 [a+1], accepted a, top_ids, top_logprobs); the top arrays have one row per
    emitted token ([a+1, top_logprobs]) or shape (0, 0) when none were asked for."""
    drafts = np.asarray(decode.draft_tokens, np.int64)
    k = len(drafts)
    plain = not decode.penalized and not decode.constrained and decode.top_logprobs <= 0
    if k == 0 and decode.greedy and plain and logits.ndim == 2:
        if logits.shape[0] != 1:
            raise ValueError(f"score: logits {logits.shape} do not hold 1 position")
        # a run's step
        return (
            np.array([int(np.argmax(logits[0]))], np.int64),
            0,
            _NO_TOP_IDS,
            _NO_TOP_LOGPROBS,
        )
    if logits.ndim != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"score: logits {logits.shape} do not hold {k + 1} positions")
    vocab = logits.shape[1]
    if k and (int(drafts.min()) < 0 or int(drafts.max()) >= vocab):
        raise ValueError(f"score: draft tokens outside the vocabulary of {vocab}")
    raw, logits = logits, apply_mask(penalize(logits, decode), decode)
    if decode.greedy:
        best = np.argmax(logits, axis=1)
        mismatches = np.flatnonzero(best[:k] != drafts)
        accepted = int(mismatches[0]) if len(mismatches) else k
        tokens = np.concatenate([drafts[:accepted], best[accepted : accepted + 1]]).astype(np.int64)
    else:
        tokens, accepted = _speculative_sample(logits, decode, drafts)
    if decode.top_logprobs > 0:
        top_ids, top_logprobs = _top(
            raw[: accepted + 1], tokens, min(decode.top_logprobs, vocab + 1)
        )
    else:
        top_ids, top_logprobs = np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32)
    return tokens, accepted, top_ids, top_logprobs


def _speculative_sample(
    logits: np.ndarray, decode: Decode, drafts: np.ndarray
) -> tuple[np.ndarray, int]:
    k = len(drafts)
    vocab = logits.shape[1]
    uniforms = _uniforms(decode, 2 * (k + 1))
    every_id = np.arange(vocab)
    for j in range(k):
        p = target_distribution(logits[j], decode.temperature, decode.top_k, decode.top_p)
        q = _draft_q(decode, j, vocab)
        token = int(drafts[j])
        # q(x) == 0 cannot happen for an honest draft (x was drawn from q); reject such a draft.
        if q[token] > 0.0 and uniforms[j] < min(1.0, p[token] / q[token]):
            continue
        residual = np.maximum(p - q, 0.0)
        if (
            not residual.sum() > 0.0
        ):  # p == q (up to rounding): the residual is undefined, p is exact
            residual = p
        correction = sample(every_id, residual, float(uniforms[k + 1 + j]))
        return np.concatenate([drafts[:j], [correction]]).astype(np.int64), j
    p = target_distribution(logits[k], decode.temperature, decode.top_k, decode.top_p)
    bonus = sample(every_id, p, float(uniforms[2 * k + 1]))
    return np.concatenate([drafts, [bonus]]).astype(np.int64), k
