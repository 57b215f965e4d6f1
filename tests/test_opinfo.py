"""PyTorch's OpInfo database run on the `neuron` device, compared with the CPU: at least 97% of the
swept ops pass, every failing op is listed in `opinfo_expected_failures.txt` (with its reason) and
every listed op still fails. What is swept and compared, and how, is in the harness,
tests/opinfo_harness.py (`python -m pytest tests/test_opinfo.py -s -n 0` prints the summary)."""

from __future__ import annotations

import time

import pytest

from opinfo_harness import (
    EXPECTED_FAILURES_FILE,
    MIN_PASS_RATE,
    PINNED_ENV,
    list_ops,
    read_expected_failures,
    run_sweep,
    summarize,
)

pytestmark = pytest.mark.slow  # PyTorch's whole OpInfo database


def test_opinfo_sweep():
    all_ops = list_ops()
    assert len(all_ops) > 500, f"only {len(all_ops)} float32 OpInfos found"
    expected = read_expected_failures()
    unknown = sorted(set(expected) - set(all_ops))
    assert not unknown, f"{EXPECTED_FAILURES_FILE.name} lists ops that are not swept OpInfos: {unknown}"

    start = time.monotonic()
    results = run_sweep(sorted(all_ops), env=PINNED_ENV)
    missing = sorted(set(all_ops) - set(results))
    assert not missing, f"no result for {missing}"
    summary = summarize(results, time.monotonic() - start)
    print(f"\n[{len(all_ops)} ops swept]")
    print(summary.text(results))

    unexpected = [op for op in summary.failed if op not in expected]
    stale = [op for op in expected if results[op]["status"] != "fail"]
    problems = []
    if unexpected:
        problems.append(
            f"{len(unexpected)} op(s) fail but are not in {EXPECTED_FAILURES_FILE.name}:\n"
            + "\n".join(f"{op}  # {results[op]['reason']}" for op in unexpected))
    if stale:
        problems.append(
            f"{len(stale)} op(s) in {EXPECTED_FAILURES_FILE.name} no longer fail (remove them):\n"
            + "\n".join(f"{op}: {results[op]['status']} {results[op]['reason']}" for op in stale))
    if summary.pass_rate < MIN_PASS_RATE:
        problems.append(f"pass rate {summary.pass_rate:.2%} is below {MIN_PASS_RATE:.0%}")
    assert not problems, "\n\n".join(problems)
