"""Which speech and vision-language architectures of the installed Transformers run on `neuron`: a generated table.

Every model type that Transformers maps to one of five tasks (speech-to-text encoder-decoders, CTC,
text-to-waveform, text-to-spectrogram, image-text-to-text) is built tiny from its own default config
(the causal-LM sweep's rules, `benchmarks/coverage.py`, applied to each of its sub-configs, positions
kept: an image takes hundreds of them) and given what its own preprocessing makes: 1 s of tones through
the type's feature extractor, 10 text tokens, or a 64 x 48 image through its image processor with a
prompt holding one placeholder per image feature. Then, in a subprocess of its own with a time limit:

1. the task's output on the CPU with Transformers: greedy `generate()` of 8 tokens for the models that
   generate tokens, the pipeline's call otherwise (a CTC model's forward, a TTS model's forward or its
   own `generate()`); a type that fails here is not runnable at tiny size and left out of the counts;
2. the same checkpoint loaded with the task's `NeuronAutoModel*` class and run eagerly on `neuron`;
3. the same compiled: the library's compiled generation where the class has one, a forward compiled as
   the library compiles its own steps (`compiler.regions.compile_by_layer`: each repeated layer compiled
   once, graphs split around the ops TorchNeuron's compiler cannot take); the graphs counted, whether
   they lower to StableHLO.

*Identical* means the same tokens, or tensors within rtol 1e-4 / atol 1e-4 of the CPU's: the compiled
kernels sum in another order than the CPU's eager ones (a tiny FastSpeech2's spectrogram differs by up
to 6e-5; eager outputs are within 1e-5), and the largest difference is in docs/coverage_multimodal.json.

Usage:

    python benchmarks/coverage_multimodal.py                            # every type: docs/coverage_multimodal.md
    python benchmarks/coverage_multimodal.py --types ctc:wav2vec2,image-text-to-text:llava   # printed only
    python benchmarks/coverage_multimodal.py --types ctc:hubert --update  # replace these rows of the table
    python benchmarks/coverage_multimodal.py --sample                   # the fixed sample CI runs

`--jobs` runs that many types at once (default 2), `--timeout` is each type's limit in seconds.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "coverage_multimodal.md"
RESULTS = ROOT / "docs" / "coverage_multimodal.json"
DEFAULT_TIMEOUT = 240.0
# The fixed sample of CI (tests/test_coverage_multimodal.py): a speech model's own generate() arguments (its
# processor's `audio_chunk_index`), an encoder-decoder with images. (Compiling costs 30-60 s a type, which the
# CI budget does not hold: compiled CTC models, GOT-OCR 2's features read as one tensor and FastSpeech2's
# convolution layouts are left to the full sweep, the last two also tested alone, in
# tests/test_vision_language.py and tests/test_compile.py.)
SAMPLE = ("speech-seq2seq:cohere_asr", "image-text-to-text:florence2")
RTOL, ATOL = 1e-4, 1e-4  # (see the module's docstring)

_spec = importlib.util.spec_from_file_location("causal_lm_coverage", Path(__file__).with_name("coverage.py"))
causal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(causal)
sweeps = causal.sweeps

# task: (Transformers' mapping of model types, the library's Auto class)
TASKS = {
    "speech-seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "NeuronAutoModelForSpeechSeq2Seq"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "NeuronAutoModelForCTC"),
    "text-to-waveform": ("MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES", "NeuronAutoModelForTextToWaveform"),
    "text-to-spectrogram": ("MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES", "NeuronAutoModelForTextToSpectrogram"),
    "image-text-to-text": ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "NeuronAutoModelForImageTextToText"),
}
AUDIO_TASKS = ("speech-seq2seq", "ctc")
# The causal-LM sweep's sizes without its positions: a prompt of a vision-language model holds an
# image's features (hundreds of positions), and the audio encoders' positions follow their frames.
# The projection of image features follows the text's width (`projection_dim`, `out_hidden_size`).
SIZES = {**{name: size for name, size in causal.SIZES.items()
            if name not in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "sliding_window")},
         "projection_dim": causal.SIZES["hidden_size"], "out_hidden_size": causal.SIZES["hidden_size"]}
# Placeholder ids past the tiny vocabulary (images, audio, video, boundaries) move into its end,
# below the special tokens' ids (`coverage.TOKEN_IDS`), each to an id of its own.
PLACEHOLDER_ID = re.compile(r".*_token_(id|index)$")
FIRST_PLACEHOLDER = causal.VOCAB - 8
# Feature extractors of a type's processor where Transformers' feature-extractor mapping names another.
FEATURE_EXTRACTORS = {"wav2vec2-bert": "SeamlessM4TFeatureExtractor"}
# Multimodal rotary positions (Qwen-VL's temporal, height and width sections of each head's
# frequencies) split the tiny head's 4 frequencies.
MROPE_SECTION = [2, 1, 1]
# Model types whose defaults need more than the rules above (each attribute the type's own).
OVERRIDES: dict[str, dict] = {
    # Random draws in the forward: none, so that two devices' outputs can be compared (VITS's noise,
    # SpeechT5's decoder pre-net dropout, which it applies in eval mode too).
    "vits": {"noise_scale": 0.0, "noise_scale_duration": 0.0},
    "speecht5": {"speech_decoder_prenet_dropout": 0.0},
    # The default config's tower gives 14 x 14 patches and the projector pools them to 16 x 16 (the
    # checkpoints' 896-pixel tower gives 64 x 64): 14 x 14 tokens.
    "gemma3": {"mm_tokens_per_image": 196},
}


def task_types() -> list[str]:
    """Every `task:model_type` of the five mappings."""
    from transformers.models.auto import modeling_auto

    return [f"{task}:{model_type}" for task, (mapping, _) in TASKS.items()
            for model_type in sorted(getattr(modeling_auto, mapping))]


def tiny_config(model_type: str):
    """The type's default config, each of its (sub-)configs shrunk by the causal-LM sweep's rules
    (`SIZES`), placeholder token ids moved into the tiny vocabulary, multimodal rotary sections fit to
    the tiny head (`MROPE_SECTION`), a vocabulary for a CTC head without one, `OVERRIDES` applied.

    Returns:
        `(config, changed)`: the config and the names of the attributes set.
    """
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    changes: dict = {}
    targets = list(_configs(config))
    for target in targets:
        causal._shrink(target, changes, SIZES)
    placeholder = FIRST_PLACEHOLDER
    for target in targets:
        for name, value in sorted(target.to_dict().items()):
            if PLACEHOLDER_ID.match(name) and isinstance(value, int) and value >= causal.VOCAB \
                    and name not in causal.TOKEN_IDS:
                setattr(target, name, placeholder)
                changes[name], placeholder = True, placeholder - 1
    if _source_reads(model_type, "mrope_section"):
        for target in targets:
            if isinstance(getattr(target, "rope_parameters", None), dict):
                target.rope_parameters["mrope_section"] = MROPE_SECTION
                changes["mrope_section"] = MROPE_SECTION
    if getattr(config, "vocab_size", 0) is None:  # (CTC heads of configs without a vocabulary)
        config.vocab_size = changes["vocab_size"] = causal.VOCAB
    for name, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, name, value)
        changes[name] = value
    return config, sorted(changes)


def _source_reads(model_type: str, name: str) -> bool:
    """Whether the type's modeling code (beside its configuration's) mentions `name`."""
    from transformers import CONFIG_MAPPING

    configuration = Path(importlib.util.find_spec(CONFIG_MAPPING[model_type].__module__).origin)
    return any(name in path.read_text() for path in configuration.parent.glob("modeling_*.py"))


def _configs(config):
    """The config and every config inside it, depth first."""
    from transformers import PreTrainedConfig

    yield config
    for name in getattr(config, "sub_configs", {}):
        value = getattr(config, name, None)
        if isinstance(value, PreTrainedConfig):
            yield from _configs(value)


# One type, in its own process ------------------------------------------------------------------
def run_one(task_type: str, folder: Path) -> dict:
    """Builds the tiny model of `task:model_type` and runs it three times (see the module's docstring)."""
    import torch
    import transformers

    task, model_type = task_type.split(":")
    neuron_class_name = TASKS[task][1]
    result: dict = {"type": task_type}
    stage = sweeps.Stage(result)
    with stage("config"):
        config, result["changed"] = tiny_config(model_type)
    if "error" in result:
        return result
    with stage("cpu"):
        torch.manual_seed(0)
        auto_class = getattr(transformers, neuron_class_name.removeprefix("Neuron"))
        model = auto_class.from_config(config).eval()
        sweeps.randomize(model)
        model.save_pretrained(folder)
        transformers.AutoConfig.from_pretrained(folder)  # (a tiny config that breaks a rule of its type fails here)
        inputs = _inputs(task, model_type, model)
        expected = _run(model, inputs, generates=_generates_tokens(task, model))
        result["architecture"] = type(model).__name__
        del model
    if "error" in result:
        return result
    import optimum_neuron_torch as ont
    from optimum_neuron_torch.compiler.dynamo_backend import recording_cache_keys

    with stage("load"):
        model = getattr(ont, neuron_class_name).from_pretrained(folder)
        result["patches"] = list(getattr(model, "neuron_patches", []))
    if "error" in result:
        return result
    device_inputs = {name: value.to("neuron") if isinstance(value, torch.Tensor) else value
                     for name, value in inputs.items()}
    generates = _generates_tokens(task, model)
    with stage("eager"):
        ont.clear_op_tracking()
        eager = _run(model, device_inputs, generates, eager=True)
        result["eager_identical"], result["eager_difference"] = _compare(eager, expected)
        result["fallback_ops"] = sorted(ont.fallback_ops())
    with stage("compiled"):
        with warnings.catch_warnings(record=True) as caught, recording_cache_keys() as keys, \
                ont.compiler.recording_partitions() as splits:
            warnings.simplefilter("always")
            compiled_generation = getattr(model, "neuron_generation", None) is not None
            if generates and not compiled_generation:
                result["degraded"] = "no compiled generation for this class"
                compiled = None
            elif generates is False and hasattr(model, "generate"):
                result["degraded"] = "a generate() of its own (not Transformers'): no compiled path"
                compiled = None
            else:
                if task == "image-text-to-text" and compiled_generation:
                    _fit_buckets(model, inputs["input_ids"].shape[1])
                compiled = _run(model if generates else _compiled_forward(model), device_inputs, generates)
        degraded = [str(w.message).removeprefix("generate() with ").split(" does not run on the compiled")[0]
                    for w in caught if "does not run on the compiled neuron graphs" in str(w.message)]
        result["degraded"] = result.get("degraded") or (degraded[0] if degraded else None)
        identical, result["compiled_difference"] = _compare(compiled, expected)
        result["compiled_identical"] = identical and not result["degraded"]
        result["graphs"] = len(keys)
        result["split_graphs"] = len(splits)
        result["stablehlo"] = sweeps.lowering(keys)
        result["fallback_ops"] = sorted(set(result.get("fallback_ops", [])) | set(ont.fallback_ops()))
    return result


def _compiled_forward(model):
    """The model's forward compiled as the library compiles its own steps (see the module's docstring),
    with graph breaks allowed: a TTS model's output length follows its predicted durations (data)."""
    import functools

    from optimum_neuron_torch.compiler import regions
    from optimum_neuron_torch.generation.compiling import call_module
    from optimum_neuron_torch.generation.split_model import whole_graphs_reason

    compiled = regions.compile_by_layer(call_module, whole_because=whole_graphs_reason(model), dynamic=False)
    return functools.partial(compiled, model)


def _fit_buckets(model, prompt_length: int) -> None:
    """Compiled generation's buckets for this prompt, as a user precompiling for it would set them (an
    image's features are hundreds of positions, past the default buckets)."""
    from optimum_neuron_torch.generation import Buckets

    bucket = 1 << max(4, (prompt_length - 1).bit_length())
    model.neuron_generation.set_buckets(Buckets((1,), (bucket,), bucket + 4 * causal.NEW_TOKENS))


def _generates_tokens(task: str, model) -> bool | None:
    """Whether the task's output is generated tokens (Transformers' GenerationMixin): speech to text,
    image to text, and the TTS models that generate audio codes (Bark, MusicGen, ...); None: the
    forward's output, as the pipeline takes it (CTC, whose models' own generate() is a greedy
    decoding of the same forward)."""
    from transformers import GenerationMixin

    if task == "ctc":
        return None
    return isinstance(model, GenerationMixin) and model.can_generate()


def _run(model, inputs: dict, generates: bool | None, eager: bool = False):
    """The task's output: greedy tokens, a model's own `generate()` (SpeechT5), or its forward (None)."""
    import torch

    with torch.no_grad():
        if generates:
            settings = dict(max_new_tokens=causal.NEW_TOKENS, min_new_tokens=causal.NEW_TOKENS, do_sample=False)
            return model.generate(**inputs, **settings, **({"disable_compile": True} if eager else {}))
        if generates is False and hasattr(model, "generate"):
            return model.generate(**inputs)
        return model(**inputs)


def _compare(output, expected) -> tuple[bool, float | None]:
    """Whether `output`'s tensors equal `expected`'s (floats within RTOL/ATOL), and their largest difference."""
    import torch

    if output is None:
        return False, None
    outputs, references = _tensors(output), _tensors(expected)
    if len(outputs) != len(references) or any(a.shape != b.shape for a, b in zip(outputs, references, strict=True)):
        return False, None
    largest, same = 0.0, True
    for value, reference in zip(outputs, references, strict=True):
        value = value.cpu()
        if reference.is_floating_point():
            value, reference = value.double(), reference.double()
            largest = max(largest, (value - reference).abs().max().item() if value.numel() else 0.0)
            same = same and torch.allclose(value, reference, rtol=RTOL, atol=ATOL)
        else:
            same = same and torch.equal(value, reference)
    return same, largest


def _tensors(output) -> list:
    """The tensors of a model's output, in order (a ModelOutput's, a tuple's, or the tensor)."""
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [tensor for item in output for tensor in _tensors(item)]
    return []


# Inputs, as the type's own preprocessing makes them -----------------------------------------------
def _inputs(task: str, model_type: str, model) -> dict:
    import torch

    if task in AUDIO_TASKS:
        return _audio_inputs(model_type)
    ids = torch.randint(4, causal.VOCAB - 8, (1, causal.PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    if task == "image-text-to-text":
        return _image_inputs(model_type, model, ids)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    speaker = getattr(model.config, "speaker_embedding_dim", None)
    if speaker:  # (SpeechT5 speaks with a voice the pipeline takes as `speaker_embeddings`)
        inputs["speaker_embeddings"] = torch.randn(1, speaker, generator=torch.Generator().manual_seed(2))
    return inputs


def _audio_inputs(model_type: str) -> dict:
    """1 s of tones through the type's feature extractor, built with its defaults."""
    import numpy
    import transformers
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES

    name = FEATURE_EXTRACTORS.get(model_type, FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type))
    if name is None:
        raise ValueError(f"model type {model_type!r} has no feature extractor in Transformers' mapping")
    extractor = getattr(transformers, name)()
    rate = getattr(extractor, "sampling_rate", 16000)
    times = numpy.arange(rate) / rate
    audio = (0.3 * numpy.sin(2 * numpy.pi * 440 * times) + 0.2 * numpy.sin(2 * numpy.pi * 1250 * times))
    return dict(extractor(audio.astype(numpy.float32), sampling_rate=rate, return_tensors="pt"))


def _image_inputs(model_type: str, model, ids) -> dict:
    """A 64 x 48 image through the type's image processor (its defaults), and `ids` with as many
    image placeholders in their middle as the model makes features of the image."""
    import inspect

    import numpy
    import PIL.Image
    import torch
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
    name = names.get("pil") if isinstance(names, dict) else None
    if name is None or not hasattr(transformers, name):
        raise ValueError(f"model type {model_type!r} has no image processor that runs without torchvision")
    processor = getattr(transformers, name)()
    sizes = _processor_sizes(processor, getattr(model.config, "vision_config", None))
    pixels = numpy.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=numpy.uint8)
    images = dict(processor(images=[PIL.Image.fromarray(pixels)], return_tensors="pt", **sizes))
    accepted = inspect.signature(model.forward).parameters
    images = {name: value for name, value in images.items() if name in accepted}  # (Gemma 3's `num_crops`)
    config = model.config
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    if token is None or not hasattr(model, "get_image_features"):
        raise ValueError("no image token id or no get_image_features: not a placeholder-merging model")
    with torch.no_grad():
        features = model.get_image_features(**images)
    count = _rows(getattr(features, "pooler_output", features))
    half = ids.shape[1] // 2
    ids = torch.cat([ids[:, :half], torch.full((1, count), token), ids[:, half:]], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **images}


def _processor_sizes(processor, vision) -> dict:
    """The processor's arguments that follow the model's vision tower (the processor defaults are not
    always the config defaults): a fixed image size (CLIP's `shortest_edge` or `height` and `width`),
    patches and their merging (Qwen-VL's)."""
    sizes: dict = {}
    side = getattr(vision, "image_size", None)
    for attribute in ("size", "crop_size"):
        value = getattr(processor, attribute, None)
        keys = {key for key in ("height", "width", "shortest_edge", "longest_edge", "min_pixels", "max_pixels")
                if getattr(value, key, None) is not None}
        if isinstance(side, int) and keys in ({"height", "width"}, {"shortest_edge"}):
            sizes[attribute] = {key: side for key in keys}
    for argument, name in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                           ("merge_size", "spatial_merge_size")):
        if isinstance(getattr(processor, argument, None), int) and isinstance(getattr(vision, name, None), int):
            sizes[argument] = getattr(vision, name)
    return sizes


def _rows(features) -> int:
    """The number of feature vectors (placeholders) in `get_image_features`' output."""
    import torch

    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1]).shape[0]
    if isinstance(features, (list, tuple)):
        return sum(_rows(item) for item in features)
    raise ValueError(f"get_image_features gave {type(features).__name__}, not tensors")


# The table -------------------------------------------------------------------------------------
def status(result: dict) -> str:
    line = causal.status(result)
    if not causal.runnable_on_cpu(result) or result.get("error"):
        return line
    return line.replace("compiled DIFFERENT", f"compiled DIFFERENT (by {result.get('compiled_difference')})")


def summary(results: list[dict]) -> dict:
    """The causal-LM sweep's counts, over all types and per task."""
    by_task = {task: causal.summary([r for r in results if r["type"].startswith(f"{task}:")]) for task in TASKS}
    return {**causal.summary(results), "tasks": by_task}


def render_table(data: dict) -> str:
    """docs/coverage_multimodal.md from docs/coverage_multimodal.json's content."""
    lines = [
        "# Speech and vision-language coverage",
        "",
        "Generated by `python benchmarks/coverage_multimodal.py` (do not edit by hand): every model type of",
        f"Transformers {data['transformers']} (torch {data['torch']}, {data['machine']}) in its speech-to-text,",
        "CTC, text-to-waveform, text-to-spectrogram and image-text-to-text mappings, built tiny from its",
        "default config and given what its own preprocessing makes (see the script's docstring); its output on",
        "the CPU (Transformers), then on `neuron` eagerly and compiled. *Identical*: the same tokens, or",
        f"tensors within rtol {RTOL:g} / atol {ATOL:g} of the CPU's.",
        f"Sweep time: {data['minutes']} min with {data['jobs']} jobs on {data['cpus']} CPUs.",
        "",
        "| task | types | runnable on the CPU at tiny size | no exception on `neuron` | eager identical "
        "| compiled identical | of which whole graphs lowering to StableHLO |",
        "|---|---|---|---|---|---|---|",
    ]
    for task, counts in [*data["summary"]["tasks"].items(), ("all", data["summary"])]:
        runnable = counts["runnable_on_cpu"] or 1
        lines.append(
            f"| {task} | {counts['types']} | {counts['runnable_on_cpu']} | {counts['no_exception_on_neuron']} "
            f"| {counts['eager_identical']} ({100 * counts['eager_identical'] / runnable:.0f}%) "
            f"| {counts['compiled_identical']} ({100 * counts['compiled_identical'] / runnable:.0f}%) "
            f"| {counts['compiled_identical_whole_graphs']} |")
    lines += [
        "",
        "*StableHLO*: whether the compiled graphs lower to StableHLO (*no*: they ran on the reference device,",
        "TorchNeuron's compiler would refuse them; *split*: graphs split around ops the compiler cannot take).",
        "",
        "| task | type | eager identical | compiled identical | StableHLO | fallback ops | graphs | error or reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in data["results"]:
        task, model_type = result["type"].split(":")
        error = result.get("error")
        if not causal.runnable_on_cpu(result):
            lines.append(f"| {task} | {model_type} | – | – | – | – | – | not runnable on the CPU at tiny size: "
                         f"{sweeps.cell(error['message'])} |")
            continue
        reason = (f"{error['stage']}: {error['message']}" if error else result.get("degraded") or
                  ("" if result.get("compiled_identical") else
                   f"outputs differ (largest difference {result.get('compiled_difference')})"))
        lines.append(
            f"| {task} | {model_type} | {sweeps.mark(result.get('eager_identical'))} "
            f"| {sweeps.mark(result.get('compiled_identical'))} | {sweeps.lowering_mark(result)} "
            f"| {', '.join(result.get('fallback_ops', []))} | {result.get('graphs', '')} | {sweeps.cell(reason)} |")
    return "\n".join(lines) + "\n"


COMMITTED = sweeps.Table(RESULTS, TABLE, summary, render_table)


if __name__ == "__main__":
    sweeps.main(__file__, __doc__, run_one=run_one, all_types=task_types, sample=SAMPLE, table=COMMITTED,
                describe=status, timeout=DEFAULT_TIMEOUT)
