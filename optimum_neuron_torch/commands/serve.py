"""`optimum-cli neuron-torch serve [MODEL]`: an OpenAI-compatible HTTP server (see `serving`).

With `--tp-size N` this process is one rank of a job of N (see `launch`): every rank loads its
part of the model and builds the same engine; rank 0 serves HTTP and schedules, the others run the
device calls it sends them (`generation.split_model.StepBroadcast`).
"""

from __future__ import annotations

import signal
from pathlib import Path

from transformers import AutoConfig, AutoProcessor, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CTC_MAPPING_NAMES,
    MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
)

from .. import settings
from ..errors import ConfigurationError, InvalidRequestError, MissingDependencyError
from ..generation.buckets import Buckets
from ..generation.static_plans import image_placeholder
from ..loading import DEFAULT_MODEL, default_model_path
from ..modeling import NeuronAutoModel
from ..pipelines import pipeline
from ..pipelines.tasks import default_model
from .launch import is_first_rank
from .models import load_generative_model

DRAIN_SECONDS = 120  # after SIGTERM, how long the requests running may take to finish
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"  # (what clients call the default embedding model)


def serve(model_id: str | None = None, *, host: str, port: int, batch_size: int | None = None,
          max_length: int | None = None,
          prompt_buckets: tuple[int, ...] | None = None, prefill_budget: int | None = None,
          api_key: str | None = None, tp_size: int = 1, dtype: str | None = None,
          prompt_logprobs: bool = False, tool_call_parser: str | None = None, task: str | None = None,
          prefix_caching: bool = False, speculative_config: str | None = None, enable_lora: bool = False,
          lora_modules: list[str] | None = None, max_loras: int = 4, max_lora_rank: int = 16) -> None:
    """Serves `model_id` (default: the library's default model, or with `task="embed"` the packaged
    all-MiniLM-L6-v2) until SIGTERM or Ctrl-C; clients name it `model_id` (or its default's name).
    `task` is `generate` (chat and completions: the engine runs `serving_buckets`, with the graphs
    that score prompts if `prompt_logprobs`, and those that follow a cached prefix if `prefix_caching`;
    speculative decoding as `speculative_config` says, a JSON object of `SpeculativeConfig`'s fields;
    with `enable_lora` (or `lora_modules`, each `name=folder` of a PEFT adapter), `max_loras` LoRA
    adapters of rank up to `max_lora_rank` (see `lora_adapters`);
    tool calls read by `tool_call_parser`, default: the
    format the chat template names), `embed` (`/v1/embeddings`, see `serving.embedding_engine`) or
    `transcribe` (`/v1/audio/transcriptions`, see `serving.transcriptions`); default: `default_task`.

    Raises:
        MissingDependencyError: FastAPI, uvicorn or openai is not installed (the `serve` extra).
        ConfigurationError: a model the engine cannot serve (names why), an embedding model split
            between ranks, a speculative config it refuses (names the field), or a LoRA adapter it
            cannot load (names it and why).
    """
    try:
        from ..generation.engine import GenerationEngine
        from ..generation.lora_adapters import AdapterSlots
        from ..generation.speculation import Speculation, SpeculativeConfig
        from ..generation.split_model import StepBroadcast
        from ..serving.embedding_engine import EmbeddingEngine
        from ..serving.server import run_server
        from ..serving.transcriptions import TranscriptionEngine
    except ImportError as error:
        raise MissingDependencyError(f"serving needs the package {error.name}: "
                                     "pip install 'optimum-neuron-torch[serve]'") from None
    task = task or default_task(model_id)
    if task == "transcribe":
        if model_id is None or tp_size > 1:
            raise ConfigurationError("a speech recognition model is served by one process, named: "
                                     "`serve --model MODEL --task transcribe` without --tensor-parallel-size")
        engine = TranscriptionEngine(pipeline("automatic-speech-recognition", model_id, dtype=dtype))
        run_server(engine, model_id, host=host, port=port, drain_seconds=DRAIN_SECONDS,
                   api_key=api_key if api_key is not None else settings.serving_api_key())
        return
    if task == "embed":
        if tp_size > 1:
            raise ConfigurationError("an embedding model is served by one process: leave out --tensor-parallel-size")
        folder = str(default_model("feature-extraction")) if model_id is None else model_id
        tokenizer = AutoTokenizer.from_pretrained(folder)
        engine = EmbeddingEngine(NeuronAutoModel.from_pretrained(folder, dtype=dtype), tokenizer, batch_size or 8,
                                 max_length)
        run_server(engine, model_id or DEFAULT_EMBEDDING_MODEL, host=host, port=port, drain_seconds=DRAIN_SECONDS,
                   api_key=api_key if api_key is not None else settings.serving_api_key())
        return
    folder = str(default_model_path()) if model_id is None else model_id
    speculation = None
    if speculative_config is not None:
        if tp_size > 1:
            raise ConfigurationError("speculative decoding is not available for a model split between ranks yet: "
                                     "leave out --speculative-config or --tensor-parallel-size")
        speculative = SpeculativeConfig.from_json(speculative_config)
        draft = load_generative_model(speculative.model, 1, dtype) if speculative.model is not None else None
        speculation = Speculation(speculative, draft)
    model = load_generative_model(folder, tp_size, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # (a vision-language model's processor makes its chats' prompts, images included)
    processor = AutoProcessor.from_pretrained(folder) if image_placeholder(model) is not None else None
    buckets = serving_buckets(model, batch_size=batch_size, max_length=max_length, prompt_buckets=prompt_buckets)
    engine = GenerationEngine(model, buckets, tokenizer, prefill_budget=prefill_budget,
                              broadcast=StepBroadcast() if tp_size > 1 else None, scoring=prompt_logprobs,
                              prefix_caching=prefix_caching, speculation=speculation)
    if enable_lora or lora_modules:
        adapters = AdapterSlots(engine, max_loras, max_lora_rank)
        for module in lora_modules or []:
            name, _, path = module.partition("=")
            if not (name and path):
                raise ConfigurationError(f"--lora-modules {module!r}: write each adapter as name=folder")
            try:
                adapters.load(name, path)
            except InvalidRequestError as error:
                raise ConfigurationError(f"--lora-modules {module}: {error}") from None
    if not is_first_rank():
        # (rank 0 decides when the job stops: it drains its requests, then tells the others)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        engine.device.follow()  # (until rank 0's engine stops)
        return
    run_server(engine, model_id or DEFAULT_MODEL,  # (what clients call the default model)
               host=host, port=port, drain_seconds=DRAIN_SECONDS,
               api_key=api_key if api_key is not None else settings.serving_api_key(), tool_parser=tool_call_parser,
               processor=processor)


def default_task(model_id: str | None) -> str:
    """`embed` for a sentence-transformers folder, `transcribe` for a speech recognition model (its
    config in Transformers' speech-to-text or CTC mappings), else `generate`."""
    if model_id is None:
        return "generate"
    if (Path(model_id) / "modules.json").is_file():
        return "embed"
    try:
        config = AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError):  # (no config it can read: the generative model's loader says why)
        return "generate"
    speech = (*MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, *MODEL_FOR_CTC_MAPPING_NAMES)
    return "transcribe" if config.model_type in speech else "generate"


def serving_buckets(model: PreTrainedModel, *, batch_size: int | None = None, max_length: int | None = None,
                    prompt_buckets: tuple[int, ...] | None = None) -> Buckets:
    """The buckets the server runs `model` on: the model's (those it was saved with by `compile
    --save`, whose graphs then load, else the defaults), or, with any of these given, `batch_size`
    slots (default: the model's largest batch bucket), `max_length` and `prompt_buckets` (default:
    the model's up to half of `max_length`, or if none is, the defaults for `max_length`)."""
    buckets = model.neuron_generation.buckets
    if (batch_size, max_length, prompt_buckets) == (None, None, None):
        return buckets
    max_length = max_length or buckets.max_length
    prompt_buckets = (prompt_buckets or tuple(length for length in buckets.prompt_buckets if 2 * length <= max_length)
                      or Buckets.default(model.config, max_length).prompt_buckets)
    return Buckets.for_slots(model.config, batch_size or buckets.batch_sizes[-1], max_length, prompt_buckets)
