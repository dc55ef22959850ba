"""Provides the conformance harness's tiny models on disk: a Hugging Face folder and a GGUF
written by `gguf`."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from shard_compiler.conformance import VOCAB, Entry, tiny_model

SPECIALS = ("<bos>", "<eos>", "<pad>")  # ids 256, 257, 258 (the configs' bos/eos/pad)
MERGES = (("Ġ", "t"), ("Ġ", "a"))  # GGUF readers want merges (and unwrap a one-element array)
TEMPLATE = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"


def byte_characters() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (the byte-level BPE
    alphabet)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet(), key=_byte_of)


def _byte_of(character: str) -> int:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(value): value for value in printable}
    extra = 0
    for value in range(256):
        if value not in printable:
            table[chr(256 + extra)] = value
            extra += 1
    return table[character]


def tokens() -> list[str]:
    """The tiny vocabulary: 256 byte tokens, three specials, unused tokens up to the models'
    vocabulary."""
    unused = VOCAB - 256 - len(SPECIALS) - len(MERGES)
    return [
        *byte_characters(),
        *SPECIALS,
        *("".join(pair) for pair in MERGES),
        *(f"<unused{i}>" for i in range(unused)),
    ]


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocabulary = {token: index for index, token in enumerate(tokens())}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=list(MERGES)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def model(entry: Entry) -> Any:
    """transformers' tiny model of ENTRY (built once per run)."""
    return _model(entry.key)


@cache
def _model(key: str) -> Any:
    from shard_compiler.conformance import entries

    return tiny_model(entries()[key])


def write_hf(entry: Entry, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model(entry).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def _gguf_tensors(entry: Entry, state: dict[str, Any], arch: Any) -> dict[str, np.ndarray]:
    """HF tensors renamed to llama.cpp's names, with the transforms convert_hf_to_gguf.py
    applies."""
    import gguf
    import torch

    config = model(entry).config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for key, tensor in state.items():
        data = tensor.detach().to(torch.float32).numpy().copy()
        if entry.model_type == "llama" and (
            key.endswith("q_proj.weight") or key.endswith("k_proj.weight")
        ):
            heads = config.num_attention_heads if "q_proj" in key else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
            # llama.cpp's permute for its rope layout
            data = data.swapaxes(1, 2).reshape(tensor.shape)
        if entry.model_type == "gemma3_text" and key.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's norm weights with the 1 added
        if key.endswith(
            ".mlp.experts.gate_up_proj"
        ):  # transformers' fused [E, 2I, H]: llama.cpp's gate, up
            head = key.removesuffix(".gate_up_proj")
            gate, up = np.split(data, 2, axis=1)
            out[names.get_name(f"{head}.gate_proj.weight", try_suffixes=(".weight",)) or key] = gate
            out[names.get_name(f"{head}.up_proj.weight", try_suffixes=(".weight",)) or key] = up
            continue
        if key.endswith(".mlp.experts.down_proj"):
            out[names.get_name(f"{key}.weight", try_suffixes=(".weight",)) or key] = data
            continue
        if (
            ".mlp.experts." in key
        ):  # one [E, ...] tensor per kind and layer, as llama.cpp merges them
            head, _, rest = key.partition(".mlp.experts.")
            expert, _, kind = rest.partition(".")
            experts.setdefault(f"{head}.mlp.experts.{kind}", []).append((int(expert), data))
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"no GGUF name for {key}")
        out[name] = data
    for key, parts in experts.items():
        name = names.get_name(key, try_suffixes=(".weight",))
        if name is None:
            raise KeyError(f"no GGUF name for {key}")
        out[name] = np.stack([data for _, data in sorted(parts, key=lambda part: part[0])])
    return out


def write_gguf(
    entry: Entry, path: Path, raw: dict[str, Any] | None = None, arch_name: str = ""
) -> Path:
    """ENTRY's model as an f32 GGUF with llama.cpp's metadata keys and a byte-level tokenizer.

    RAW maps tensor names to a GGML type whose bytes are written as zeros instead (an unreadable
    quant type); ARCH_NAME overrides general.architecture."""
    import gguf

    from shard_compiler.families import family_of

    family = family_of(entry.model_type)
    assert family is not None
    arch_name = arch_name or family.gguf
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == family.gguf)
    config = model(entry).config
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_name(f"tiny-{entry.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    parameters = config.rope_parameters
    full = parameters.get("full_attention", parameters) if isinstance(parameters, dict) else {}
    writer.add_rope_dimension_count(
        int(config.head_dim * float(full.get("partial_rotary_factor", 1.0)))
    )
    if full.get("rope_type") == "longrope":  # llama.cpp's Phi-3: the factors as tensors
        writer.add_rope_scaling_orig_ctx_len(int(full["original_max_position_embeddings"]))
        for kind in ("long", "short"):
            writer.add_tensor(
                f"rope_factors_{kind}.weight", np.array(full[f"{kind}_factor"], dtype=np.float32)
            )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(full["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    if entry.model_type == "gemma3_text":
        writer.add_sliding_window(config.sliding_window)
    if family.experts:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens())
    kinds = [1] * 256 + [3] * len(SPECIALS) + [1] * len(MERGES)
    writer.add_token_types(kinds + [5] * (VOCAB - len(kinds)))
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges([" ".join(pair) for pair in MERGES])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_pad_token_id(258)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    state = model(entry).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, data in _gguf_tensors(entry, state, arch).items():
        if raw and name in raw:
            block, size = gguf.GGML_QUANT_SIZES[raw[name]]
            zeros = np.zeros((*data.shape[:-1], data.shape[-1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, zeros, raw_dtype=raw[name])
        else:
            writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
