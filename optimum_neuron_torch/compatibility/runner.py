"""`check(model_or_id)`: runs a model on the `neuron` device with TorchNeuron's support profile,
eagerly and through `torch.compile(backend="neuron", fullgraph=True)`, and reports what it hits."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, PreTrainedModel

from .. import modeling
from ..compiler import CompileCache, artifact, recording_partitions, regions, stablehlo
from ..compiler.dynamo_backend import recording_cache_keys
from ..device import backend_info, clear_op_tracking, fallback_stats, support_profile
from ..errors import ArgumentTypeError, first_line
from ..fallbacks import fallback_policy
from ..generation.engine_calls import host_processors
from ..loading import resolve_checkpoint
from ..module_stack import ModuleStack, observing_modules
from ..patches import PATCHES, patched, patches_for
from ..settings import replace_disable_fallback_execution
from .report import AppliedPatch, CompatibilityReport, DtypeUse, DynamicShapeOp, GraphBreak, OpFallback, UnloweredOp

OUTSIDE_MODULES = "<outside any module>"
BACKWARD = "<backward pass>"

# The model's inputs: positional arguments and keyword arguments of its forward.
Inputs = tuple[tuple[Any, ...], dict[str, Any]]

# What TorchNeuron does with the dtypes it does not fully support.
TREATMENTS = {
    torch.float64: "narrowed to float32 (TorchNeuron computes no float64)",
    torch.int64: "narrowed to int32 on TorchNeuron's compiled path (values beyond 2**31 overflow)",
    torch.complex64: "not supported: TorchNeuron stores complex tensors but computes nothing on them",
    torch.complex128: "not supported: TorchNeuron stores complex tensors but computes nothing on them",
}
SPARSE = "sparse"
SPARSE_TREATMENT = "not supported: TorchNeuron has no sparse tensors"
_LISTED = 4  # ops or modules named per dtype; the rest are counted


class _OpRecorder(TorchDispatchMode):
    """Records, with the module running them, ops that read or write a tensor of a watched dtype
    (or layout) and ops whose output shape depends on the values (nonzero, boolean masks...)."""

    def __init__(self, stack: ModuleStack) -> None:
        super().__init__()
        self.stack = stack
        self.uses: dict[str, tuple[Counter, Counter]] = defaultdict(lambda: (Counter(), Counter()))
        self.dynamic: dict[str, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        module = self.stack.current or OUTSIDE_MODULES
        if _dynamic_output_shape(func, args):
            self.dynamic[func.name()][module] += 1
        for value in tree_leaves((args, kwargs, output)):
            if isinstance(value, torch.Tensor):
                kind = SPARSE if value.layout != torch.strided else value.dtype if value.dtype in TREATMENTS else None
                if kind is not None:
                    ops, modules = self.uses[str(kind).removeprefix("torch.")]
                    ops[func.name()] += 1
                    modules[module] += 1
        return output

    def dtypes(self) -> list[DtypeUse]:
        treatments = {str(dtype).removeprefix("torch."): text for dtype, text in TREATMENTS.items()}
        treatments[SPARSE] = SPARSE_TREATMENT
        return [
            DtypeUse(kind, treatments[kind], _first(ops), _first(modules))
            for kind, (ops, modules) in sorted(self.uses.items())
        ]

    def dynamic_shapes(self) -> list[DynamicShapeOp]:
        return [
            DynamicShapeOp(op, sum(modules.values()), dict(modules)) for op, modules in sorted(self.dynamic.items())
        ]


def _dynamic_output_shape(func: torch._ops.OpOverload, args: tuple) -> bool:
    """Whether the op's output shape depends on its input values (indexing only with a boolean mask)."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:
        return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1])
    return True


def _first(counts: Counter) -> list[str]:
    names = [name for name, _ in counts.most_common()]
    return names[:_LISTED] + ([f"{len(names) - _LISTED} more"] if len(names) > _LISTED else [])


@contextlib.contextmanager
def _fallbacks_by_module(model: torch.nn.Module) -> Iterator[tuple[Counter, ModuleStack]]:
    """Counts fallback calls per (op, innermost calling module of `model`) inside the block; also
    yields the module stack, for other recorders."""
    counts: Counter = Counter()
    seen = {op: stats.calls or 1 for op, stats in fallback_stats().items()}

    def attribute(stack: ModuleStack | None) -> None:
        for op, stats in fallback_stats().items():
            calls = stats.calls or 1  # TorchNeuron tracks names only: one per newly seen op
            if calls != seen.get(op, 0):
                counts[(op, stack.current if stack and stack.current else OUTSIDE_MODULES)] += calls - seen.get(op, 0)
                seen[op] = calls

    with observing_modules(model, attribute, attribute) as stack:
        yield counts, stack
    attribute(None)


def _eager_run(model: torch.nn.Module, inputs: Inputs, report: CompatibilityReport) -> None:
    """One forward with the fallback policy silent: what fell back, which dtypes and value-dependent
    shapes it met, any error."""
    clear_op_tracking()
    error = None
    with fallback_policy("silent"), _fallbacks_by_module(model) as (counts, stack), _OpRecorder(stack) as recorder:
        try:
            with torch.no_grad():
                model(*inputs[0], **inputs[1])
        except Exception as exc:  # the report names the failure
            error = f"{type(exc).__name__}: {first_line(exc)}"
    by_op: dict[str, dict[str, int]] = defaultdict(dict)
    for (op, module), calls in counts.items():
        by_op[op][module] = calls
    stats = fallback_stats()
    report.fallbacks = [
        OpFallback(op, stats[op].calls if op in stats else None, modules) for op, modules in sorted(by_op.items())
    ]
    report.dtypes, report.dynamic_shapes, report.eager_error = recorder.dtypes(), recorder.dynamic_shapes(), error


def _location(stack: list | None) -> str:
    """`file:line in function` of the innermost user frame, the path from its package on."""
    if not stack:
        return "unknown"
    frame = stack[-1]
    return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} in {frame.name}"


def _graph_breaks(explanation: Any) -> list[GraphBreak]:
    """The graph breaks of Dynamo's `explain`, one per reason and place, counted."""
    breaks = Counter(
        (first_line(reason.reason), _location(reason.user_stack)) for reason in explanation.break_reasons
    )
    return [GraphBreak(reason, location, count) for (reason, location), count in breaks.items()]


def _compiled_run(model: torch.nn.Module, inputs: Inputs, report: CompatibilityReport) -> None:
    """Graph breaks (Dynamo's explain), then a `fullgraph=True` compile as the library's compiled
    generation compiles (`regions.backend` over the device's `neuron` backend, on both backends): the
    graphs it splits around ops TorchNeuron's compiler cannot take, and StableHLO lowering."""
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(*inputs[0], **inputs[1])
    report.graph_count = explanation.graph_count
    report.graph_breaks = _graph_breaks(explanation)
    torch._dynamo.reset()
    with (recording_cache_keys() as keys, recording_partitions() as partitions, torch.no_grad(),
          _torchneuron_graphs() as received):
        try:
            torch.compile(model, backend=regions.backend, fullgraph=not report.graph_breaks)(*inputs[0], **inputs[1])
        except Exception as error:  # the report names the failure (the backend's own, not Dynamo's wrapper)
            error = getattr(error, "inner_exception", None) or error
            report.compile_error = f"{type(error).__name__}: {first_line(error)}"
    torch._dynamo.reset()
    for partition in partitions:
        report.unlowered_ops += [UnloweredOp(node.op, node.reason) for node in partition.fallback_nodes]
    if received is not None:
        report.stablehlo = _torchneuron_lowering(received, report.compile_error)
    elif stablehlo.available():
        statuses = [entry.metadata.get("stablehlo", artifact.LOWERS) for entry in map(CompileCache().get, sorted(keys))
                    if entry]
        failed = [status for status in statuses if artifact.lowering_failed(status)]
        report.unlowered_ops += [UnloweredOp("graph", status) for status in failed]
        report.stablehlo = f"{len(statuses) - len(failed)} of {len(statuses)} compiled graph(s) lower to StableHLO"


@contextlib.contextmanager
def _torchneuron_graphs() -> Iterator[list[int | None] | None]:
    """On TorchNeuron (None elsewhere): a list that holds, after the block, the number of graphs its
    `neuron` backend compiled in it (it records a compilation entry per graph it compiled, NEFF cache
    hits included), or None when it cannot tell. In the block, a compiled graph that fails on the
    device raises, instead of TorchNeuron re-running it eagerly."""
    if not backend_info().compiles_itself:
        yield None
        return
    compiled: list[int | None] = []
    before = _compilations()
    user_setting = replace_disable_fallback_execution("1")
    try:
        yield compiled
    finally:
        replace_disable_fallback_execution(user_setting)
        after = _compilations()
        compiled.append(None if before is None or after is None else after - before)


def _compilations() -> int | None:
    """How many graphs TorchNeuron's backend compiled so far; None when it cannot say (its metrics
    synchronize with the device, which a failed execution may have left unusable)."""
    try:
        return len(torch.neuron.get_dynamo_metrics())
    except Exception:  # (what the device raised is the compile error already reported)
        return None


def _torchneuron_lowering(compiled: list[int | None], compile_error: str | None) -> str:
    """What TorchNeuron's own compile of the graphs says of their lowering to StableHLO: it lowers each
    graph it receives (with its fork of Torch-MLIR) and compiles it, so a graph that compiled lowered."""
    count = "an unknown number of" if compiled[0] is None else str(compiled[0])
    if compile_error is not None:
        return f"{count} graph(s) lowered to StableHLO and compiled by TorchNeuron before the compile error"
    return f"{count} graph(s) lowered to StableHLO and compiled by TorchNeuron"


def _with_labels(model: torch.nn.Module, inputs: Inputs) -> Inputs:
    """The inputs of a training step: a language model's labels are its input ids, when not given."""
    args, kwargs = inputs
    if "labels" not in kwargs and "input_ids" in kwargs and "labels" in inspect.signature(model.forward).parameters:
        kwargs = {**kwargs, "labels": kwargs["input_ids"]}
    return args, kwargs


def _loss(output: Any) -> torch.Tensor:
    """The loss of a forward's output (the model's own loss, else the sum of its first tensor)."""
    loss = getattr(output, "loss", None)
    if loss is None:
        first = next(value for value in tree_leaves(output)
                     if isinstance(value, torch.Tensor) and value.is_floating_point())
        loss = first.float().sum()
    return loss


def _training_run(model: torch.nn.Module, inputs: Inputs, report: CompatibilityReport, compile: bool) -> None:
    """One forward and backward in training mode: the ops the backward pass sends to the CPU, then,
    compiled, the graph breaks of the training forward and whether its forward and backward graphs
    compile and lower to StableHLO."""
    inputs = _with_labels(model, inputs)
    model.train()
    try:
        with fallback_policy("silent"):
            loss = _loss(model(*inputs[0], **inputs[1]))
            before = {op: stats.calls or 1 for op, stats in fallback_stats().items()}
            loss.backward()
        after = {op: stats.calls or 1 for op, stats in fallback_stats().items()}
        report.backward_fallbacks = [
            OpFallback(op, calls - before.get(op, 0), {BACKWARD: calls - before.get(op, 0)})
            for op, calls in sorted(after.items()) if calls != before.get(op, 0)
        ]
    except Exception as exc:  # the report names the failure
        report.training_error = f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        model.zero_grad(set_to_none=True)
    if compile and report.training_error is None:
        _compiled_training_run(model, inputs, report)
    model.eval()


def _compiled_training_run(model: torch.nn.Module, inputs: Inputs, report: CompatibilityReport) -> None:
    torch._dynamo.reset()
    report.training_graph_breaks = _graph_breaks(torch._dynamo.explain(model)(*inputs[0], **inputs[1]))
    torch._dynamo.reset()
    with _torchneuron_graphs() as received:
        try:  # the compiled training step, as the Trainer would run it
            _loss(torch.compile(model, backend="neuron")(*inputs[0], **inputs[1])).backward()
        except Exception as error:
            error = getattr(error, "inner_exception", None) or error
            report.training_compile_error = f"{type(error).__name__}: {first_line(error)}"
        finally:
            model.zero_grad(set_to_none=True)
    if received is not None:
        report.training_stablehlo = _torchneuron_lowering(received, report.training_compile_error)
    elif stablehlo.available():
        _lower_training_graphs(model, inputs, report)
    torch._dynamo.reset()


def _lower_training_graphs(model: torch.nn.Module, inputs: Inputs, report: CompatibilityReport) -> None:
    """Lowers the ATen forward and backward graphs of the training step (as AOTAutograd splits them)
    to StableHLO, and notes those that do not lower."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    statuses: list[bool] = []

    def lowering(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            try:
                stablehlo.lower(gm, example_inputs)
                statuses.append(True)
            except Exception as error:  # what fails is the finding
                statuses.append(False)
                report.training_unlowered_ops.append(UnloweredOp(f"{kind} graph", f"{type(error).__name__}: "
                                                                                  f"{first_line(error)}"))
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=lowering("forward"),
                                                             bw_compiler=lowering("backward")))
        _loss(compiled(*inputs[0], **inputs[1])).backward()
    except Exception as error:
        report.training_unlowered_ops.append(UnloweredOp("training step", f"{type(error).__name__}: "
                                                                          f"{first_line(error)}"))
    finally:
        model.zero_grad(set_to_none=True)
    report.training_stablehlo = f"{sum(statuses)} of {len(statuses)} forward and backward graph(s) lower to StableHLO"


def default_inputs(model: PreTrainedModel, sequence_length: int = 16) -> dict[str, Any]:
    """Random token ids (batch 1) of `sequence_length`, the mask, and decoder ids for seq2seq; a model
    of audio or images gets its own input instead of the ids and mask (`main_input_name`): log-mel
    `input_features` (one window), `input_values` (a second at 16 kHz) or `pixel_values`."""
    config = model.config.get_text_config()
    generator = torch.Generator().manual_seed(0)
    vocab = getattr(config, "vocab_size", None) or 8  # (an image model has none: its ids are not used)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, sequence_length), generator=generator)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    shapes = {"input_features": lambda c: (1, c.num_mel_bins, 2 * c.max_source_positions),
              "input_values": lambda c: (1, 16000),
              "pixel_values": lambda c: (1, c.num_channels, c.image_size, c.image_size)}
    if model.main_input_name in shapes:
        inputs = {model.main_input_name: torch.randn(shapes[model.main_input_name](model.config), generator=generator)}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, : max(1, sequence_length // 2)]
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    return inputs


def _load(model_id: str | os.PathLike[str], dtype: torch.dtype | str | None) -> PreTrainedModel:
    """The model for `model_id`, through the Neuron Auto class of its architecture, unpatched, in
    `dtype` (None: the checkpoint's). The checkpoint is resolved first, so that a wrong name or
    folder gets the loader's error."""
    config = AutoConfig.from_pretrained(resolve_checkpoint(model_id).folder)
    return modeling.neuron_auto_class_for(config).from_pretrained(model_id, patches=False, dtype=dtype)


def _removed(before: list, after: list, key: str) -> list:
    """The items of `before` whose `key` no longer appears in `after`."""
    remaining = {getattr(item, key) for item in after}
    return [item for item in before if getattr(item, key) not in remaining]


def _split_inputs(example_inputs: Mapping[str, Any] | Sequence[Any]) -> Inputs:
    """`example_inputs` as (positional, keyword) arguments, their tensors moved to the device."""
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise ArgumentTypeError(
            "check(): `example_inputs` takes a dict of keyword arguments or a tuple (or list) of positional "
            f"arguments of the model's forward, not {type(example_inputs).__name__}."
        )
    return tuple(map(_to_device, args)), {key: _to_device(value) for key, value in kwargs.items()}


def _to_device(value: Any) -> Any:
    return value.to("neuron") if isinstance(value, torch.Tensor) else value


def check(model_or_id: torch.nn.Module | str | os.PathLike[str],
          example_inputs: Mapping[str, Any] | Sequence[Any] | None = None, *,
          sequence_length: int = 16, patches: bool = True, compile: bool = True,
          training: bool = False, dtype: torch.dtype | str | None = None) -> CompatibilityReport:
    """Reports what a model will hit on TorchNeuron, before anyone rents a Trn instance: ops that
    fall back to the CPU (with the modules calling them), graph breaks, ops that do not lower to
    StableHLO, dtypes narrowed or missing, ops with value-dependent shapes, the patches it needs, and
    a verdict (`runs natively`, `runs with fallbacks`, `needs patches` or `blocked`).

    The model runs on the `neuron` device with TorchNeuron's support profile (on the reference
    device; on TorchNeuron, the hardware's), once eagerly and once through
    `torch.compile(backend="neuron")`. A model given on the CPU is moved to the `neuron` device;
    patches applied to it while checking are reverted afterwards.

    Args:
        model_or_id (`torch.nn.Module`, `str` or `os.PathLike`):
            A model (any `nn.Module`), a Hub model id or a local checkpoint folder. A model named
            by id or folder is loaded through its `NeuronAutoModel*` class without patches.
        example_inputs (`dict[str, Any]`, `tuple` or `list`, *optional*):
            The inputs of the model's forward: a dict of keyword arguments, or a tuple (or list) of
            positional arguments as `torch.export` and `torch.compile` users pass them. Tensors among
            them (at the top level) are moved to the device. Defaults to random token ids of
            `sequence_length` (batch 1), with the attention mask (and decoder ids for a seq2seq
            model); a module that is not a Transformers model needs them.
        sequence_length (`int`, *optional*, defaults to 16):
            The length of the default inputs.
        patches (`bool`, *optional*, defaults to `True`):
            Whether to apply the patches the model needs while checking (the report then also
            lists what the model hits without them).
        compile (`bool`, *optional*, defaults to `True`):
            Whether to run the compiled path (graph breaks, graph splitting, StableHLO lowering).
        training (`bool`, *optional*, defaults to `False`):
            Whether to also check a training step (the model's loss, with labels equal to the
            input ids for a language model, and its backward): the ops the backward pass sends to
            the CPU (TorchNeuron's native ops cover far fewer backward ops than forward ones), and
            with `compile`, the training forward's graph breaks and whether its forward and
            backward graphs compile and lower to StableHLO.
        dtype (`torch.dtype` or `str`, *optional*):
            The dtype to load a model named by id or folder in (`torch.bfloat16` or `"bfloat16"`;
            default: the checkpoint's). A model object is checked in its own dtype.

    Returns:
        [`~optimum_neuron_torch.compatibility.CompatibilityReport`]: the findings and the verdict;
        `report.render("text" | "json" | "markdown")` formats it.

    Raises:
        [`~optimum_neuron_torch.errors.ArgumentTypeError`]:
            If `example_inputs` is neither a dict, a tuple nor a list, or `dtype` is given with a
            model object.
        [`~optimum_neuron_torch.errors.CheckpointError`]:
            If `model_or_id` names a checkpoint that cannot be found or loaded.
        [`~optimum_neuron_torch.errors.UnsupportedModelError`]:
            If no `NeuronAutoModel*` class has a model for the checkpoint's configuration.

    Example:

    ```python
    >>> import torch
    >>> import optimum_neuron_torch as ont

    >>> report = ont.check("org/model-id")  # or a local folder, or a model object
    >>> print(report.render())  # `render("markdown")` for an issue, `render("json")` for a script
    >>> report.verdict
    'runs with fallbacks'

    >>> report = ont.check(my_module, (torch.randn(4, 8), torch.randn(4, 8)))  # positional inputs
    >>> ont.check("org/model-id", training=True).backward_fallbacks  # what the backward pass runs on the CPU
    ```
    """
    by_name = isinstance(model_or_id, (str, os.PathLike))
    given_inputs = None if example_inputs is None else _split_inputs(example_inputs)
    if dtype is not None and not by_name:
        raise ArgumentTypeError(f"check(dtype={dtype!r}) applies to a model named by id or folder; a model object is "
                                "checked in its own dtype (convert it with `model.to(dtype)` first)")
    model = _load(model_or_id, dtype) if by_name else model_or_id
    model.to("neuron").eval()
    inputs = given_inputs if given_inputs is not None else _split_inputs(default_inputs(model, sequence_length))
    info = backend_info()
    with support_profile("torchneuron"), warnings.catch_warnings():
        report = CompatibilityReport(
            model=str(model_or_id) if by_name else getattr(model, "name_or_path", "") or type(model).__name__,
            architecture=type(model).__name__, backend=f"{info.name} {info.version}",
            profile=info.profile,  # (the run's: TorchNeuron's op list on the reference device)
            dtype=", ".join(sorted({str(parameter.dtype).removeprefix("torch.") for parameter in model.parameters()})),
        )
        warnings.simplefilter("ignore")  # everything a warning would say is in the report
        _eager_run(model, inputs, report)
        needed = [patch.name for patch in patches_for(model)] if patches else []
        with patched(model, needed):
            if needed:
                unpatched = dataclasses.replace(report)
                report.patches = [AppliedPatch(name, PATCHES[name].description) for name in needed]
                _eager_run(model, inputs, report)
                report.unpatched_fallbacks = _removed(unpatched.fallbacks, report.fallbacks, "op")
                report.unpatched_dtypes = _removed(unpatched.dtypes, report.dtypes, "dtype")
                report.unpatched_dynamic_shapes = _removed(unpatched.dynamic_shapes, report.dynamic_shapes, "op")
            if compile and report.eager_error is None:
                _compiled_run(model, inputs, report)
            if training and report.eager_error is None:
                report.training = True
                _training_run(model, inputs, report, compile)
    generation = getattr(model, "neuron_generation", None)
    if generation is not None:
        report.compile_bill = generation.compile_bill()
        report.host_processors = _host_processors(model, generation)
    report.decide()
    return report


def _host_processors(model: PreTrainedModel, generation: Any) -> list[str]:
    """What `generate()` runs on the host for the model's generation config (the logits processors the
    engine's step does not apply on the device) and the tokens its calls so far chose there."""
    lines = []
    names = host_processors(model) if generation.engine_gap is None else []
    if names:
        lines.append(f"the generation config's logits processors ({', '.join(names)}) are not all ones the device "
                     "applies: generate() chooses each token on the host, reading the row's logits (vocabulary x 4 "
                     "bytes) every step; pass a generation config without them to keep the choice on the device")
    lines += [f"{name}: {count} token(s) chosen on the host so far"
              for name, count in sorted(generation.host_choices.items())]
    return lines
