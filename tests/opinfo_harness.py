"""The harness that runs PyTorch's OpInfo database on the `neuron` device, compared with the CPU.

The test is tests/test_opinfo.py; the whole sweep runs in CI (under a minute on 2 cores):
`python -m pytest tests/test_opinfo.py -s -n 0` (`-s -n 0` shows the summary: pytest-xdist's
workers do not pass printed output on). Or run the harness directly for a report, which also honours
OPTIMUM_NEURON_TORCH_FALLBACK_COPY=1 (the test pins 0):

    python tests/opinfo_harness.py [--stride N] [--jobs 2] [--max-samples N] [--report out.json] [op_id ...]

What is swept: every OpInfo of `torch.testing._internal.common_methods_invocations.op_db` that
supports float32 on the CPU, with all of its float32 samples (`op.sample_inputs("cpu",
torch.float32, requires_grad=False)`). Each sample runs on the CPU and, with every tensor of
sample.input/args/kwargs moved to `neuron` (recursively; same sizes, strides, storage offset and
memory sharing; `device="cpu"` arguments become `"neuron"`), on the device. Three variants are
compared: the function, its in-place form (`op.inplace_variant`) and its `out=` form (when
`op.supports_out`; the outs start empty so that the kernel resizes them). Results, outs, and inputs
after the op, moved back to the CPU, must match under `torch.testing.assert_close` (equal_nan=True,
dtype and shape checked, the default float32 tolerances); device results must be on `neuron`, and
a result must alias an input (or an out) on the device exactly when it does on the CPU.

The op id is `op.name`, plus `.variant_test_name` when the OpInfo has one (`max.reduction_with_dim`).

What counts:
  * pass: every sample matched.
  * fail: a sample raised on the device, differed, or the worker crashed, hung or ran out of
    memory on that op. Failing ops must be listed in `opinfo_expected_failures.txt` (one op a
    line: `op_id  # reason`), and every listed op must still fail, so the file cannot go stale.
  * skip: the CPU reference itself raised on every sample (or the op has no float32 samples).
    Samples the CPU rejects are skipped one by one. Skipped ops are counted by the harness (in
    its summary), not as pytest skips, and count neither as passes nor as failures.

Random ops: the device has its own generator (`torch.neuron.manual_seed`), separate from the CPU's.
Both are seeded with the same value before each sample, but ops whose output is random
(RANDOM_OPS below: normal, bernoulli, rand_like, dropout, ...) and ops that return uninitialized
memory (empty, empty_like, ...) are compared by shape, dtype and device only, never by value.
Any other op whose values differ is re-run on the CPU with another seed; if the CPU output changes
with the seed, the op is random too and is compared by metadata only (the summary names it). OpInfos
that reseed every generator before each call (`wrapper_set_seed`) are called without the reseed,
so that this detection works for them too (sample by sample: attention with dropout is random,
without it is compared by value).

Isolation: the sweep runs in worker subprocesses, never in the pytest process (which does not
import `torch.testing._internal`), with OPTIMUM_NEURON_TORCH_FALLBACK=silent so that fallback
warnings do not flood. A worker that crashes, hangs (no result for OP_TIMEOUT seconds) or goes
past RSS_LIMIT_BYTES of memory is killed; the op it was running fails with that reason, and a new
worker carries on with the next op.

The test (tests/test_opinfo.py) asserts that at least 97% of the swept ops (pass + fail) pass, that
every failing op is in the expected-failures file, and that every listed op still fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPECTED_FAILURES_FILE = HERE / "opinfo_expected_failures.txt"
FALLBACK_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK"

MIN_PASS_RATE = 0.97
JOBS = 2  # worker processes in parallel (one torch thread each)
OP_TIMEOUT = 300.0  # seconds without progress before a worker is killed as hung
STARTUP_TIMEOUT = 900.0  # seconds for a worker to import (the extension may have to be built)
RSS_LIMIT_BYTES = 8 * 1024**3  # per worker
SEED = 1234

# Ops whose output is random: compared by shape, dtype and device only. The device generator is
# not the CPU generator; both are seeded alike, and on the reference device the values happen to
# match (the summary record says so, `seeded_values_match`), but TorchNeuron draws differently and
# a device path may consume random numbers in another order (dropout takes native_dropout there).
RANDOM_OPS = frozenset({
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "normal.number_mean", "normal.in_place", "uniform",
    "rand_like", "randn_like", "randint_like", "randint", "randn",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.feature_alpha_dropout.without_train",
    "nn.functional.rrelu",
    "svd_lowrank", "pca_lowrank",  # random projections: another draw moves the result by rounding only
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.multi_head_attention_forward",
})

# Ops that return uninitialized memory: compared by shape, dtype and device only.
UNINITIALIZED_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
})

METADATA_ONLY_OPS = RANDOM_OPS | UNINITIALIZED_OPS

# Positional arguments (indices into sample.args) that the op's contract wants on the CPU, as on
# any accelerator: they are not moved.
HOST_ARGS = {
    "tensor_split": (0,),  # tensor_indices_or_sections must be a CPU tensor
}


# ------------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess, imports torch, op_db and optimum_neuron_torch.
# ------------------------------------------------------------------------------------------------


def _op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _swept_ops():
    """{op_id: OpInfo} of every OpInfo that supports float32 on the CPU."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    return {_op_id(op): op for op in op_db if torch.float32 in op.supported_dtypes("cpu")}


class _Mismatch(Exception):
    """Device and CPU results differ; `kind` is 'values' (maybe random) or 'metadata'."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _first_line(text: str, limit: int = 240) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(str(error))}"


def _map_tree(value, fn, memo):
    """Applies `fn` to every tensor in nested lists/tuples/dicts; same object in, same object out."""
    import torch

    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, torch.Tensor):
        result = fn(value)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
        result = type(value)(*(_map_tree(v, fn, memo) for v in value))
    elif isinstance(value, (list, tuple)):
        result = type(value)(_map_tree(v, fn, memo) for v in value)
    elif isinstance(value, dict):
        result = {k: _map_tree(v, fn, memo) for k, v in value.items()}
    elif isinstance(value, torch.device) and value.type == "cpu" and isinstance(fn, _ToDevice):
        result = torch.device("neuron")
    elif isinstance(value, str) and value == "cpu" and isinstance(fn, _ToDevice):
        result = "neuron"
    else:
        result = value
    memo[key] = result
    return result


class _Replicate:
    """Copies tensors keeping their layout: the whole storage is copied once per storage and the
    copy gets the same sizes, strides and storage offset, so non-contiguous, expanded and partial
    views, and tensors that share memory, stay so. `_ToDevice` does the same onto `neuron`."""

    device = "cpu"

    def __init__(self):
        self.storages: dict[int, object] = {}

    def __call__(self, t):
        import torch

        plain = (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_conj() and not t.is_neg()
                 and t.device.type == "cpu" and t.untyped_storage().nbytes() > 0)
        if not plain:
            return t.to(self.device, copy=True)
        storage = t.untyped_storage()
        copied = self.storages.get(storage.data_ptr())
        if copied is None:
            raw = torch.empty(0, dtype=torch.uint8).set_(storage)
            copied = raw.to(self.device, copy=True).untyped_storage()
            self.storages[storage.data_ptr()] = copied
        result = torch.empty(0, dtype=t.dtype, device=self.device)
        result.set_(copied, t.storage_offset(), t.size(), t.stride())
        return result


class _ToDevice(_Replicate):
    device = "neuron"


def _mentions_device(value) -> bool:
    """Whether a (moved) sample holds a neuron tensor or names the neuron device: if not, the op
    runs exactly as on the CPU and its results rightly stay there (arange(3))."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.device.type == "neuron"
    if isinstance(value, torch.device):
        return value.type == "neuron"
    if isinstance(value, str):
        return value == "neuron"
    if isinstance(value, (list, tuple)):
        return any(_mentions_device(v) for v in value)
    if isinstance(value, dict):
        return any(_mentions_device(v) for v in value.values())
    return False


def _call(op, args):
    inp, pos, kw = args
    return op(inp, *pos, **kw)


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _storage_ptr(t) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # sparse and other layouts without storage
        return -1


def _compare(expected, actual, path: str, metadata_only: bool, on_device: bool = True) -> None:
    """Raises _Mismatch when `actual` (device) does not match `expected` (CPU)."""
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise _Mismatch("metadata", f"{path}: expected a tensor, got {type(actual).__name__}")
        if on_device and expected.device.type == "cpu" and actual.device.type != "neuron":
            raise _Mismatch("metadata", f"{path}: result on {actual.device}, expected on neuron")
        if actual.dtype != expected.dtype:
            raise _Mismatch("metadata", f"{path}: dtype {actual.dtype} != {expected.dtype}")
        if actual.shape != expected.shape:
            raise _Mismatch("metadata", f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
        if actual.layout != expected.layout:
            raise _Mismatch("metadata", f"{path}: layout {actual.layout} != {expected.layout}")
        if metadata_only:
            return
        try:
            torch.testing.assert_close(actual.cpu(), expected, equal_nan=True, check_dtype=True)
        except AssertionError as error:
            detail = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise _Mismatch("values", f"{path}: " + "; ".join(detail[:3])) from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise _Mismatch("metadata", f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _compare(e, a, f"{path}[{index}]", metadata_only, on_device)
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            raise _Mismatch("metadata", f"{path}: dict keys differ")
        for k in expected:
            _compare(expected[k], actual[k], f"{path}[{k!r}]", metadata_only, on_device)
        return
    if isinstance(expected, (bool, int, float, complex)) and not metadata_only:
        if isinstance(actual, torch.Tensor) or not isinstance(actual, (bool, int, float, complex)):
            raise _Mismatch("metadata", f"{path}: expected {type(expected).__name__}, got {type(actual).__name__}")
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True, check_dtype=False)
        except AssertionError as error:
            raise _Mismatch("values", f"{path}: {_first_line(str(error))} ({actual!r} != {expected!r})") from None
        return
    if metadata_only:
        return
    if type(expected) is not type(actual) or expected != actual:
        raise _Mismatch("values", f"{path}: {actual!r} != {expected!r}")


def _compare_inputs(expected_args, actual_args, metadata_only: bool, on_device: bool = True) -> None:
    """Inputs after the op (in-place ops and ops with mutated arguments): tensors only."""
    expected = list(_tensors(expected_args))
    actual = list(_tensors(actual_args))
    if len(expected) != len(actual):
        raise _Mismatch("metadata", f"{len(actual)} input tensors on the device, {len(expected)} on the CPU")
    for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
        _compare(e, a, f"input tensor {index} (after the op)", metadata_only, on_device)


def _check_aliasing(cpu_args, cpu_out, dev_args, dev_out) -> None:
    """A result that views an input's storage on the CPU must view the same input on the device."""
    cpu_in = list(_tensors(cpu_args))
    dev_in = list(_tensors(dev_args))
    if len(cpu_in) != len(dev_in):
        return
    cpu_res = list(_tensors(cpu_out))
    dev_res = list(_tensors(dev_out))
    if len(cpu_res) != len(dev_res):
        return
    for index, (c, d) in enumerate(zip(cpu_res, dev_res, strict=True)):
        cpu_ptr = _storage_ptr(c)
        if cpu_ptr in (-1, 0):
            continue
        for k, (ci, di) in enumerate(zip(cpu_in, dev_in, strict=True)):
            if _storage_ptr(ci) == cpu_ptr and ci.numel() > 0 and c.numel() > 0:
                if _storage_ptr(d) != _storage_ptr(di):
                    raise _Mismatch(
                        "metadata",
                        f"output[{index}] is a view of input tensor {k} on the CPU but not on the device",
                    )
                break
        else:
            for k, (_, di) in enumerate(zip(cpu_in, dev_in, strict=True)):
                if d.numel() > 0 and di.numel() > 0 and _storage_ptr(d) == _storage_ptr(di) not in (-1, 0):
                    raise _Mismatch(
                        "metadata",
                        f"output[{index}] shares memory with input tensor {k} on the device but not on the CPU",
                    )


class _Failed(Exception):
    """An op variant failed on a sample; the message is the reason."""


def _variants(op):
    """(name, call) of the variants to compare: the function, its in-place form, its out= form.
    `call(args, like)` runs the variant on `args`; `like` is the function's CPU result."""
    yield "function", lambda args, like: _call(op, args)
    if getattr(op, "inplace_variant", None) is not None:
        yield "inplace", lambda args, like: _call(op.inplace_variant, args)
    if getattr(op, "supports_out", False):
        yield "out=", lambda args, like: _call_out(op, args, like)


def _call_out(op, args, like):
    """Runs `op(..., out=...)` with empty out tensors (so the kernel resizes them) on the device
    of the arguments; returns (result, outs)."""
    import torch

    if isinstance(like, torch.Tensor):
        template = like
    elif isinstance(like, (tuple, list)) and like and all(isinstance(t, torch.Tensor) for t in like):
        template = tuple(like)
    else:
        raise _NotApplicable
    device = "neuron" if _mentions_device(args) else "cpu"
    outs = _map_tree(template, lambda t: torch.empty(0, dtype=t.dtype, device=device), {})
    inp, pos, kw = args
    return op(inp, *pos, out=outs, **kw), outs


class _NotApplicable(Exception):
    """The variant does not apply to this sample."""


def _move_sample(original, op_id: str, replicate):
    moved = _map_tree(original, replicate, {})
    if op_id in HOST_ARGS and isinstance(replicate, _ToDevice):  # these arguments stay on the CPU
        positional = list(moved[1])
        for position in HOST_ARGS[op_id]:
            if position < len(positional):
                positional[position] = _map_tree(original[1][position], _Replicate(), {})
        moved = (moved[0], tuple(positional), moved[2])
    return moved


def _run_sample(op, op_id, index, original, metadata_only, stats) -> bool:
    """Runs every variant on one sample. Returns False when the CPU rejects the sample (function
    variant); raises _Failed on a device failure."""
    import torch

    pristine = _map_tree(original, _Replicate(), {})
    cpu_function_out = None
    for variant, call in _variants(op):
        prefix = "" if variant == "function" else f"[{variant}] "
        cpu_args = original if variant == "function" else _move_sample(pristine, op_id, _Replicate())
        try:
            dev_args = _move_sample(pristine, op_id, _ToDevice())
        except Exception as error:  # noqa: BLE001
            raise _Failed(f"{prefix}moving the sample to neuron: {_describe(error)}") from None
        on_device = _mentions_device(dev_args)

        torch.manual_seed(SEED + index)
        try:
            cpu_out = call(cpu_args, cpu_function_out)
        except _NotApplicable:
            continue
        except Exception as error:  # noqa: BLE001 - the CPU rejects this sample: not comparable
            if variant == "function":
                stats["cpu_errors"].append(_describe(error))
                return False
            continue
        if variant == "function":
            cpu_function_out = cpu_out

        torch.manual_seed(SEED + index)
        torch.neuron.manual_seed(SEED + index)
        try:
            dev_out = call(dev_args, cpu_function_out)
        except Exception as error:  # noqa: BLE001
            raise _Failed(prefix + _describe(error)) from None

        # out=: the outs are compared like results and must be what the op returns.
        cpu_in, dev_in = cpu_args, dev_args
        if variant == "out=":
            (cpu_out, cpu_outs), (dev_out, dev_outs) = cpu_out, dev_out
            cpu_in, dev_in = (cpu_args, cpu_outs), (dev_args, dev_outs)
        try:
            _compare(cpu_out, dev_out, "output", metadata_only, on_device)
            _compare_inputs(cpu_in, dev_in, metadata_only, on_device=False)
            _check_aliasing(cpu_in, cpu_out, dev_in, dev_out)
        except _Mismatch as mismatch:
            if mismatch.kind != "values":
                raise _Failed(prefix + str(mismatch)) from None
            # Random after all? Re-run the CPU reference with another seed.
            torch.manual_seed(SEED + index + 1_000_003)
            try:
                rerun_args = _move_sample(pristine, op_id, _Replicate())
                rerun = call(rerun_args, cpu_function_out)
                if variant == "out=":
                    rerun = rerun[0]
                _compare(cpu_out, rerun, "output", False, on_device=False)
                _compare_inputs(cpu_args, rerun_args, False, on_device=False)
            except Exception:  # noqa: BLE001 - the CPU output depends on the seed
                stats["random_detected"] = True
                try:
                    _compare(cpu_out, dev_out, "output", True, on_device)
                except _Mismatch as again:
                    raise _Failed(prefix + str(again)) from None
            else:
                raise _Failed(f"{prefix}values differ: {mismatch}") from None
        if metadata_only and stats["values_match"]:
            try:
                _compare(cpu_out, dev_out, "output", False, on_device)
            except _Mismatch:
                stats["values_match"] = False
        stats["variants"].add(variant)
    return True


def _run_op(op, op_id: str, max_samples: int | None) -> dict:
    import torch

    metadata_only = op_id in METADATA_ONLY_OPS
    torch.manual_seed(SEED)
    start = time.monotonic()
    done = skipped = 0
    # values_match: for metadata-only ops, whether the seeded values matched all the same
    stats = {"random_detected": False, "values_match": True, "cpu_errors": [], "variants": set()}
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=False)
        for index, sample in enumerate(samples):
            if max_samples is not None and index >= max_samples:
                break
            original = (sample.input, tuple(sample.args), dict(sample.kwargs))
            try:
                ran = _run_sample(op, op_id, index, original, metadata_only, stats)
            except _Failed as failure:
                return _result(op_id, "fail", str(failure), done, skipped, start, sample=index)
            if ran:
                done += 1
            else:
                skipped += 1
    except Exception as error:  # noqa: BLE001 - sample generation itself failed
        if done == 0:
            return _result(op_id, "skip", f"sample generation raised {_describe(error)}", done, skipped, start)
        reason = f"sample generation raised {_describe(error)} after {done} samples"
        return _result(op_id, "fail", reason, done, skipped, start)
    if done == 0:
        cpu_errors = stats["cpu_errors"]
        reason = (f"the CPU reference raised on all {skipped} samples ({cpu_errors[0]})" if skipped
                  else "no float32 samples")
        return _result(op_id, "skip", reason, done, skipped, start)
    result = _result(op_id, "pass", "", done, skipped, start)
    result["variants"] = sorted(stats["variants"])
    result["metadata_only"] = metadata_only or stats["random_detected"]
    result["random_detected"] = stats["random_detected"]
    if metadata_only:
        result["seeded_values_match"] = stats["values_match"]
    return result


def _result(op_id, status, reason, done, skipped, start, sample=None) -> dict:
    result = {"op": op_id, "status": status, "reason": reason, "samples": done, "cpu_skipped": skipped,
              "seconds": round(time.monotonic() - start, 3)}
    if sample is not None:
        result["sample"] = sample
    return result


def _keep_the_harness_seeds() -> None:
    """Some OpInfos call their op through `wrapper_set_seed`, which seeds every generator with 42
    before each call. The harness seeds CPU and device itself, and re-runs the CPU reference with
    another seed to tell a random result from a wrong one: a wrapper that reseeds would hide the
    difference (the CPU output never changes), and an op random only for some samples (attention
    with dropout) would fail as wrong. In the worker process only, the wrapper calls the op as is."""
    from torch.testing._internal import common_methods_invocations

    common_methods_invocations.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)


def _worker_main(out_path: str, op_ids: list[str], max_samples: int | None, threads: int) -> None:
    import warnings

    os.environ[FALLBACK_ENV] = "silent"
    import torch

    import optimum_neuron_torch  # noqa: F401 - registers the neuron device

    warnings.simplefilter("ignore")
    if threads > 0:
        torch.set_num_threads(threads)
    _keep_the_harness_seeds()
    ops = _swept_ops()
    with open(out_path, "a", buffering=1) as out:
        out.write(json.dumps({"ready": os.getpid()}) + "\n")
        for op_id in op_ids:
            out.write(json.dumps({"start": op_id}) + "\n")
            if op_id not in ops:
                result = _result(op_id, "fail", "no such OpInfo with float32 support", 0, 0, time.monotonic())
            else:
                result = _run_op(ops[op_id], op_id, max_samples)
            out.write(json.dumps(result) + "\n")


def _list_main() -> None:
    os.environ[FALLBACK_ENV] = "silent"
    import optimum_neuron_torch  # noqa: F401 - builds the extension once, before the workers start

    print(json.dumps(sorted(_swept_ops())))


# ------------------------------------------------------------------------------------------------
# Parent side: no torch import needed; schedules workers and survives their crashes and hangs.
# ------------------------------------------------------------------------------------------------


FALLBACK_COPY_ENV = "OPTIMUM_NEURON_TORCH_FALLBACK_COPY"
# What the tests pin in the workers, so that the expected failures do not depend on the caller's
# environment: the default zero-copy fallback. (Run the harness directly to sweep another mode.)
PINNED_ENV = {FALLBACK_COPY_ENV: "0"}


def _worker_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides or {})
    env[FALLBACK_ENV] = "silent"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def list_ops() -> list[str]:
    """Sorted ids of every OpInfo that supports float32 on the CPU (computed in a subprocess)."""
    proc = subprocess.run([sys.executable, __file__, "--list"], env=_worker_env(), capture_output=True,
                          text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"listing the OpInfos failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class _Lane:
    """One worker slot: the ops it still has to run, and its current process."""

    pending: list[str]
    max_samples: int | None
    threads: int
    env: dict[str, str]
    out_path: str = ""
    proc: subprocess.Popen | None = None
    offset: int = 0
    current: str | None = None
    ready: bool = False
    start_failures: int = 0
    last_progress: float = 0.0
    stderr_path: str = ""
    results: dict[str, dict] = field(default_factory=dict)

    def start(self, tmpdir: str, serial: int) -> None:
        self.out_path = os.path.join(tmpdir, f"lane{id(self)}-{serial}.jsonl")
        self.stderr_path = self.out_path + ".stderr"
        self.offset = 0
        self.current = None
        self.ready = False
        args = [sys.executable, __file__, "--worker", "--out", self.out_path, "--threads", str(self.threads)]
        if self.max_samples is not None:
            args += ["--max-samples", str(self.max_samples)]
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(args + self.pending, env=self.env, stdout=subprocess.DEVNULL,
                                         stderr=err)
        self.last_progress = time.monotonic()

    def poll_output(self) -> None:
        if not os.path.exists(self.out_path):
            return
        with open(self.out_path) as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.offset = f.tell()
                record = json.loads(line)
                self.last_progress = time.monotonic()
                if "ready" in record:
                    self.ready = True
                elif "start" in record:
                    self.current = record["start"]
                else:
                    self.results[record["op"]] = record
                    if self.pending and self.pending[0] == record["op"]:
                        self.pending.pop(0)
                    self.current = None

    def stderr_tail(self) -> str:
        try:
            return _first_line(Path(self.stderr_path).read_text()[-2000:].strip().splitlines()[-1])
        except (OSError, IndexError):
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_sweep(op_ids: list[str], *, max_samples: int | None = None, jobs: int = JOBS,
              op_timeout: float = OP_TIMEOUT, rss_limit: int = RSS_LIMIT_BYTES, verbose: bool = False,
              env: dict[str, str] | None = None) -> dict[str, dict]:
    """Runs `op_ids` in `jobs` worker processes; returns {op_id: result record}. `env` overrides
    environment variables of the workers (the fallback mode is always silent)."""
    jobs = max(1, min(jobs, len(op_ids)))
    threads = 1 if jobs > 1 else 0
    worker_env = _worker_env(env)
    lanes = [_Lane(op_ids[i::jobs], max_samples, threads, worker_env) for i in range(jobs)]
    serial = 0
    with tempfile.TemporaryDirectory(prefix="opinfo-") as tmpdir:
        for lane in lanes:
            serial += 1
            lane.start(tmpdir, serial)
        try:
            while any(lane.proc is not None for lane in lanes):
                time.sleep(0.2)
                for lane in lanes:
                    if lane.proc is None:
                        continue
                    lane.poll_output()
                    rc = lane.proc.poll()
                    problem = None
                    if rc is not None:
                        lane.poll_output()
                        if rc == 0 and not lane.pending:
                            lane.proc = None
                            continue
                        tail = lane.stderr_tail()
                        problem = f"worker crashed (exit status {rc}){': ' + tail if tail else ''}"
                    elif time.monotonic() - lane.last_progress > (op_timeout if lane.ready else STARTUP_TIMEOUT):
                        problem = f"timeout: no result after {op_timeout:.0f} s (hang or too slow)"
                    elif _rss_bytes(lane.proc.pid) > rss_limit:
                        problem = f"worker memory above {rss_limit / 2**30:.0f} GiB"
                    if problem is None:
                        continue
                    lane.kill()
                    if not lane.ready:  # died while importing: not the fault of an op
                        lane.start_failures += 1
                        if lane.start_failures > 2:
                            raise RuntimeError(f"the OpInfo worker does not start: {problem}")
                        serial += 1
                        lane.start(tmpdir, serial)
                        continue
                    victim = lane.current or (lane.pending[0] if lane.pending else None)
                    if victim is not None:
                        lane.results[victim] = {"op": victim, "status": "fail", "reason": problem, "samples": 0,
                                                "cpu_skipped": 0, "seconds": None}
                        if victim in lane.pending:
                            lane.pending.remove(victim)
                        if verbose:
                            print(f"[opinfo] {victim}: {problem}", file=sys.stderr, flush=True)
                    if lane.pending:
                        serial += 1
                        lane.start(tmpdir, serial)
                    else:
                        lane.proc = None
        finally:
            for lane in lanes:
                lane.kill()
    results: dict[str, dict] = {}
    for lane in lanes:
        results.update(lane.results)
    return results


def read_expected_failures(path: Path | None = None) -> dict[str, str]:
    """{op_id: reason} from the expected-failures file (`op_id  # reason`, `#` lines are comments)."""
    path = EXPECTED_FAILURES_FILE if path is None else path
    expected: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op_id, _, reason = line.partition("#")
        op_id = op_id.strip()
        assert op_id and " " not in op_id and "\t" not in op_id, f"{path.name}:{number}: bad line {raw!r}"
        assert reason.strip(), f"{path.name}:{number}: {op_id} has no reason (write `{op_id}  # why it fails`)"
        assert op_id not in expected, f"{path.name}:{number}: {op_id} listed twice"
        expected[op_id] = reason.strip()
    return expected


@dataclass
class Summary:
    swept: int
    passed: list[str]
    failed: list[str]
    skipped: list[str]
    metadata_only: list[str]
    random_detected: list[str]
    seconds: float

    @property
    def pass_rate(self) -> float:
        counted = len(self.passed) + len(self.failed)
        return len(self.passed) / counted if counted else 1.0

    def text(self, results: dict[str, dict]) -> str:
        lines = [
            f"OpInfo sweep: {self.swept} ops, {len(self.passed)} pass, {len(self.failed)} fail, "
            f"{len(self.skipped)} skipped (CPU reference raised), pass rate {self.pass_rate:.2%} "
            f"of {len(self.passed) + len(self.failed)}, {self.seconds:.0f} s",
            f"  compared by metadata only: {len(self.metadata_only)} "
            f"(random detected at run time: {', '.join(self.random_detected) or 'none'})",
        ]
        for op_id in self.failed:
            lines.append(f"  FAIL {op_id}: {results[op_id]['reason']}")
        for op_id in self.skipped:
            lines.append(f"  skip {op_id}: {results[op_id]['reason']}")
        return "\n".join(lines)


def summarize(results: dict[str, dict], seconds: float) -> Summary:
    by_status = {"pass": [], "fail": [], "skip": []}
    for op_id in sorted(results):
        by_status[results[op_id]["status"]].append(op_id)
    metadata_only = sorted(op for op in by_status["pass"] if results[op].get("metadata_only"))
    random_detected = sorted(op for op in by_status["pass"] if results[op].get("random_detected"))
    return Summary(len(results), by_status["pass"], by_status["fail"], by_status["skip"], metadata_only,
                   random_detected, seconds)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-samples", type=int, default=None, help="samples per op (default: all)")
    parser.add_argument("--stride", type=int, default=1, help="run every N-th op of the sorted list")
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--timeout", type=float, default=OP_TIMEOUT, help="seconds per op before a kill")
    parser.add_argument("--report", help="write the per-op results as JSON here")
    parser.add_argument("ops", nargs="*", help="op ids (default: all)")
    args = parser.parse_args(argv)
    if args.list:
        _list_main()
        return 0
    if args.worker:
        _worker_main(args.out, args.ops, args.max_samples, args.threads)
        return 0
    all_ops = list_ops()
    op_ids = args.ops or sorted(all_ops)[:: args.stride]
    start = time.monotonic()
    results = run_sweep(op_ids, max_samples=args.max_samples, jobs=args.jobs, op_timeout=args.timeout, verbose=True)
    summary = summarize(results, time.monotonic() - start)
    print(summary.text(results))
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=1, sort_keys=True))
    expected = read_expected_failures() if EXPECTED_FAILURES_FILE.exists() else {}
    unexpected = [op for op in summary.failed if op not in expected]
    stale = [op for op in op_ids if op in expected and results.get(op, {}).get("status") != "fail"]
    print(f"not in the expected-failures file: {unexpected or 'none'}")
    print(f"listed but not failing: {stale or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
