"""Per-graph metrics of the `neuron` torch.compile backend, as TorchNeuron records them.

TorchNeuron records one entry per graph its backend receives, NEFF cache hit or not (a hit has no
compile time); `get_dynamo_metrics()` returns them in order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class NeuronCompilationMetrics:
    """Metrics of one graph (times in microseconds)."""

    graph_id: str
    graph_name: str = ""
    model_name: str = ""
    has_collectives: bool = False
    graph_node_count: int = 0
    timestamp: str = ""
    torch_neuronx_fx_passes_us: int = 0
    torch_neuronx_lower_us: int = 0
    torch_neuronx_compile_us: int = 0


_lock = threading.Lock()
_compilation_metrics: list[NeuronCompilationMetrics] = []


def record_compilation(metrics: NeuronCompilationMetrics) -> None:
    """Appends the metrics of one graph."""
    with _lock:
        _compilation_metrics.append(metrics)


def get_dynamo_metrics() -> list[NeuronCompilationMetrics]:
    """The metrics of every graph so far (a copy of the list)."""
    with _lock:
        return list(_compilation_metrics)


def reset_dynamo_metrics() -> None:
    """Forgets the recorded metrics."""
    with _lock:
        _compilation_metrics.clear()
