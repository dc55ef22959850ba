"""Provides the per-family table: how each supported architecture differs from the one decoder
trace.py builds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One decoder family's departures from a Llama layer; every field off is plain Llama.

    The weights are read by Hugging Face name; a fused projection is split on load, so the traced
    graph is the same for every family and only these switches change it."""

    model_type: str  # the config.json model_type the decoder is read from
    # Hugging Face class names accepted in config.json "architectures"
    architectures: tuple[str, ...]
    gguf: str  # general.architecture of a GGUF of this family ("": not read from GGUF)
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head, before RoPE
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 2/3)
    embed_scale: bool = False  # embedding output times sqrt(hidden), in the model dtype
    fused_qkv: bool = False  # one qkv_proj [q; k; v] instead of q/k/v_proj
    fused_gate_up: bool = False  # one gate_up_proj [gate; up] instead of gate/up_proj
    activation: str = "silu"  # "silu" or "gelu_tanh" (the MLP's gate activation)
    # RoPE by the compiler's own tables (the three original families, kept bit-stable)
    native_rope: bool = False
    # sparse mixture-of-experts MLPs (router softmax, top-k, optional renormalisation)
    experts: bool = False
    # a learned per-head logit in every softmax that attends to nothing (gpt-oss)
    attention_sinks: bool = False
    # gpt-oss experts: router top-k then softmax, clamped SwiGLU with biases
    clamped_experts: bool = False


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", ("LlamaForCausalLM",), "llama", native_rope=True),
        Family("mistral", ("MistralForCausalLM",), "mistral", native_rope=True),
        Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", native_rope=True),
        Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True),
        Family("phi3", ("Phi3ForCausalLM",), "phi3", fused_qkv=True, fused_gate_up=True),
        Family(
            "gemma3_text",
            ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
            "gemma3",
            qk_norm=True,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=True,
            activation="gelu_tanh",
        ),
        Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3moe", qk_norm=True, experts=True),
        Family(
            "gpt_oss",
            ("GptOssForCausalLM",),
            "",  # its GGUFs hold MXFP4 experts, which transformers' GGUF reader does not dequantise
            experts=True,
            attention_sinks=True,
            clamped_experts=True,
        ),
    )
}
# config.json model_types that name a family by another name: Gemma 3's multimodal checkpoints keep
# the text decoder's config under "text_config".
ALIASES = {"gemma3": "gemma3_text"}
GGUF_FAMILIES = {family.gguf: family for family in FAMILIES.values() if family.gguf}


def family_of(model_type: str | None) -> Family | None:
    """The family of a config.json model_type, or None if the compiler does not build it."""
    if model_type is None:
        return None
    return FAMILIES.get(ALIASES.get(model_type, model_type))


def supported_architectures() -> list[str]:
    """The model_types the compiler builds, in table order (the README's list comes from the
    harness)."""
    return list(FAMILIES)
