"""optimum-neuron-torch: Hugging Face Transformers on the PyTorch `neuron` device.

`import optimum_neuron_torch` activates the `neuron` device: TorchNeuron on a Trainium instance,
the bundled reference device everywhere else.
"""

__version__ = "0.1.0.dev0"

from .device import backend_info, clear_op_tracking, executed_ops, fallback_ops  # noqa: E402
from .device.backend import activate as _activate  # noqa: E402

if _activate().name == "reference":
    # TorchNeuron brings its own `neuron` compile backend; the reference device gets the library's.
    from .compiler.backend import register as _register_compile_backend  # noqa: E402

    _register_compile_backend()

from .check import check  # noqa: E402
from .fallbacks import (  # noqa: E402
    FallbackStats,
    fallback_policy,
    fallback_stats,
    get_fallback_policy,
    native_generation_ops,
    set_fallback_policy,
)
from .loading import DEFAULT_MODEL, default_model_path  # noqa: E402
from .modeling import (  # noqa: E402
    NeuronAutoModel,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForTokenClassification,
    embed,
)
from .pipelines import pipeline  # noqa: E402

__all__ = [
    "DEFAULT_MODEL",
    "FallbackStats",
    "NeuronAutoModel",
    "NeuronAutoModelForCausalLM",
    "NeuronAutoModelForMaskedLM",
    "NeuronAutoModelForQuestionAnswering",
    "NeuronAutoModelForSeq2SeqLM",
    "NeuronAutoModelForSequenceClassification",
    "NeuronAutoModelForTokenClassification",
    "__version__",
    "backend_info",
    "check",
    "clear_op_tracking",
    "default_model_path",
    "embed",
    "executed_ops",
    "fallback_ops",
    "fallback_policy",
    "fallback_stats",
    "get_fallback_policy",
    "native_generation_ops",
    "pipeline",
    "set_fallback_policy",
]
