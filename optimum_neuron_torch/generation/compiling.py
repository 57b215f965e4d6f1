"""How generation compiles its graphs: the compile settings, and the logging calls traced as nothing."""

from __future__ import annotations

import logging

from transformers import CompileConfig

COMPILE_CONFIG = CompileConfig(backend="neuron", fullgraph=True, dynamic=False, mode="default")
# Logging calls Dynamo traces as no-ops in the compiled forward (they still log when run eagerly).
# `warning_once` and `info_once` are the methods Transformers adds to `logging.Logger`.
QUIET_WHILE_TRACED = {getattr(logging.Logger, name)
                      for name in ("debug", "info", "warning", "warning_once", "info_once")
                      if hasattr(logging.Logger, name)}
