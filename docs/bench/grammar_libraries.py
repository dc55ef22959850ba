"""Compares the grammar libraries on SmolLM2's 49152-token vocabulary: mask time per token along a JSON answer,
rollback, and which JSON-schema keywords compile (docs/structured-outputs.md holds a run's output).

Not a test (pytest does not collect it) and not part of fleettui: xgrammar imports torch, which fleettui never
does. Run it from the repo with the two other libraries beside the venv's packages:

    pip install --no-deps --target /tmp/gextra xgrammar outlines-core apache-tvm-ffi
    PYTHONPATH=/tmp/gextra .venv/bin/python docs/bench/grammar_libraries.py TOKENIZER.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from fleettui.bench.grammar_bench import BENCH_SCHEMA

EOS = 2
ANSWER = json.dumps(
    {
        "items": [
            {"name": f"box {i}", "count": 10 * i, "colour": "red", "note": "kept in the shed by the door"}
            for i in range(8)
        ]
    }
)
FEATURES: dict[str, dict[str, Any]] = {
    "nested objects, required": {"type": "object", "properties": {"a": {"type": "object", "properties":
                                 {"b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]},
    "array minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "enum, const": {"type": "object", "properties": {"e": {"enum": ["x", 1, None]}, "c": {"const": "k"}}},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "$ref / $defs (recursive)": {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                 "$ref": "#/$defs/n"},
    "string pattern": {"type": "string", "pattern": "^[A-Z][a-z]+-[0-9]{2}$"},
    "string format date-time": {"type": "string", "format": "date-time"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "number bounds": {"type": "number", "minimum": 0, "exclusiveMaximum": 10},
    "integer bounds": {"type": "integer", "minimum": 3, "maximum": 17},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
}  # fmt: skip


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def report(name: str, compile_s: float, per_token: list[float], rollback: str) -> None:
    ms = sorted(1000 * t for t in per_token)
    print(
        f"{name:<13} compile {compile_s * 1000:8.1f} ms | mask per token: median {statistics.median(ms):.3f} ms,"
        f" p90 {ms[int(0.9 * len(ms))]:.3f} ms, max {ms[-1]:.3f} ms | rollback: {rollback}"
    )


def llguidance_run(tokenizer_json: str, answer: list[int]) -> Callable[[dict[str, Any]], bool]:
    import llguidance

    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=EOS)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(BENCH_SCHEMA)
    matcher, seconds = timed(lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0))
    per_token = []
    for token in answer:
        _, spent = timed(matcher.compute_bitmask)
        per_token.append(spent)
        assert matcher.consume_token(token), matcher.get_error()
    matcher.rollback(5)
    again = matcher.consume_tokens(answer[-5:]) and matcher.is_accepting()
    report(
        "llguidance",
        seconds,
        per_token,
        "rollback(n) built in, re-consumed: " + ("ok" if again else "FAILED"),
    )

    def compiles(schema: dict[str, Any]) -> bool:
        failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
            llguidance.LLMatcher.grammar_from_json_schema(schema), tokenizer
        )
        return not failed

    return compiles


def xgrammar_run(vocabulary: list[bytes], answer: list[int]) -> Callable[[dict[str, Any]], bool]:
    import xgrammar

    info = xgrammar.TokenizerInfo(
        [b"" if i < 17 else token for i, token in enumerate(vocabulary)],  # specials: empty (never text)
        vocab_type=xgrammar.VocabType.RAW,
        vocab_size=len(vocabulary),
        stop_token_ids=[EOS],
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    compiled, seconds = timed(lambda: compiler.compile_json_schema(json.dumps(BENCH_SCHEMA)))
    matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=16)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    per_token = []
    for token in answer:
        _, spent = timed(lambda: matcher.fill_next_token_bitmask(bitmask))
        per_token.append(spent)
        assert matcher.accept_token(token)
    matcher.rollback(5)
    again = all(matcher.accept_token(token) for token in answer[-5:])
    report(
        "xgrammar",
        seconds,
        per_token,
        "rollback(n) up to max_rollback_tokens: " + ("ok" if again else "FAILED"),
    )

    def compiles(schema: dict[str, Any]) -> bool:
        try:
            compiler.compile_json_schema(json.dumps(schema))
        except Exception:  # noqa: BLE001 - a refusal is the answer
            return False
        return True

    return compiles


def outlines_run(vocabulary: list[bytes], answer: list[int]) -> Callable[[dict[str, Any]], bool]:
    import numpy as np
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tokens: dict[bytes, list[int]] = {}
    for index, token in enumerate(vocabulary):
        if index >= 17 and index != EOS:
            tokens.setdefault(token, []).append(index)
    vocab = Vocabulary(EOS, tokens)  # type: ignore[arg-type]
    regex = build_regex_from_schema(json.dumps(BENCH_SCHEMA))
    index, seconds = timed(lambda: Index(regex, vocab))
    guide = Guide(index, max_rollback=16)
    mask = np.zeros((len(vocabulary) + 31) // 32, np.int32)
    per_token = []
    for token in answer:
        _, spent = timed(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4))
        per_token.append(spent)
        guide.advance(token)
    guide.rollback_state(5)
    again = all(guide.advance(token) is not None for token in answer[-5:])
    report(
        "outlines-core",
        seconds,
        per_token,
        "rollback_state(n) up to max_rollback: " + ("ok" if again else "FAILED"),
    )

    def compiles(schema: dict[str, Any]) -> bool:
        try:
            build_regex_from_schema(json.dumps(schema))
        except Exception:  # noqa: BLE001 - a refusal is the answer
            return False
        return True

    return compiles


def main(path: str) -> None:
    import llguidance

    with open(path, encoding="utf-8") as handle:
        tokenizer_json = handle.read()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=EOS)
    vocabulary = [tokenizer.decode_bytes([i]) for i in range(49152)]
    answer = tokenizer.tokenize_str(ANSWER)
    print(
        f"vocabulary 49152, answer of {len(answer)} tokens (the bench's Inventory schema, flexible whitespace)"
    )
    checks = {}
    for name, run in (("llguidance", lambda: llguidance_run(tokenizer_json, answer)),
                      ("xgrammar", lambda: xgrammar_run(vocabulary, answer)),
                      ("outlines-core", lambda: outlines_run(vocabulary, answer))):  # fmt: skip
        try:
            checks[name] = run()
        except Exception as error:  # noqa: BLE001 - one library's failure is a line of the comparison
            print(f"{name:<13} failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
    print(f"\n{'JSON-schema feature':<30} " + " ".join(f"{name:>13}" for name in checks))
    for feature, schema in FEATURES.items():
        print(
            f"{feature:<30} "
            + " ".join(f"{'yes' if check(schema) else 'no':>13}" for check in checks.values())
        )


if __name__ == "__main__":
    main(sys.argv[1])
