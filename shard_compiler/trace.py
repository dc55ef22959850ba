"""Provides the per-stage torch module (Llama-family decoder layers) and its conversion to an
OpenVINO model."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from remote_worker.manifest import LayerRange

from .experts import ClampedExperts, SparseExperts, activation
from .sources import CompileError, ModelConfig, WeightReader

logger = logging.getLogger(__name__)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp64 math, with linear or llama3 scaling
    applied."""
    dim = config.head_dim
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inverse.to(torch.float32)
    if scaling["rope_type"] == "linear":
        return (inverse / float(scaling["factor"])).to(torch.float32)
    if scaling["rope_type"] == "llama3":
        factor = float(scaling["factor"])
        low_factor = float(scaling["low_freq_factor"])
        high_factor = float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        low_wavelength = original / low_factor
        high_wavelength = original / high_factor
        wavelength = 2 * math.pi / inverse
        scaled = torch.where(wavelength > low_wavelength, inverse / factor, inverse)
        smooth = (original / wavelength - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return torch.where(medium, smoothed, scaled).to(torch.float32)
    raise CompileError(f"rope_scaling: unsupported type {scaling['rope_type']!r}")


class RMSNorm(nn.Module):
    """RMSNorm scaling by (offset + weight): offset 0 for Llama-style weights, 1 for Gemma's."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        if self.offset:
            return (hidden * torch.rsqrt(variance + self.eps)) * (self.offset + self.weight)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


class Weights:
    """The tensors of one model by its Hugging Face names, with the family's fused projections
    split."""

    def __init__(self, config: ModelConfig, reader: WeightReader) -> None:
        self.config = config
        self.reader = reader
        self.prefix = "model"
        for prefix in (
            "model.language_model",
            "language_model.model",
        ):  # Gemma 3 multimodal checkpoints
            if f"{prefix}.embed_tokens.weight" in reader or f"{prefix}.norm.weight" in reader:
                self.prefix = prefix

    def __contains__(self, key: str) -> bool:
        return key in self.reader

    def get(self, key: str) -> torch.Tensor:
        return self.reader.get(key)

    def layer(self, index: int) -> str:
        return f"{self.prefix}.layers.{index}"

    def norm(self, key: str, eps: float | None = None) -> RMSNorm:
        config = self.config
        return RMSNorm(
            self.get(key), config.rms_norm_eps if eps is None else eps, config.family.norm_offset
        )

    def linear(self, prefix: str) -> nn.Linear:
        return _linear(self.reader, prefix)

    def split(self, prefix: str, sizes: list[int]) -> list[nn.Linear]:
        """Linears cut along the output rows of one fused PREFIX projection (exactly its rows, so
        exact)."""
        weight = self.get(f"{prefix}.weight")
        bias = self.get(f"{prefix}.bias") if f"{prefix}.bias" in self.reader else None
        layers = []
        for part, rows in zip(
            torch.split(weight, sizes),
            torch.split(bias, sizes) if bias is not None else [None] * len(sizes),
            strict=True,
        ):  # noqa: E501
            layer = nn.Linear(part.shape[1], part.shape[0], bias=rows is not None)
            layer.weight = nn.Parameter(part.contiguous(), requires_grad=False)
            if rows is not None:
                layer.bias = nn.Parameter(rows.contiguous(), requires_grad=False)
            layers.append(layer)
        return layers


def _linear(reader: WeightReader, prefix: str) -> nn.Linear:
    weight = reader.get(f"{prefix}.weight")
    bias_key = f"{prefix}.bias"
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias_key in reader)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias_key in reader:
        layer.bias = nn.Parameter(reader.get(bias_key), requires_grad=False)
    return layer


def rotary_width(config: ModelConfig) -> int:
    """The rotated channels of a head: all of head_dim unless the RoPE is partial (Phi-4-mini:
    3/4)."""
    if config.family.native_rope or config.decoder is None:
        return config.head_dim
    parameters = config.decoder.rope_parameters or {}
    if "full_attention" in parameters and isinstance(parameters["full_attention"], dict):
        parameters = parameters["full_attention"]
    return int(config.head_dim * float(parameters.get("partial_rotary_factor", 1.0)))


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    half = tensor.shape[-1] // 2
    return torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)


def apply_rope(
    tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int | None
) -> torch.Tensor:
    """RoPE on the first ROTARY channels of each head (cos/sin are that wide); None: on all of
    them."""
    if rotary is None:
        return tensor * cos + rotate_half(tensor) * sin
    turned, kept = tensor[..., :rotary], tensor[..., rotary:]
    return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        family = config.family
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.query_scale if config.query_scale is not None else self.head_dim**-0.5
        width = rotary_width(config)
        self.rotary = None if width == self.head_dim else width
        if family.fused_qkv:
            query, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self.q_proj, self.k_proj, self.v_proj = weights.split(
                f"{prefix}.qkv_proj", [query, kv, kv]
            )
        else:
            self.q_proj = weights.linear(f"{prefix}.q_proj")
            self.k_proj = weights.linear(f"{prefix}.k_proj")
            self.v_proj = weights.linear(f"{prefix}.v_proj")
        self.o_proj = weights.linear(f"{prefix}.o_proj")
        self.sinks = (
            nn.Parameter(weights.get(f"{prefix}.sinks"), requires_grad=False)
            if family.attention_sinks
            else None
        )
        self.q_norm = weights.norm(f"{prefix}.q_norm.weight") if family.qk_norm else None
        self.k_norm = weights.norm(f"{prefix}.k_norm.weight") if family.qk_norm else None

    def _repeat(self, tensor: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        if groups == 1:
            return tensor
        batch, kv_heads, length, dim = tensor.shape
        expanded = tensor[:, :, None, :, :].expand(batch, kv_heads, groups, length, dim)
        return expanded.reshape(batch, kv_heads * groups, length, dim)

    def forward(self, hidden, mask, cos, sin, past_key, past_value):  # type: ignore[no-untyped-def]
        batch = hidden.shape[0]
        query = self.q_proj(hidden).view(batch, -1, self.heads, self.head_dim)
        key = self.k_proj(hidden).view(batch, -1, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query = query.transpose(1, 2)  # (B, h, n, d)
        key = key.transpose(1, 2)  # (B, kv, n, d)
        value = self.v_proj(hidden).view(batch, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        query = apply_rope(query, cos, sin, self.rotary)
        key = apply_rope(key, cos, sin, self.rotary)
        key = torch.cat((past_key, key), dim=2)  # (B, kv, cache + n, d)
        value = torch.cat((past_value, value), dim=2)
        keys, values = self._repeat(key), self._repeat(value)
        if (
            self.sinks is not None
        ):  # the sink: one more key of logit `sinks` (a bias on a zero key), value zero
            keys = torch.cat((keys, torch.zeros_like(keys[:, :, :1])), dim=2)
            values = torch.cat((values, torch.zeros_like(values[:, :, :1])), dim=2)
            # (B, h, n, 1)
            sink = self.sinks[None, :, None, None].expand(batch, -1, mask.shape[2], 1)
            mask = torch.cat((mask.expand(batch, self.heads, -1, -1), sink), dim=-1)
        # (B, h, n, d)
        attended = nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scale
        )
        attended = attended.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim)
        return self.o_proj(attended), key, value


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, weights: Weights, prefix: str) -> None:
        super().__init__()
        self.activation = config.family.activation
        if config.family.fused_gate_up:
            size = config.intermediate_size
            self.gate_proj, self.up_proj = weights.split(f"{prefix}.gate_up_proj", [size, size])
        else:
            self.gate_proj = weights.linear(f"{prefix}.gate_proj")
            self.up_proj = weights.linear(f"{prefix}.up_proj")
        self.down_proj = weights.linear(f"{prefix}.down_proj")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            activation(self.activation, self.gate_proj(hidden)) * self.up_proj(hidden)
        )


class FeedForward(nn.Module):
    """The MLP half of a decoder layer with its norm(s) and residual."""

    def __init__(self, config: ModelConfig, weights: Weights, index: int) -> None:
        super().__init__()
        prefix = weights.layer(index)
        sandwich = config.family.sandwich_norms
        before = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        self.pre_norm = weights.norm(f"{prefix}.{before}.weight")
        self.post_norm = (
            weights.norm(f"{prefix}.post_feedforward_layernorm.weight") if sandwich else None
        )
        if index in config.expert_layers:
            kind = ClampedExperts if config.family.clamped_experts else SparseExperts
            self.mlp: nn.Module = kind(config, weights, f"{prefix}.mlp")
        else:
            self.mlp = MLP(config, weights, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        update = self.mlp(self.pre_norm(hidden))
        if self.post_norm is not None:
            update = self.post_norm(update)
        return hidden + update


class DecoderLayer(nn.Module):
    """One decoder layer; without `feed_forward` only its attention half (a stage that ends mid
    layer)."""

    def __init__(
        self, config: ModelConfig, weights: Weights, index: int, feed_forward: bool = True
    ) -> None:
        super().__init__()
        prefix = weights.layer(index)
        self.input_layernorm = weights.norm(f"{prefix}.input_layernorm.weight")
        self.self_attn = Attention(config, weights, f"{prefix}.self_attn")
        self.post_attention_norm = (
            weights.norm(f"{prefix}.post_attention_layernorm.weight")
            if config.family.sandwich_norms
            else None
        )
        self.feed_forward = FeedForward(config, weights, index) if feed_forward else None

    def forward(self, hidden, mask, cos, sin, past_key, past_value):  # type: ignore[no-untyped-def]
        attended, key, value = self.self_attn(
            self.input_layernorm(hidden), mask, cos, sin, past_key, past_value
        )
        if self.post_attention_norm is not None:
            attended = self.post_attention_norm(attended)
        hidden = hidden + attended
        if self.feed_forward is not None:
            hidden = self.feed_forward(hidden)
        return hidden, key, value


def attention_bias(
    attention_mask: torch.Tensor, new_tokens: int, positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """The additive attention mask (B, 1, n, cache + n) of the n new tokens: 0 where a query may
    attend.

    A new token (physical slot cache + i) attends to unmasked slots <= its own. With WINDOW (a local
    layer), only keys whose logical position is less than WINDOW behind the query's: a key's logical
    position is the count of unmasked slots before it (pads, rejected drafts and rollbacks are
    masked, so they do not count), a query's is its position id. transformers' rule: kv_idx > q_idx
    - sliding_window."""
    total = attention_mask.shape[1]
    key_slots = torch.arange(total, dtype=torch.int64)  # (cache + n)
    query_slots = torch.arange(new_tokens, dtype=torch.int64) + (total - new_tokens)  # (n)
    causal = key_slots[None, :] <= query_slots[:, None]  # (n, cache + n)
    # (B, 1, n, cache + n)
    allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)
    if window is not None:
        key_positions = torch.cumsum(attention_mask, dim=-1) - 1  # (B, cache + n)
        distance = positions[:, :, None] - key_positions[:, None, :]  # (B, n, cache + n)
        allowed = allowed & (distance < window)[:, None, :, :]
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min).to(torch.float32)


class StageModule(nn.Module):
    """Layers [start, end) of the model, plus the embedding if first and final norm + lm_head if
    last.

    A range that starts mid layer runs the MLP half of layer start-1 first; one that ends mid layer
    stops layer end-1 after its attention (the hidden state between the halves is what the next
    stage receives).

    forward(main, attention_mask, position_ids, past_key_0, past_value_0, ...) returns the flat
    tuple (hidden_or_logits, present_key_0, present_value_0, ...). attention_mask covers the
    physical cache then the n new tokens; token i (physical slot cache + i) attends to unmasked
    slots <= cache + i."""

    def __init__(self, config: ModelConfig, reader: WeightReader, layers: LayerRange) -> None:
        super().__init__()
        weights = Weights(config, reader)
        self.config = config
        self.first = layers.is_first
        self.last = layers.is_last_of(config.num_layers)
        embedding_key = f"{weights.prefix}.embed_tokens.weight"
        if self.first:
            self.embed_tokens = nn.Embedding.from_pretrained(
                weights.get(embedding_key), freeze=True
            )
        self.lead = FeedForward(config, weights, layers.start - 1) if layers.starts_mid else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, index, not (layers.ends_mid and index == layers.end - 1))
            for index in range(layers.start, layers.end)
        )
        if self.last:
            self.norm = weights.norm(f"{weights.prefix}.norm.weight")
            head_key = "lm_head.weight"
            if config.tie_word_embeddings or head_key not in weights:
                head_key = embedding_key
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(weights.get(head_key), requires_grad=False)
        self.layer_kinds = [
            "sliding_attention" if config.is_sliding(index) else "full_attention"
            for index in range(layers.start, layers.end)
        ]
        self.kinds = sorted(set(self.layer_kinds))
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        if config.family.native_rope:
            self.register_buffer(
                "inverse_frequencies", inverse_frequencies(config), persistent=False
            )
        else:
            from .family_config import rope_table

            self.tables: dict[str, tuple[float, int]] = {}
            for kind in self.kinds:
                table = rope_table(config, kind if config.layer_types else None)
                self.register_buffer(f"short_{kind}", table.short, persistent=False)
                if table.long is not None:
                    self.register_buffer(f"long_{kind}", table.long, persistent=False)
                self.tables[kind] = (table.scaling, table.threshold)

    def _frequencies(self, kind: str, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.config.family.native_rope:
            inverse: torch.Tensor = self.get_buffer("inverse_frequencies")
            return inverse, 1.0
        scaling, threshold = self.tables[kind]
        short = getattr(self, f"short_{kind}")
        if (
            threshold
        ):  # LongRoPE: the long table for a call whose positions pass the original context
            return torch.where(
                position_ids.max() + 1 > threshold, getattr(self, f"long_{kind}"), short
            ), scaling
        return short, scaling

    def forward(self, main, attention_mask, position_ids, *past):  # type: ignore[no-untyped-def]
        config = self.config
        if self.first:
            hidden = self.embed_tokens(main)  # (B, n, H)
            if config.family.embed_scale:  # transformers multiplies in the weight dtype
                hidden = hidden * self.embed_scale
        else:
            hidden = main
        new_tokens = position_ids.shape[1]
        masks, rotations = {}, {}
        for kind in self.kinds:
            window = config.sliding_window if kind == "sliding_attention" else None
            masks[kind] = attention_bias(attention_mask, new_tokens, position_ids, window)
            inverse, scaling = self._frequencies(kind, position_ids)
            # (B, n, d/2)
            angles = position_ids[:, :, None].to(torch.float32) * inverse[None, None, :]
            angles = torch.cat((angles, angles), dim=-1)[:, None, :, :]  # (B, 1, n, d)
            if scaling != 1.0:
                rotations[kind] = (angles.cos() * scaling, angles.sin() * scaling)
            else:
                rotations[kind] = (angles.cos(), angles.sin())
        if self.lead is not None:
            hidden = self.lead(hidden)
        presents = []
        for offset, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds, strict=True)):
            cos, sin = rotations[kind]
            hidden, key, value = layer(
                hidden, masks[kind], cos, sin, past[2 * offset], past[2 * offset + 1]
            )
            presents += [key, value]
        if self.last:
            hidden = self.lm_head(self.norm(hidden))
            cap = config.final_logit_softcapping
            if cap:
                hidden = torch.tanh(hidden / cap) * cap
        return (hidden, *presents)


def example_inputs(
    config: ModelConfig, layers: LayerRange, new_tokens: int = 3, cache: int = 2
) -> tuple[Any, ...]:
    if layers.is_first:
        main = torch.randint(0, config.vocab_size, (1, new_tokens), dtype=torch.int64)
    else:
        main = torch.randn(1, new_tokens, config.hidden_size, dtype=torch.float32)
    mask = torch.ones(1, cache + new_tokens, dtype=torch.int64)
    positions = torch.arange(cache, cache + new_tokens, dtype=torch.int64)[None, :]
    past = [
        torch.randn(1, config.num_kv_heads, cache, config.head_dim) for _ in range(2 * len(layers))
    ]
    return (main, mask, positions, *past)


def convert(module: StageModule, config: ModelConfig, layers: LayerRange) -> Any:
    """Trace MODULE and convert it to an ov.Model with named, batch-1, dynamic-length ports."""
    import openvino as ov

    inputs = example_inputs(config, layers)
    with torch.no_grad():
        model = ov.convert_model(module, example_input=inputs)
    first, last = layers.is_first, layers.is_last_of(config.num_layers)
    names = ["input_ids" if first else "hidden_states", "attention_mask", "position_ids"]
    # Batch stays dynamic (callers use 1): GenAI's PagedAttention conversion needs a dynamic batch.
    shapes = [[-1, -1] if first else [-1, -1, config.hidden_size], [-1, -1], [-1, -1]]
    kv_shape = [-1, config.num_kv_heads, -1, config.head_dim]
    for layer in range(layers.start, layers.end):
        names += [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        shapes += [kv_shape, kv_shape]
    if len(model.inputs) != len(names):
        raise CompileError(
            f"stage {layers}: traced model has {len(model.inputs)} inputs, expected {len(names)}"
        )
    for port, name in zip(model.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    model.reshape(
        {port: ov.PartialShape(shape) for port, shape in zip(model.inputs, shapes, strict=True)}
    )
    outputs = ["logits" if last else "output_hidden_states"]
    for layer in range(layers.start, layers.end):
        outputs += [f"present.{layer}.key", f"present.{layer}.value"]
    if len(model.outputs) != len(outputs):
        raise CompileError(
            f"stage {layers}: traced model has {len(model.outputs)} outputs, expected "
            f"{len(outputs)}"
        )
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    return model
