"""Provides grammar-constrained decoding on the coordinator: constraint specs, their check against
the model's tokenizer, and each reply's grammar matcher (llguidance), which turns a draft path into
per-position token masks.

How a constrained reply runs (`GenerationParams.constraint`):
- The coordinator owns one `ReplyGrammar` per constrained reply. Before each verify step it advances
  the matcher over the draft, cuts the draft at the first token the grammar rejects, computes the
  bitmask of every scored position and rolls the matcher back (`ReplyGrammar.plan`). The masks
  travel with the step (`protocol.Decode.token_mask`) and the last stage applies them before greedy
  choice, sampling and the acceptance test. After the step the matcher consumes exactly the emitted
  tokens (`ReplyGrammar.advance`): the accepted drafts and the correction or bonus token.
- Runs and rounds started ahead are off for constrained replies, so every token the pipeline emits
  was scored under a mask the coordinator computed from the reply's true state.
- The reply ends when the matcher is stopped (nothing can follow: finish reason "stop", or "eos"
  when the model chose EOS where the grammar allowed it).
- The result says whether the grammar was completed: `GenerationStats.constraint_complete` is True
  when the constrained text is a full sentence of the grammar, False when the reply ended before
  (max_tokens: finish reason "length"; a stop string), None when no constrained text was generated
  (no constraint, or a trigger that never came). A caller must never present an answer with
  `constraint_complete` False as valid.

Triggers (`ConstraintSpec.trigger`): the reply is free text until its text contains the trigger.
Tokens do not respect the trigger's end: the token that completes it may carry more text. The rule:
the reply is cut right after the trigger. The tokens emitted after the completing token in that
round are dropped (as rejected drafts are: masked in the KV cache), and when the completing token's
text runs past the trigger it is replaced by the tokens of its text up to the trigger's end. The
text after the trigger is then the grammar's alone, so it parses."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ConstraintError",
    "ConstraintSpec",
    "ReplyGrammar",
    "check_constraint",
    "grammar_tokenizer",
    "json_object_grammar",
    "json_schema_grammar",
]


@dataclass(frozen=True)
class ConstraintSpec:
    grammar: str  # an llguidance grammar (Lark syntax, may embed %json{...})
    label: (
        str  # short human label for logs and the TUI, e.g. "json_schema Person", "tools required"
    )
    # None: the whole reply is constrained. Else the reply is free text until the model generates
    # this string; from there the grammar constrains the rest of the reply (the module docstring has
    # the rule).
    trigger: str | None = None


class ConstraintError(ValueError):
    """A constraint that cannot be used: one line naming the offending JSON-schema keyword or
    grammar problem."""


class InvalidSchema(ConstraintError):
    """A JSON schema that its own meta-schema refuses; `where` is the path to the fault ('' at the
    top level)."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.message, self.where = message, where


def check_json_schema(schema: Mapping[str, Any]) -> None:
    """Raises InvalidSchema unless SCHEMA is a JSON schema by the meta-schema of its draft (by
    2020-12's when it names none)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator).check_schema(
            schema
        )
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        raise InvalidSchema(error.message, where) from None


def json_object_grammar() -> str:
    """The grammar of any JSON object."""
    return json_schema_grammar({"type": "object"})


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The grammar of the JSON values `schema` accepts (llguidance's own JSON-schema support,
    `%json`).

    The JSON is compact (no whitespace between tokens) unless the schema's own `x-guidance` options
    say otherwise: the fewest tokens, no run of blank lines a small model can fall into, and the
    structure's keys and punctuation forced by the grammar, which the coordinator verifies as free
    drafts (`ReplyGrammar.forced`). Only the schema's shape is checked here (a JSON object);
    `check_constraint` compiles it."""
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    try:
        text = json.dumps(schema, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ConstraintError(f"the JSON schema is not JSON: {error}") from None
    return f"start: %json{text}\n"


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def _one_line(message: str) -> str:
    """llguidance's error as one line: no source excerpt, no caret lines, no `at line(col):`
    prefix."""
    message = message.split("\n   1 |", 1)[0]
    lines = [line.strip() for line in message.splitlines() if line.strip().strip("^")]
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines))
    unimplemented = _UNIMPLEMENTED.search(text)
    if unimplemented:
        keys = ", ".join(key.strip().strip('"') for key in unimplemented.group(1).split(","))
        return f"unsupported JSON-schema keyword {keys}"
    return text.removeprefix("failed to compile JSON schema: ") or "invalid grammar"


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(source: Any) -> Any:
    """The `llguidance.LLTokenizer` of a model's tokenizer (built once per source: about 0.4 s).

    `source` is a `ChatFormat` (its `tokenizer` and EOS ids are used), a `tokenizers.Tokenizer`, or
    an `LLTokenizer` (returned as it is)."""
    import llguidance

    if isinstance(source, llguidance.LLTokenizer):
        return source
    tokenizer = getattr(source, "tokenizer", source)
    eos = sorted(getattr(source, "eos_token_ids", ()))
    if not hasattr(tokenizer, "to_str"):
        raise ConstraintError(
            f"cannot constrain with a tokenizer of type {type(tokenizer).__name__}"
        )
    return llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos or None)


def check_constraint(spec: ConstraintSpec, tokenizer: Any) -> None:
    """Compile `spec` once against the model's tokenizer (see `grammar_tokenizer`); raises
    ConstraintError naming the unsupported keyword or the grammar's problem. With `tokenizer` None
    the grammar and its JSON schemas are checked alone (before a model is at hand, e.g. before any
    worker starts)."""
    import llguidance

    if spec.trigger is not None and not spec.trigger:
        raise ConstraintError("a constraint's trigger must not be empty")
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        spec.grammar, None if tokenizer is None else grammar_tokenizer(tokenizer)
    )
    if failed:
        raise ConstraintError(_one_line(messages[0] if messages else ""))


class ReplyGrammar:
    """One reply's grammar state: its matcher once the constraint applies, the trigger watch
    before."""

    def __init__(self, spec: ConstraintSpec, tokenizer: Any) -> None:
        self.spec = spec
        self.tokenizer = grammar_tokenizer(tokenizer)
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self.eos = frozenset(int(token) for token in self.tokenizer.eos_tokens)
        self.matcher: Any = None
        self._trigger = spec.trigger.encode() if spec.trigger else b""
        self._seen = b""  # the reply's last bytes while the trigger is awaited
        # draft tokens cut because the grammar rejects them (or one before them)
        self.drafts_cut = 0
        if spec.trigger is None:
            self._start()

    def _start(self) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(self.tokenizer, self.spec.grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(_one_line(self.matcher.get_error()))

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token (False while a trigger is awaited)."""
        return self.matcher is not None

    @property
    def stopped(self) -> bool:
        """Whether the grammar is finished and nothing may follow."""
        return self.matcher is not None and bool(self.matcher.is_stopped())

    @property
    def complete(self) -> bool | None:
        """True when the constrained text is complete, False when not, None when there is none
        yet."""
        return None if self.matcher is None else bool(self.matcher.is_accepting())

    def _mask(self) -> np.ndarray:
        mask = np.frombuffer(self.matcher.compute_bitmask(), np.uint32)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar {self.spec.label}: {_one_line(self.matcher.get_error())}")
        return mask

    def allows(self, mask: np.ndarray, token: int) -> bool:
        return 0 <= token < 32 * len(mask) and bool((int(mask[token >> 5]) >> (token & 31)) & 1)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` next tokens the grammar forces (the only ones it allows, in a row): drafts
        that the masked verify always accepts, so they cost no speculation (empty while the
        constraint does not apply)."""
        if self.matcher is None or limit <= 0:
            return []
        tokens = [int(token) for token in self.matcher.compute_ff_tokens()[:limit]]
        if self.matcher.is_error():
            raise RuntimeError(f"grammar {self.spec.label}: {_one_line(self.matcher.get_error())}")
        return tokens

    def plan(self, drafts: tuple[int, ...]) -> tuple[int, np.ndarray | None]:
        """How many of `drafts` the grammar allows in a row, and the masks of the scored positions
        (uint32 [kept + 1, words]); (len(drafts), None) while the constraint does not apply. The
        matcher is left as it was. A draft ends before an EOS: the verify chooses EOS itself where
        the grammar allows it (and a matcher that consumed EOS does not count it when rolled
        back)."""
        if self.matcher is None:
            return len(drafts), None
        masks = np.empty((len(drafts) + 1, self.words), np.uint32)
        kept = 0
        try:
            for index in range(len(drafts) + 1):
                masks[index] = self._mask()
                if (
                    index == len(drafts)
                    or drafts[index] in self.eos
                    or not self.allows(masks[index], drafts[index])
                ):
                    break
                if not self.matcher.consume_token(int(drafts[index])):
                    raise RuntimeError(f"grammar {self.spec.label}: {self.matcher.get_error()}")
                kept += 1
        finally:
            if kept:
                self.matcher.rollback(kept)
        self.drafts_cut += len(drafts) - kept
        return kept, masks[: kept + 1]

    def advance(self, tokens: list[int]) -> list[int]:
        """Consume a round's emitted tokens; returns the tokens the reply keeps (the same ones, but
        where a trigger is completed: the reply cut after the trigger, see the module docstring)."""
        if self.matcher is not None:
            for token in tokens:
                if not self.matcher.consume_token(int(token)):
                    raise RuntimeError(
                        f"grammar {self.spec.label} rejected token {token}: "
                        f"{self.matcher.get_error()}"
                    )
            return tokens
        for index, token in enumerate(tokens):
            piece = self.tokenizer.decode_bytes([int(token)])
            seen = self._seen + piece
            found = seen.find(self._trigger)
            if found < 0:
                self._seen = seen[-(len(self._trigger) - 1) :] if len(self._trigger) > 1 else b""
                continue
            beyond = len(seen) - (found + len(self._trigger))
            ending = (
                [int(token)]
                if not beyond
                else self.tokenizer.tokenize_bytes(piece[: len(piece) - beyond])
            )
            self._start()
            return [*tokens[:index], *ending]
        return tokens
