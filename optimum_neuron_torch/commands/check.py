"""`optimum-cli neuron-torch check MODEL`: the compatibility report of a model."""

from __future__ import annotations

import sys

from ..check import check


def run_check(model_id: str, format: str = "text", strict: bool = False, patches: bool = True,
              compile: bool = True, sequence_length: int = 16) -> int:
    """Prints the report of `model_id`; returns the exit status (1 with `strict` when anything
    falls back, 2 when the model cannot be checked)."""
    try:
        report = check(model_id, sequence_length=sequence_length, patches=patches, compile=compile)
    except Exception as error:  # one readable line, not a traceback
        print(f"error: cannot check {model_id}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
              file=sys.stderr)
        return 2
    print(report.render(format), end="")
    return 1 if strict and report.falls_back else 0
