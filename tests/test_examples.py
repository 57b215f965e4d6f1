"""The examples run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_quickstart_generates_the_cpu_tokens_on_neuron():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--new-tokens", "8"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "generated on neuron:0" in result.stdout
    assert "same tokens as on the CPU: True" in result.stdout
    assert "fell back to CPU" in result.stderr  # the default policy warns once per op
