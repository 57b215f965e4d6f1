"""`optimum-cli neuron-torch check MODEL`: the compatibility report of a model."""

from __future__ import annotations

from ..compatibility import check


def run_check(model_id: str, format: str = "text", strict: bool = False, patches: bool = True,
              compile: bool = True, sequence_length: int = 16, training: bool = False,
              dtype: str | None = None) -> int:
    """Prints the report of `model_id` (loaded in `dtype`; None: the checkpoint's); returns the exit
    status (1 with `strict` when anything falls back)."""
    report = check(model_id, sequence_length=sequence_length, patches=patches, compile=compile, training=training,
                   dtype=dtype)
    print(report.render(format), end="")
    return 1 if strict and report.falls_back else 0
