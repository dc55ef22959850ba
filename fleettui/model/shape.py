"""Provides the shape of a decoder (what the planner needs: dense or mixture-of-experts,
local/global) and builtins."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fleettui.errors import PlanError
from remote_worker.config import WEIGHT_PRECISIONS

GIB = 1 << 30
PRECISION_ORDER = WEIGHT_PRECISIONS  # widest first (the contract's vocabulary)
# auto: f16 (upper bound of CPU u8)
KV_BYTES = {
    "auto": 2.0,
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "u8": 1.0,
}


class LayeredHost(Protocol):
    """A host with an optional manual layer range (the fleet's `Host`)."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> tuple[float, float] | None: ...


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a Llama-style decoder."""

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    # local layers attend to this many positions (their KV cache still keeps all)
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()  # the sliding-window layers (Gemma 3: five of every six)
    experts: int = 0  # mixture of experts: routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    expert_intermediate: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelShape:
        """From a Hugging Face ``config.json`` dictionary (Llama, Mistral, Qwen2, SmolLM)."""
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        missing = [
            key
            for key in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "vocab_size",
            )
            if not isinstance(config.get(key), int)
        ]
        if missing:
            raise PlanError(
                f"model config lacks {', '.join(missing)}: not a Llama-style decoder config"
            )
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        architectures = config.get("architectures") or [config.get("model_type", "model")]
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        return cls(
            name=name or str(config.get("_name_or_path") or architectures[0]),
            num_layers=config["num_hidden_layers"],
            hidden=hidden,
            intermediate=config["intermediate_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(config.get("sliding_window") or 0) if _local_layers(config) else 0,
            local_layers=_local_layers(config),
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate=int(
                config.get("moe_intermediate_size") or config["intermediate_size"]
            )
            if experts
            else 0,
        )

    @classmethod
    def from_config_file(cls, path: Path) -> ModelShape:
        try:
            config = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise PlanError(f"{path}: cannot read model config: {error}") from None
        if not isinstance(config, dict):
            raise PlanError(f"{path}: model config is not a JSON object")
        return cls.from_config(
            config, name=Path(path).parent.name if Path(path).name == "config.json" else None
        )

    @property
    def group_size(self) -> int:
        """INT4 group size: 128 where every input width divides by it, else 64 or 32 (as the
        compiler does)."""
        widths = (self.hidden, self.intermediate, self.heads * self.head_dim)
        return next((group for group in (128, 64, 32) if all(w % group == 0 for w in widths)), 0)

    def matrix_bytes(self, rows: int, columns: int, precision: str) -> float:
        """Bytes of one weight matrix [rows, columns] (columns = input width) with its scales."""
        count = rows * columns
        if precision == "fp32":
            return 4.0 * count
        if precision == "fp16":
            return 2.0 * count
        if precision == "int8":
            return count + 3.0 * rows  # u8 weights + f16 scale + u8 zero point per output channel
        if precision == "int4":
            group = self.group_size
            # + f16 scale per group
            return count / 2 + (2.0 * count / group if group else 2.0 * rows)
        raise PlanError(
            f"unknown precision {precision!r}: expected one of {', '.join(PRECISION_ORDER)}"
        )

    def attention_bytes(self, precision: str) -> float:
        """Weights of one decoder layer's attention half (q, k, v, o and its norm)."""
        attention = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return (
            self.matrix_bytes(attention, self.hidden, precision)
            + 2 * self.matrix_bytes(kv, self.hidden, precision)
            + self.matrix_bytes(self.hidden, attention, precision)
            + 4.0 * self.hidden
        )

    def layer_bytes(self, precision: str) -> float:
        """Weights of one decoder layer (attention, MLP with every expert, f32 norms): what its
        stage holds."""
        return self.attention_bytes(precision) + self.mlp_bytes(precision)

    def active_layer_bytes(self, precision: str) -> float:
        """Weights one token reads in one layer (a MoE layer: the router and its top-k experts
        only)."""
        return self.attention_bytes(precision) + self.mlp_bytes(precision, active=True)

    def _gated_mlp(self, width: int, precision: str) -> float:
        return 2 * self.matrix_bytes(width, self.hidden, precision) + self.matrix_bytes(
            self.hidden, width, precision
        )

    def mlp_bytes(self, precision: str, active: bool = False) -> float:
        """Weights of one decoder layer's MLP half (gate, up, down and its norm; a MoE layer:
        router + experts)."""
        if not self.experts:
            return self._gated_mlp(self.intermediate, precision) + 4.0 * self.hidden
        count = self.experts_per_token if active else self.experts
        router = 4.0 * self.experts * self.hidden  # kept f32: routing decides which experts run
        return (
            count * self._gated_mlp(self.expert_intermediate, precision)
            + router
            + 4.0 * self.hidden
        )

    def mlp_share(self, precision: str) -> float:
        """The MLP's part of a layer's weights: what a cut between attention and MLP moves."""
        return self.mlp_bytes(precision) / self.layer_bytes(precision)

    def embedding_bytes(self, precision: str) -> float:
        """The token embedding (kept int8 when the layers are int4, as NNCF's backup precision
        does)."""
        return self.matrix_bytes(
            self.vocab, self.hidden, "int8" if precision == "int4" else precision
        )

    def head_bytes(self, precision: str) -> float:
        """Final norm + lm_head (a separate copy of a tied embedding unless the stage also holds
        it)."""
        return self.embedding_bytes(precision) + 4.0 * self.hidden

    def kv_bytes_per_token(self, kv_cache_precision: str = "auto") -> float:
        """K and V of one layer for one token."""
        if kv_cache_precision not in KV_BYTES:
            raise PlanError(f"unknown KV-cache precision {kv_cache_precision!r}")
        return 2.0 * self.kv_heads * self.head_dim * KV_BYTES[kv_cache_precision]

    def parameter_count(self, active: bool = False) -> int:
        """Every parameter (ACTIVE: those one token uses, a MoE layer's top-k experts only)."""
        attention = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        if self.experts:
            count = self.experts_per_token if active else self.experts
            mlp = count * 3 * self.hidden * self.expert_intermediate + self.experts * self.hidden
        else:
            mlp = 3 * self.hidden * self.intermediate
        layer = 2 * attention * self.hidden + 2 * kv * self.hidden + mlp
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + embeddings

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers that attend to the whole context (all of them unless some are local)."""
        return tuple(layer for layer in range(self.num_layers) if layer not in self.local_layers)


def _local_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The sliding-window layers of a config: `layer_types`, else Gemma 3's
    `sliding_window_pattern`."""
    if not config.get("sliding_window") or config.get("use_sliding_window") is False:
        return ()
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    return ()  # a window on every layer (Mistral): the compiler ignores it, so the plan does too


def _gemma3_local(layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if (i + 1) % 6)


BUILTIN_SHAPES: dict[str, ModelShape] = {
    "smollm2-135m-instruct": ModelShape(
        "smollm2-135m-instruct", 30, 576, 1536, 9, 3, 64, 49152, True
    ),
    "gemma-3-270m": ModelShape(
        "gemma-3-270m", 18, 640, 2048, 4, 1, 256, 262144, True, 512, _gemma3_local(18)
    ),
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 16, 2048, 8192, 32, 8, 64, 128256, True),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128, 128256, False),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 80, 8192, 28672, 64, 8, 128, 128256, False),
}

# Architectures `synthetic:NAME[@LAYERS]` can take (seeded random weights; shard_compiler.synthetic
# has the full configs, a test keeps the two in step): the real shapes plus a toy for tests.
SYNTHETIC_SHAPES: dict[str, ModelShape] = {
    "llama-3.2-1b": BUILTIN_SHAPES["llama-3.2-1b"],
    "llama-3.1-8b": BUILTIN_SHAPES["llama-3.1-8b"],
    "llama-tiny": ModelShape("llama-tiny", 4, 256, 768, 8, 2, 32, 4096, False),
}
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_REFUSAL = (
    "{model} is synthetic (seeded random weights, no tokenizer): it is for benchmarks, not chat"
)


def synthetic_shape(model: str) -> ModelShape:
    """The shape of `synthetic:NAME[@LAYERS]` (LAYERS keeps the first N layers); PlanError if
    unknown."""
    import re

    match = re.fullmatch(re.escape(SYNTHETIC_PREFIX) + r"([\w.-]+?)(?:@(\d+))?", model)
    if not match or match.group(1) not in SYNTHETIC_SHAPES:
        known = ", ".join(SYNTHETIC_SHAPES)
        raise PlanError(
            f"model {model!r}: expected synthetic:NAME or synthetic:NAME@LAYERS with NAME in "
            f"{known}"
        )
    base = SYNTHETIC_SHAPES[match.group(1)]
    layers = int(match.group(2)) if match.group(2) else base.num_layers
    if not 1 <= layers <= base.num_layers:
        raise PlanError(f"model {model!r}: layer count {layers} outside 1..{base.num_layers}")
    from dataclasses import replace

    return replace(base, name=model, num_layers=layers)


def layer_range_problem(layers: list[Any], shown: str) -> str | None:
    """Why a fleet file's `layers = [start, end]` is not a range (N.5 cuts layer N after its
    attention)."""
    if len(layers) != 2 or not all(
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and float(v) * 2 == int(float(v) * 2)
        for v in layers
    ):
        return (
            "expected [start, end] (two layer numbers; N.5 cuts layer N between its attention and "
            "its MLP), "
            f"got {shown}"
        )
    if not 0 <= layers[0] < layers[1]:
        return f"{shown} is empty or negative: need 0 <= start < end"
    if math.ceil(layers[0]) == math.ceil(layers[1]):
        return f"{shown} holds no layer's attention (and so no KV cache)"
    return None


def check_manual_layers(shape: ModelShape, hosts: Sequence[LayeredHost]) -> None:
    """A manual split must be given on every host, contiguous from 0 and end at num_layers."""
    expected: float = 0
    for host in hosts:
        if host.layers is None:
            raise PlanError("set layers on all hosts or on none", host=host.name, key="layers")
        start, end = host.layers
        if start != expected or end <= start:
            raise PlanError(
                f"[{start}, {end}) does not continue at layer {expected}: "
                "ranges must be contiguous",
                host=host.name,
                key="layers",
            )
        expected = end
    if expected != shape.num_layers:
        raise PlanError(
            f"the split ends at layer {expected} but {shape.name} has {shape.num_layers} layers: "
            f"the last range must end at {shape.num_layers}",
            host=hosts[-1].name if hosts else None,
            key="layers",
        )
