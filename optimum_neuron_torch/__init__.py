"""optimum-neuron-torch: Hugging Face Transformers on the PyTorch `neuron` device.

`import optimum_neuron_torch` activates the `neuron` device: TorchNeuron on a Trainium instance,
the bundled reference device everywhere else.
"""

from .device import (
    FallbackStats,
    backend_info,
    clear_op_tracking,
    executed_ops,
    fallback_ops,
    fallback_stats,
)
from .device.selection import activate as _activate
from .version import __version__

if not _activate().compiles_itself:
    # TorchNeuron brings its own `neuron` compile backend; the reference device gets the library's.
    from .compiler.dynamo_backend import register as _register_compile_backend

    _register_compile_backend()

from .compatibility import check  # noqa: E402
from .fallbacks import fallback_policy, get_fallback_policy, set_fallback_policy  # noqa: E402
from .generation.native_ops import native_generation_ops  # noqa: E402
from .loading import DEFAULT_MODEL, default_model_path  # noqa: E402
from .modeling import (  # noqa: E402
    NeuronAutoModel,
    NeuronAutoModelForAudioClassification,
    NeuronAutoModelForCausalLM,
    NeuronAutoModelForCTC,
    NeuronAutoModelForImageClassification,
    NeuronAutoModelForImageTextToText,
    NeuronAutoModelForMaskedLM,
    NeuronAutoModelForQuestionAnswering,
    NeuronAutoModelForSeq2SeqLM,
    NeuronAutoModelForSequenceClassification,
    NeuronAutoModelForSpeechSeq2Seq,
    NeuronAutoModelForTextToSpectrogram,
    NeuronAutoModelForTextToWaveform,
    NeuronAutoModelForTokenClassification,
    embed,
)
from .pipelines import pipeline  # noqa: E402

__all__ = [
    "DEFAULT_MODEL",
    "FallbackStats",
    "NeuronAutoModel",
    "NeuronAutoModelForCausalLM",
    "NeuronAutoModelForAudioClassification",
    "NeuronAutoModelForCTC",
    "NeuronAutoModelForImageClassification",
    "NeuronAutoModelForImageTextToText",
    "NeuronAutoModelForSpeechSeq2Seq",
    "NeuronAutoModelForTextToSpectrogram",
    "NeuronAutoModelForTextToWaveform",
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
