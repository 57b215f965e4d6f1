"""The compatibility report: what a model will hit on TorchNeuron, and a verdict, rendered as
text, JSON or Markdown."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ..errors import ConfigurationError

RUNS_NATIVELY = "runs natively"
RUNS_WITH_FALLBACKS = "runs with fallbacks"
NEEDS_PATCHES = "needs patches"
BLOCKED = "blocked"


@dataclass
class OpFallback:
    """An op that took the CPU fallback path in the eager run, and the modules that called it."""

    op: str
    calls: int | None
    modules: dict[str, int]


@dataclass
class GraphBreak:
    """Where Dynamo split the model's graph, and why."""

    reason: str
    location: str
    count: int = 1


@dataclass
class UnloweredOp:
    """An op TorchNeuron's compiler cannot take (no StableHLO lowering, or never compilable)."""

    op: str
    reason: str


@dataclass
class DtypeUse:
    """A dtype TorchNeuron narrows (float64, int64 -> 32 bits) or lacks (complex, sparse)."""

    dtype: str
    treatment: str
    ops: list[str]
    modules: list[str]


@dataclass
class DynamicShapeOp:
    """An op whose output shape depends on tensor values: a graph break or a recompile per shape."""

    op: str
    calls: int
    modules: dict[str, int]


@dataclass
class AppliedPatch:
    name: str
    description: str


def _calls_line(item: OpFallback | DynamicShapeOp) -> str:
    calls = item.calls if item.calls is not None else "?"
    modules = ", ".join(f"{module} ({n})" for module, n in sorted(item.modules.items()))
    return f"{item.op}: {calls} calls, from {modules}"


def _dtype_line(use: DtypeUse) -> str:
    return f"{use.dtype}: {use.treatment} (ops {', '.join(use.ops)}; modules {', '.join(use.modules)})"


@dataclass
class CompatibilityReport:
    model: str
    architecture: str
    backend: str
    profile: str
    dtype: str = ""  # the dtypes of the model's parameters, as checked
    verdict: str = RUNS_NATIVELY
    fallbacks: list[OpFallback] = field(default_factory=list)
    graph_count: int | None = None
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    compile_error: str | None = None
    unlowered_ops: list[UnloweredOp] = field(default_factory=list)
    stablehlo: str = "skipped: install the `stablehlo` extra (torch-mlir) to check lowering"
    dtypes: list[DtypeUse] = field(default_factory=list)
    dynamic_shapes: list[DynamicShapeOp] = field(default_factory=list)
    patches: list[AppliedPatch] = field(default_factory=list)
    unpatched_fallbacks: list[OpFallback] = field(default_factory=list)  # what the patches took away
    unpatched_dtypes: list[DtypeUse] = field(default_factory=list)
    unpatched_dynamic_shapes: list[DynamicShapeOp] = field(default_factory=list)
    eager_error: str | None = None
    training: bool = False  # whether a training step was checked (the fields below)
    backward_fallbacks: list[OpFallback] = field(default_factory=list)
    training_graph_breaks: list[GraphBreak] = field(default_factory=list)
    training_compile_error: str | None = None
    training_unlowered_ops: list[UnloweredOp] = field(default_factory=list)
    training_stablehlo: str = "skipped: install the `stablehlo` extra (torch-mlir) to check lowering"
    training_error: str | None = None
    compile_bill: list[str] = field(default_factory=list)  # generation's graphs (see `buckets.compile_bill`)
    host_processors: list[str] = field(default_factory=list)  # what generate() chooses on the host, and how often

    def decide(self) -> str:
        """The verdict: blocked > needs patches > runs with fallbacks > runs natively."""
        lacking = [use for use in self.dtypes if use.treatment.startswith("not supported")]
        if self.eager_error or self.training_error or lacking:
            self.verdict = BLOCKED
        elif self.patches:
            self.verdict = NEEDS_PATCHES
        elif self.falls_back or self.dynamic_shapes:
            self.verdict = RUNS_WITH_FALLBACKS
        else:
            self.verdict = RUNS_NATIVELY
        return self.verdict

    @property
    def falls_back(self) -> bool:
        """Whether anything leaves the device or the compiled graph (what `--strict` refuses)."""
        return bool(
            self.fallbacks or self.graph_breaks or self.unlowered_ops or self.compile_error or self.eager_error
            or self.backward_fallbacks or self.training_graph_breaks or self.training_unlowered_ops
            or self.training_compile_error or self.training_error
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _sections(self) -> list[tuple[str, list[str]]]:
        """(title, lines) pairs shared by the text and Markdown renderings."""
        fallbacks = [_calls_line(item) for item in self.fallbacks]
        dynamic = [_calls_line(item) for item in self.dynamic_shapes]
        breaks = sum(item.count for item in self.graph_breaks)
        graphs = [f"{self.graph_count} graph(s), {breaks} graph break(s)"] if self.graph_count is not None else []
        graphs += [f"break at {item.location}: {item.reason}" + (f" (x{item.count})" if item.count > 1 else "")
                   for item in self.graph_breaks]
        graphs += [f"compile failed: {self.compile_error}"] if self.compile_error else []
        split_around = sorted({item.op for item in self.unlowered_ops if item.op != "graph"})
        graphs += [f"split around {', '.join(split_around)}, which then run eagerly; TorchNeuron's own "
                   "torch.compile(backend='neuron') refuses such a graph (it never splits): compile your own "
                   "code with optimum_neuron_torch.compiler.regions.backend"] if split_around else []
        lowering = [self.stablehlo] + [f"{item.op}: {item.reason}" for item in self.unlowered_ops]
        dtypes = [_dtype_line(use) for use in self.dtypes]
        patches = [f"{patch.name}: {patch.description}" for patch in self.patches]
        patches += [f"without them, fallback {_calls_line(item)}" for item in self.unpatched_fallbacks]
        patches += [
            f"without them, value-dependent shape {_calls_line(item)}" for item in self.unpatched_dynamic_shapes
        ]
        patches += [f"without them, {_dtype_line(use)}" for use in self.unpatched_dtypes]
        sections = [
            ("Eager run", [f"failed: {self.eager_error}"] if self.eager_error else ["completed"]),
            ("Ops that fall back to the CPU", fallbacks or ["none"]),
            ("Compiled as generation compiles (fullgraph=True, split where TorchNeuron cannot compile)",
             graphs or ["not run"]),
            ("StableHLO lowering (Torch-MLIR)", lowering),
            ("Dtypes TorchNeuron narrows or lacks", dtypes or ["none"]),
            ("Ops with value-dependent output shapes (a new compile per shape)", dynamic or ["none"]),
            ("Patches applied", patches or ["none"]),
        ]
        if self.compile_bill:
            sections.append(("Compiled generation: the compile bill", self.compile_bill))
        if self.host_processors:
            sections.append(("Generation: logits processors run on the host", self.host_processors))
        return sections + (self._training_sections() if self.training else [])

    def _training_sections(self) -> list[tuple[str, list[str]]]:
        if self.training_error:
            return [("Training step (forward and backward)", [f"failed: {self.training_error}"])]
        breaks = [f"break at {item.location}: {item.reason}" + (f" (x{item.count})" if item.count > 1 else "")
                  for item in self.training_graph_breaks]
        compiled = breaks + ([f"compile failed: {self.training_compile_error}"] if self.training_compile_error else [])
        lowering = [self.training_stablehlo] + [f"{item.op}: {item.reason}" for item in self.training_unlowered_ops]
        return [
            ("Training step (forward and backward)", ["completed"]),
            ("Ops the backward pass sends to the CPU", [_calls_line(item) for item in self.backward_fallbacks]
             or ["none"]),
            ("Compiled training step", compiled or ["no graph break, compiled"]),
            ("StableHLO lowering of the training graphs", lowering),
        ]

    def to_text(self) -> str:
        lines = [f"Compatibility of {self.model} ({self.architecture}) with TorchNeuron",
                 f"backend {self.backend}, profile {self.profile}, dtype {self.dtype}", f"verdict: {self.verdict}",
                 ""]
        for title, items in self._sections():
            lines += [f"{title}:", *(f"  - {item}" for item in items), ""]
        return "\n".join(lines).rstrip() + "\n"

    def to_markdown(self) -> str:
        lines = [f"# Compatibility of `{self.model}` with TorchNeuron", "",
                 f"**Verdict: {self.verdict}**", "",
                 f"Architecture `{self.architecture}`, backend `{self.backend}`, profile `{self.profile}`, "
                 f"dtype `{self.dtype}`.", ""]
        for title, items in self._sections():
            lines += [f"## {title}", "", *(f"- {item}" for item in items), ""]
        return "\n".join(lines).rstrip() + "\n"

    def render(self, format: str = "text") -> str:
        """The report as `text`, `json` or `markdown`.

        Raises:
            [`~optimum_neuron_torch.errors.ConfigurationError`]:
                If `format` is none of those.
        """
        renderers = {"text": self.to_text, "json": self.to_json, "markdown": self.to_markdown}
        if format not in renderers:
            raise ConfigurationError(f"unknown report format {format!r}: use one of {', '.join(renderers)}.")
        return renderers[format]()
