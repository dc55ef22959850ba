"""Provides the per-stage torch module (Llama-family decoder layers) and its conversion to an OpenVINO model."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from remote_worker.manifest import LayerRange

from .sources import CompileError, ModelConfig, WeightReader

logger = logging.getLogger(__name__)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp64 math, with linear or llama3 scaling applied."""
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
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.eps))


def _linear(reader: WeightReader, prefix: str) -> nn.Linear:
    weight = reader.get(f"{prefix}.weight")
    bias_key = f"{prefix}.bias"
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias_key in reader)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias_key in reader:
        layer.bias = nn.Parameter(reader.get(bias_key), requires_grad=False)
    return layer


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    half = tensor.shape[-1] // 2
    return torch.cat((-tensor[..., half:], tensor[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, reader: WeightReader, prefix: str) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = _linear(reader, f"{prefix}.q_proj")
        self.k_proj = _linear(reader, f"{prefix}.k_proj")
        self.v_proj = _linear(reader, f"{prefix}.v_proj")
        self.o_proj = _linear(reader, f"{prefix}.o_proj")

    def _repeat(self, tensor: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        if groups == 1:
            return tensor
        batch, kv_heads, length, dim = tensor.shape
        expanded = tensor[:, :, None, :, :].expand(batch, kv_heads, groups, length, dim)
        return expanded.reshape(batch, kv_heads * groups, length, dim)

    def forward(self, hidden, mask, cos, sin, past_key, past_value):  # type: ignore[no-untyped-def]
        batch = hidden.shape[0]
        query = self.q_proj(hidden).view(batch, -1, self.heads, self.head_dim).transpose(1, 2)  # (B, h, n, d)
        key = (
            self.k_proj(hidden).view(batch, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        )  # (B, kv, n, d)
        value = self.v_proj(hidden).view(batch, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        key = torch.cat((past_key, key), dim=2)  # (B, kv, cache + n, d)
        value = torch.cat((past_value, value), dim=2)
        attended = nn.functional.scaled_dot_product_attention(
            query, self._repeat(key), self._repeat(value), attn_mask=mask, scale=self.head_dim**-0.5
        )  # (B, h, n, d)
        attended = attended.transpose(1, 2).reshape(batch, -1, self.heads * self.head_dim)
        return self.o_proj(attended), key, value


class MLP(nn.Module):
    def __init__(self, reader: WeightReader, prefix: str) -> None:
        super().__init__()
        self.gate_proj = _linear(reader, f"{prefix}.gate_proj")
        self.up_proj = _linear(reader, f"{prefix}.up_proj")
        self.down_proj = _linear(reader, f"{prefix}.down_proj")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class FeedForward(nn.Module):
    """The MLP half of a decoder layer with its norm and residual."""

    def __init__(self, config: ModelConfig, reader: WeightReader, index: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.post_attention_layernorm = RMSNorm(
            reader.get(f"{prefix}.post_attention_layernorm.weight"), config.rms_norm_eps
        )
        self.mlp = MLP(reader, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderLayer(nn.Module):
    """One decoder layer; without `feed_forward` only its attention half (a stage that ends mid layer)."""

    def __init__(
        self, config: ModelConfig, reader: WeightReader, index: int, feed_forward: bool = True
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(reader.get(f"{prefix}.input_layernorm.weight"), config.rms_norm_eps)
        self.self_attn = Attention(config, reader, f"{prefix}.self_attn")
        self.feed_forward = FeedForward(config, reader, index) if feed_forward else None

    def forward(self, hidden, mask, cos, sin, past_key, past_value):  # type: ignore[no-untyped-def]
        attended, key, value = self.self_attn(
            self.input_layernorm(hidden), mask, cos, sin, past_key, past_value
        )
        hidden = hidden + attended
        if self.feed_forward is not None:
            hidden = self.feed_forward(hidden)
        return hidden, key, value


class StageModule(nn.Module):
    """Layers [start, end) of the model, plus the embedding if first and final norm + lm_head if last.

    A range that starts mid layer runs the MLP half of layer start-1 first; one that ends mid layer stops
    layer end-1 after its attention (the hidden state between the halves is what the next stage receives).

    forward(main, attention_mask, position_ids, past_key_0, past_value_0, ...) returns the flat tuple
    (hidden_or_logits, present_key_0, present_value_0, ...). attention_mask covers the physical cache
    then the n new tokens; token i (physical slot cache + i) attends to unmasked slots <= cache + i.
    """

    def __init__(self, config: ModelConfig, reader: WeightReader, layers: LayerRange) -> None:
        super().__init__()
        self.first = layers.is_first
        self.last = layers.is_last_of(config.num_layers)
        if self.first:
            self.embed_tokens = nn.Embedding.from_pretrained(
                reader.get("model.embed_tokens.weight"), freeze=True
            )
        self.lead = FeedForward(config, reader, layers.start - 1) if layers.starts_mid else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, reader, index, not (layers.ends_mid and index == layers.end - 1))
            for index in range(layers.start, layers.end)
        )
        if self.last:
            self.norm = RMSNorm(reader.get("model.norm.weight"), config.rms_norm_eps)
            head_key = "lm_head.weight"
            if config.tie_word_embeddings or head_key not in reader:
                head_key = "model.embed_tokens.weight"
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(reader.get(head_key), requires_grad=False)
        self.register_buffer("inverse_frequencies", inverse_frequencies(config), persistent=False)

    def forward(self, main, attention_mask, position_ids, *past):  # type: ignore[no-untyped-def]
        hidden = self.embed_tokens(main) if self.first else main  # (B, n, H)
        new_tokens = position_ids.shape[1]
        total = attention_mask.shape[1]
        key_slots = torch.arange(total, dtype=torch.int64)  # (cache + n)
        query_slots = torch.arange(new_tokens, dtype=torch.int64) + (total - new_tokens)  # (n)
        causal = key_slots[None, :] <= query_slots[:, None]  # (n, cache + n)
        allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)  # (B, 1, n, cache + n)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).to(torch.float32)
        angles = (
            position_ids[:, :, None].to(torch.float32) * self.inverse_frequencies[None, None, :]
        )  # (B, n, d/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :, :]  # (B, 1, n, d)
        cos, sin = angles.cos(), angles.sin()
        if self.lead is not None:
            hidden = self.lead(hidden)
        presents = []
        for offset, layer in enumerate(self.layers):
            hidden, key, value = layer(hidden, mask, cos, sin, past[2 * offset], past[2 * offset + 1])
            presents += [key, value]
        if self.last:
            hidden = self.lm_head(self.norm(hidden))
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
    past = [torch.randn(1, config.num_kv_heads, cache, config.head_dim) for _ in range(2 * len(layers))]
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
    model.reshape({port: ov.PartialShape(shape) for port, shape in zip(model.inputs, shapes, strict=True)})
    outputs = ["logits" if last else "output_hidden_states"]
    for layer in range(layers.start, layers.end):
        outputs += [f"present.{layer}.key", f"present.{layer}.value"]
    if len(model.outputs) != len(outputs):
        raise CompileError(
            f"stage {layers}: traced model has {len(model.outputs)} outputs, expected {len(outputs)}"
        )
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    return model
