"""Batched steps on a real shard: sessions sharing inferences answer exactly as each alone (f32)."""

from __future__ import annotations

import numpy as np
import pytest

from remote_worker.engine import StageEngine, StepRequest

NO_RANGES = np.zeros((0, 2), np.int64)
QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "Tell me a joke about cats.",
)


def _greedy(batch: int, steps: int = 16) -> tuple[dict[int, list[int]], int]:
    """Greedy tokens of four sessions decoded together (`batch` rows at most): session 3 joins at
    step 4, session 1 verifies a 3-token block every fourth step and rolls two of them back by its
    mask, session 2 compacts its cache midway. Returns the tokens and the largest batch the engine
    formed."""
    from tests.support.shards import chat_ids, compiled

    shard = compiled(1, "fp32")
    engine = StageEngine(
        shard, 0, inference_precision="f32", kv_cache_precision="f32", max_batch=batch
    )
    tokens: dict[int, list[int]] = {}
    positions: dict[int, int] = {}
    masked: dict[int, np.ndarray] = {}
    for session, question in enumerate(QUESTIONS):
        prompt = np.asarray(chat_ids(shard, question), np.int64)
        engine.open(session)
        logits = engine.step(session, 0, 0, NO_RANGES, prompt, keep_last=1)
        tokens[session], positions[session] = [int(np.argmax(logits[-1]))], len(prompt)
        masked[session] = NO_RANGES
    widest = 1
    for step in range(steps):
        requests = []
        for session in tokens:
            if session == 3 and step < 4:
                continue
            if session == 2 and step == 8:
                engine.compact(2, engine.cache_len(2))
            feed = [tokens[session][-1]]
            if session == 1 and step % 4 == 0:
                feed += [17, 23]  # a draft the model rejects: its two slots are masked next step
            requests.append(
                StepRequest(
                    session,
                    positions[session],
                    engine.cache_len(session),
                    masked[session],
                    np.asarray(feed, np.int64),
                    keep_last=len(feed),
                )
            )
        outputs = engine.step_many(requests)
        widest = max(widest, *(engine.batch_rows(r.session) for r in requests))
        for request, output in zip(requests, outputs, strict=True):
            assert isinstance(output, np.ndarray), output
            session, n = request.session, len(request.data)
            cache = engine.cache_len(session)
            # the first row scores the real token; a draft's rejected slots are masked by the next
            # step
            masked[session] = np.asarray([[cache - n + 1, cache]]) if n > 1 else NO_RANGES
            positions[session] += 1
            tokens[session].append(int(np.argmax(output[0])))
    return tokens, widest


@pytest.mark.slow
def test_batched_sessions_answer_as_each_alone_with_joins_rollbacks_and_compaction() -> None:
    alone, widest_alone = _greedy(batch=1)
    together, widest = _greedy(batch=4)
    assert widest_alone == 1 and widest >= 3  # the batched run did share inferences
    assert together == alone
