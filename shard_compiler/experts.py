"""Provides the sparse mixture-of-experts MLP (Qwen3-MoE): router softmax, top-k experts,
optional renormalisation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .decoder_config import CompileError, ModelConfig


def activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The MLP gate's activation: SiLU, or Gemma's tanh-approximated GELU."""
    if name == "gelu_tanh":
        return nn.functional.gelu(tensor, approximate="tanh")
    return nn.functional.silu(tensor)


def expert_weights(
    weights: Any, prefix: str, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) from per-expert checkpoint tensors or
    transformers' fused ones (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in weights:
        gate_up = weights.get(fused)
        gate, up = gate_up.chunk(2, dim=1)
        return gate.contiguous(), up.contiguous(), weights.get(f"{prefix}.experts.down_proj")
    if f"{prefix}.experts.0.gate_proj.weight" not in weights:
        raise CompileError(f"weights: no experts under {prefix!r}")
    stacks = [
        torch.stack(
            [weights.get(f"{prefix}.experts.{expert}.{name}.weight") for expert in range(experts)]
        )
        for name in ("gate_proj", "up_proj", "down_proj")
    ]
    return stacks[0], stacks[1], stacks[2]


class SparseExperts(nn.Module):
    """Every token's top-k experts by router softmax, their outputs summed with the (renormalised)
    weights.

    All experts are evaluated and weighted by a dense routing matrix that is zero off the top k: the
    same sum as transformers' per-expert loop (exact), in a graph of fixed shape that OpenVINO
    traces; the cost is every expert's compute, not only the active ones'."""

    def __init__(self, config: ModelConfig, weights: Any, prefix: str) -> None:
        super().__init__()
        self.experts = config.num_experts
        self.top_k = config.experts_per_token
        self.normalise = config.norm_topk_prob
        self.activation = config.family.activation
        # (E, H)
        self.router = nn.Parameter(weights.get(f"{prefix}.gate.weight"), requires_grad=False)
        gate, up, down = expert_weights(weights, prefix, self.experts)
        # (E, H, I)
        self.gate = nn.Parameter(gate.transpose(1, 2).contiguous(), requires_grad=False)
        self.up = nn.Parameter(up.transpose(1, 2).contiguous(), requires_grad=False)  # (E, H, I)
        # (E, I, H)
        self.down = nn.Parameter(down.transpose(1, 2).contiguous(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        tokens = hidden.reshape(-1, width)  # (T, H)
        probabilities = torch.softmax(nn.functional.linear(tokens, self.router), dim=-1)  # (T, E)
        top_values, top_indices = torch.topk(probabilities, self.top_k, dim=-1)  # (T, k)
        if self.normalise:
            top_values = top_values / top_values.sum(dim=-1, keepdim=True)
        routing = torch.zeros_like(probabilities).scatter(1, top_indices, top_values)  # (T, E)
        each = tokens[None].expand(self.experts, -1, -1)  # (E, T, H): a batch per expert
        # (E, T, I)
        inner = activation(self.activation, torch.bmm(each, self.gate)) * torch.bmm(each, self.up)
        outputs = torch.bmm(inner, self.down)  # (E, T, H)
        mixed = (outputs * routing.transpose(0, 1)[:, :, None]).sum(dim=0)  # (T, H)
        return mixed.reshape(batch, length, width)


class ClampedExperts(nn.Module):
    """gpt-oss's experts: router logits (with bias), top-k, softmax over those k; each expert a
    SwiGLU whose gate and up are clamped (gate <= 7, |up| <= 7), glu = gate * sigmoid(1.702 gate),
    out = down((up + 1) glu), every projection with a bias. Dense over experts like SparseExperts
    (exact, fixed shape)."""

    alpha = 1.702
    limit = 7.0

    def __init__(self, config: ModelConfig, weights: Any, prefix: str) -> None:
        super().__init__()
        self.experts = config.num_experts
        self.top_k = config.experts_per_token
        # (E, H)
        self.router = nn.Parameter(weights.get(f"{prefix}.router.weight"), requires_grad=False)
        self.router_bias = nn.Parameter(weights.get(f"{prefix}.router.bias"), requires_grad=False)
        # (E, H, 2I), gate and up interleaved
        gate_up = weights.get(f"{prefix}.experts.gate_up_proj")
        gate_up_bias = weights.get(f"{prefix}.experts.gate_up_proj_bias")  # (E, 2I)
        self.gate = nn.Parameter(gate_up[..., ::2].contiguous(), requires_grad=False)  # (E, H, I)
        self.up = nn.Parameter(gate_up[..., 1::2].contiguous(), requires_grad=False)
        # (E, 1, I)
        self.gate_bias = nn.Parameter(gate_up_bias[:, None, ::2].contiguous(), requires_grad=False)
        self.up_bias = nn.Parameter(gate_up_bias[:, None, 1::2].contiguous(), requires_grad=False)
        # (E, I, H)
        self.down = nn.Parameter(weights.get(f"{prefix}.experts.down_proj"), requires_grad=False)
        # (E, 1, H)
        self.down_bias = nn.Parameter(
            weights.get(f"{prefix}.experts.down_proj_bias")[:, None, :].contiguous(),
            requires_grad=False,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        tokens = hidden.reshape(-1, width)  # (T, H)
        logits = nn.functional.linear(tokens, self.router, self.router_bias)  # (T, E)
        top_values, top_indices = torch.topk(logits, self.top_k, dim=-1)
        routing = torch.zeros_like(logits).scatter(
            1, top_indices, torch.softmax(top_values, dim=-1)
        )
        each = tokens[None].expand(self.experts, -1, -1)  # (E, T, H)
        gate = (torch.bmm(each, self.gate) + self.gate_bias).clamp(max=self.limit)  # (E, T, I)
        up = (torch.bmm(each, self.up) + self.up_bias).clamp(min=-self.limit, max=self.limit)
        inner = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        outputs = torch.bmm(inner, self.down) + self.down_bias  # (E, T, H)
        mixed = (outputs * routing.transpose(0, 1)[:, :, None]).sum(dim=0)
        return mixed.reshape(batch, length, width)
