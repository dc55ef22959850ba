"""Provides each model's recommended chat sampling (from its model card), used when the fleet file
sets none.

Greedy decoding makes small chat models loop ("A symphony of light and sound, A symphony of light
and sound, ..."); their authors publish the sampling that reads well. These are the only per-model
defaults: the fleet file's `[sessions]` keys and the command line override them, `--exact` stays
greedy, and the seed stays fixed (`[sessions] seed`, default 0) so an answer can be reproduced."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RecommendedSampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    source: str = ""  # where the numbers come from
    repetition_penalty: float = 1.0  # HF/CTRL penalty over prompt + reply; 1 = off


GREEDY = RecommendedSampling(0.0, 1.0, 0, "greedy")

# Keys are matched against the model name with its folder, file extension and GGUF quantisation
# removed, lower-cased: "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf" and
# the builtin "smollm2-135m-instruct" all give "smollm2-135m-instruct".
RECOMMENDED: dict[str, RecommendedSampling] = {
    # SmolLM2 model card ("temperature=0.2, top_p=0.9" in its transformers example), all three
    # sizes; the 135M model still loops on a line ("A symphony of light and sound, ...") at that
    # temperature; a mild repetition penalty (1.1) ends the loop.
    "smollm2-": RecommendedSampling(0.2, 0.9, 0, "SmolLM2 model card", repetition_penalty=1.1),
    # generation_config.json of meta-llama/Llama-3.1-*-Instruct.
    "llama-3.1-": RecommendedSampling(0.6, 0.9, 0, "Llama-3.1 generation_config.json"),
    "meta-llama-3.1-": RecommendedSampling(0.6, 0.9, 0, "Llama-3.1 generation_config.json"),
    # generation_config.json of Qwen/Qwen2.5-*-Instruct.
    "qwen2.5-": RecommendedSampling(0.7, 0.8, 20, "Qwen2.5 generation_config.json"),
}


def model_key(name: str) -> str:
    """The part of a model name that identifies the model (no folder, extension or GGUF
    quantisation)."""
    stem = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    stem = re.sub(r"\.gguf$", "", stem)
    return re.sub(r"[.-](q\d\w*|f16|f32|bf16|fp16|fp32)$", "", stem)


def _from_generation_config(folder: Path) -> RecommendedSampling | None:
    """A Hugging Face folder's own `generation_config.json`, when it asks for sampling."""
    try:
        config = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    temperature = config.get("temperature")
    if not config.get("do_sample") or not isinstance(temperature, (int, float)) or temperature <= 0:
        return None
    top_p = config.get("top_p")
    top_k = config.get("top_k")
    repetition = config.get("repetition_penalty")
    return RecommendedSampling(
        float(temperature),
        float(top_p) if isinstance(top_p, (int, float)) and 0 < top_p <= 1 else 1.0,
        int(top_k) if isinstance(top_k, int) and top_k > 0 else 0,
        str(folder / "generation_config.json"),
        float(repetition) if isinstance(repetition, (int, float)) and 0 < repetition <= 10 else 1.0,
    )


def recommended_sampling(model: str) -> RecommendedSampling:
    """The model's recommended chat sampling: its folder's generation_config.json, the table,
    else greedy."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        found = _from_generation_config(folder)
        if found is not None:
            return found
    key = model_key(model)
    for prefix, sampling in RECOMMENDED.items():
        if key.startswith(prefix) and "instruct" in key:
            return sampling
    return GREEDY
