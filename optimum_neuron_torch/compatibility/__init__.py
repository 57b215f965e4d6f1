"""The compatibility report: what a model hits on TorchNeuron (fallbacks, graph breaks, lowering
failures, dtypes, patches) and a verdict, before anyone rents a Trn instance."""

from .report import BLOCKED, NEEDS_PATCHES, RUNS_NATIVELY, RUNS_WITH_FALLBACKS, CompatibilityReport
from .runner import check, default_inputs

__all__ = [
    "BLOCKED",
    "NEEDS_PATCHES",
    "RUNS_NATIVELY",
    "RUNS_WITH_FALLBACKS",
    "CompatibilityReport",
    "check",
    "default_inputs",
]
