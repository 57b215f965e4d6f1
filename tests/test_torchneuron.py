"""The library on TorchNeuron, tested against a stand-in with TorchNeuron's exact Python surface.

`tests/torchneuron_standin/` is a package `torch_neuronx` (with a dist-info folder declaring
TorchNeuron's `torch.backends` and `torch_dynamo_backends` entry points) that runs on the reference
device's kernels. Each test runs a fresh interpreter with it on `PYTHONPATH`, so that PyTorch
autoloads it at `import torch` as it autoloads TorchNeuron, and the library (in `auto` mode) must
detect and use it. Every run also fails if the library touched a `torch.neuron` or `torch_neuronx`
name that TorchNeuron does not have (the stand-in records such look-ups).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import optimum_neuron_torch as ont
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS, tiny_tokenizer

PROGRAMS = 2 * PROGRAMS_PER_GRAPH  # the tiny llama's prefill bucket and decode step
FUNCTIONS = 2  # their compiled functions, saved for warm starts (see `compiler.precompiled`)
# What `compile --batch-sizes 1 --prompt-buckets 16 --max-length 32` compiles: the engine's prefill, chunk (in
# context 32), decode step and decode step that samples, 4 functions, 9 distinct programs (3 shapes, a program
# before the layers and a layer program each; after the layers: the prefill's, the greedy and the sampling step's)
SAVED_FUNCTIONS, SAVED_PROGRAMS = 4, 9

STANDIN = Path(__file__).parent / "torchneuron_standin"
CLI = os.path.join(os.path.dirname(sys.executable), "optimum-cli")

# TorchNeuron's `torch.neuron`, from its source (../shared/design/torchneuron_api.md): public functions and classes.
TORCHNEURON_FUNCTIONS = sorted([
    "is_initialized", "current_device", "set_device", "get_device_name", "device_count", "is_available", "init",
    "get_amp_supported_dtype", "manual_seed_all", "manual_seed", "seed", "seed_all", "initial_seed", "get_rng_state",
    "set_rng_state", "device", "Stream", "stream", "current_stream", "default_stream", "set_stream", "synchronize",
    "wait_stream", "wait_event", "record_event", "query", "Event", "get_device_properties", "reset_peak_memory_stats",
    "memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_accumulated_memory_stats", "memory_summary", "empty_cache", "get_dynamo_metrics", "reset_dynamo_metrics",
    "is_bf16_supported",
])


class TorchNeuron:
    """Runs Python code or the CLI in a fresh interpreter where the stand-in is installed."""

    def __init__(self, root: Path, config: Path):
        self.root = root
        self.config = config
        self.runs = 0

    def environment(self, env: dict[str, str] | None) -> tuple[dict[str, str], Path]:
        self.runs += 1
        misses = self.root / f"misses-{self.runs}.txt"
        inherited = {name: value for name, value in os.environ.items()
                     if name != "OPTIMUM_NEURON_TORCH_BACKEND"}  # auto
        full = {
            **inherited,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")])),
            "TORCH_NEURONX_STANDIN_CONFIG": str(self.config),
            "TORCH_NEURONX_STANDIN_MISSES": str(misses),
            "TORCH_NEURONX_NEFF_CACHE_DIR": str(self.root / "neff_cache"),
            **(env or {}),
        }
        return full, misses

    def _checked(self, result: subprocess.CompletedProcess, misses: Path) -> subprocess.CompletedProcess:
        outside = misses.read_text().split() if misses.exists() else []
        assert outside == [], f"the library used names TorchNeuron does not have: {outside}\n{result.stderr[-3000:]}"
        return result

    def run(self, *command: str, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
        full, misses = self.environment(env)
        result = subprocess.run(command, capture_output=True, text=True, env=full, timeout=timeout, check=False)
        return self._checked(result, misses)

    def python(self, code: str, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(sys.executable, "-c", textwrap.dedent(code), env=env, timeout=timeout)

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(CLI, "neuron-torch", *args, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def torchneuron(tmp_path_factory) -> TorchNeuron:
    root = tmp_path_factory.mktemp("torchneuron")
    # Loaded by path: putting the stand-in on this process's sys.path would make it look installed here.
    spec = importlib.util.spec_from_file_location("standin_make_config", STANDIN / "make_config.py")
    make_config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_config)
    make_config.write_config(root / "config.json")
    return TorchNeuron(root, root / "config.json")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama saved in 3 shards, with a tokenizer."""
    folder = tmp_path_factory.mktemp("llama")
    tiny = TINY_MODELS["llama"]
    tiny.save(folder, shard_size="20KB")
    tiny_tokenizer("llama").save_pretrained(folder)
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


def _cpu_greedy(folder: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([prompt_ids])
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          min_new_tokens=new_tokens)[0].tolist()


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


# ---- the surface ---------------------------------------------------------------------------------------------

def test_reference_torch_neuron_has_exactly_torchneuron_functions(torchneuron):
    reference = sorted(name for name in dir(torch.neuron) if not name.startswith("_"))
    assert reference == TORCHNEURON_FUNCTIONS
    result = torchneuron.python(
        """
        import inspect, json, torch
        print(json.dumps(sorted(n for n in dir(torch.neuron) if not n.startswith("_")
                                and not inspect.ismodule(getattr(torch.neuron, n)))))
        """
    )
    assert result.returncode == 0, result.stderr
    assert _last_json(result.stdout) == TORCHNEURON_FUNCTIONS


def test_what_the_library_needs_beyond_torch_neuron_lives_in_its_device_module():
    for name in ("mem_get_info", "get_rng_state_all", "set_rng_state_all", "get_device_capability",
                 "get_fallback_ops", "get_executed_ops", "clear_op_tracking"):
        assert not hasattr(torch.neuron, name), name
    free, total = ont.device.mem_get_info()
    assert total == torch.neuron.get_device_properties(0).total_memory and 0 < free <= total


# ---- detection --------------------------------------------------------------------------------------------

DETECT = """
import warnings
warnings.simplefilter("always")
import torch
try:
    import optimum_neuron_torch as ont
    info = ont.backend_info()
    print(info.name, info.version, torch.neuron.__name__, torch.neuron.is_initialized())
except Exception as error:
    print(type(error).__name__, error)
"""


def test_the_standin_s_own_helpers_are_misses_for_the_library(torchneuron, tmp_path):
    """Names the stand-in has beyond TorchNeuron's exist only here: the library's lookup of one counts as a
    miss, as a name missing altogether does; TorchNeuron's own names, private ones included, do not."""
    probe = tmp_path / "optimum_neuron_torch" / "probe.py"  # (lookups from the library's files count)
    probe.parent.mkdir()
    probe.write_text("import torch, torch_neuronx\n"
                     "torch_neuronx._lazy_init, torch_neuronx.get_fallback_ops, torch.neuron.manual_seed\n"
                     "torch_neuronx._vnc_count, hasattr(torch.neuron, '_recorded_ops'), hasattr(torch_neuronx, 'x')\n")
    full, misses = torchneuron.environment(None)
    result = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=full, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert misses.read_text().split() == ["torch_neuronx._vnc_count", "torch_neuronx.neuron._recorded_ops",
                                          "torch_neuronx.x"]


def test_autoloaded_torchneuron_is_detected_and_its_runtime_is_not_started(torchneuron):
    result = torchneuron.python(
        """
        import os, torch
        import optimum_neuron_torch as ont
        info = ont.backend_info()
        print(info.name, info.version, torch.neuron.__name__, str(info).startswith("torchneuron"))
        print("initialized after import:", torch.neuron.is_initialized())

        def child_uses_device():
            pid = os.fork()
            if pid == 0:
                try:
                    os._exit(0 if (torch.ones(2, device="neuron") + 1).sum().item() == 4 else 1)
                except BaseException:
                    os._exit(3)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

        print("child after import:", child_uses_device())
        print("memory:", info.device_memory > 0, torch.neuron.is_initialized())
        print("child after the runtime started:", child_uses_device())
        torch.manual_seed(5)
        ones = torch.ones(64, device="neuron")
        drawn = torch.rand(4, device="neuron").cpu(), torch.nn.functional.dropout(ones).cpu()
        torch.manual_seed(5)
        print("random ops and dropout draw from the CPU generator:", torch.equal(drawn[0], torch.rand(4)),
              torch.equal(drawn[1], torch.bernoulli(torch.empty(64, dtype=torch.bool), 0.5) * 2.0))
        """
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "torchneuron 2.13.3.0 torch_neuronx.neuron True"
    # the stand-in refuses a fork after start, as TorchNeuron
    assert lines[1:] == ["initialized after import: False", "child after import: 0", "memory: True True",
                         "child after the runtime started: 3",
                         "random ops and dropout draw from the CPU generator: True True"]


def test_xla_era_torch_neuronx_falls_back_to_the_reference_device_with_one_warning(tmp_path):
    (tmp_path / "torch_neuronx").mkdir()
    (tmp_path / "torch_neuronx" / "__init__.py").write_text("__version__ = '2.1.2.2.3.0'  "
                                                            "# XLA-based: no neuron device\n")
    result = subprocess.run([sys.executable, "-c", DETECT], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "reference"
    assert result.stderr.count("XLA-based torch-neuronx") == 1


def test_torchneuron_without_neuron_cores(torchneuron):
    # Autoloaded: the `neuron` slot is TorchNeuron's, so the error says how to keep it unloaded.
    result = torchneuron.python(DETECT, env={"TORCH_NEURONX_STANDIN_CORES": "0"})
    assert result.stdout.startswith("BackendUnavailableError") and "sees no NeuronCores" in result.stdout
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in result.stdout
    # Not autoloaded, and no /dev/neuron* here: the reference device, with one warning.
    result = torchneuron.python(DETECT, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "reference"
    assert result.stderr.count("TorchNeuron is installed but this machine has no NeuronCores") == 1


@pytest.mark.slow
def test_forcing_a_backend_with_torchneuron_installed(torchneuron):
    result = torchneuron.python(DETECT, env={"OPTIMUM_NEURON_TORCH_BACKEND": "reference"})
    assert result.stdout.startswith("BackendConflictError") and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in result.stdout
    result = torchneuron.python(DETECT, env={"OPTIMUM_NEURON_TORCH_BACKEND": "reference",
                                             "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.stdout.split()[0] == "reference" and "NeuronCores" not in result.stderr
    result = torchneuron.python(DETECT, env={"OPTIMUM_NEURON_TORCH_BACKEND": "torchneuron",
                                             "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.stdout.split()[:3] == ["torchneuron", "2.13.3.0", "torch_neuronx.neuron"], (
        result.stdout + result.stderr)


def test_the_compile_backend_is_torchneuron_s_there_and_the_library_s_on_the_reference_device(torchneuron):
    from importlib.metadata import entry_points

    from optimum_neuron_torch.compiler.dynamo_backend import neuron_backend

    assert torch._dynamo.lookup_backend("neuron") is neuron_backend
    assert not [ep for ep in entry_points(group="torch_dynamo_backends")
                if ep.value.startswith("optimum_neuron_torch")]
    result = torchneuron.python(
        """
        import torch, optimum_neuron_torch
        backend = torch._dynamo.lookup_backend("neuron")
        print(backend.__module__)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "torch_neuronx.neuron_dynamo_backend.backend"


def test_repeated_layers_compile_once_each_through_torchneuron_s_backend(torchneuron):
    """TorchNeuron's compiler cannot take a nested compile region (`invoke_subgraph`): its own
    backend refuses one; `regions.backend` hands it one layer graph and the pieces around it."""
    tests = str(Path(__file__).parent)
    result = torchneuron.python(
        f"""
        import sys, torch, optimum_neuron_torch
        sys.path.insert(0, {tests!r})
        from optimum_neuron_torch.compiler import regions
        from torch_neuronx.neuron_dynamo_backend import backend as standin
        from test_regions import prefill_and_decode
        from tiny_models import TINY_MODELS

        tiny = TINY_MODELS["llama"]
        model = tiny.build().eval().to("neuron")
        with regions.repeated_layers_as_regions(model):
            try:
                prefill_and_decode(model, "neuron")
            except Exception as error:
                print("refused:", type(error).__name__, str(error).splitlines()[1])
            torch._dynamo.reset()
            logits, keys = prefill_and_decode(model, regions.backend)
        cpu_logits, cpu_keys = prefill_and_decode(tiny.build().eval())
        for got, expected in zip([*logits, *keys], [*cpu_logits, *cpu_keys], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        print("compiled:", standin._stats["compiled"])
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("refused: BackendCompilerFailed RuntimeError: Neuron backend NEFF execution setup failed with unexpected "
            "error: Higher-order operation 'invoke_subgraph' not implemented in the FxImporter") in result.stdout
    # Per shape (the prefill, the decode step): before the layers, one layer, after them.
    assert "compiled: 6" in result.stdout, result.stdout


def test_a_graph_torchneuron_cannot_compile_is_refused_by_its_backend_and_split_by_the_library_s(torchneuron):
    """TorchNeuron's backend compiles a graph whole or fails (it never splits); the library's compiled
    paths (`regions.backend`, what generation and `check()` compile with) split such a graph around the
    nodes it cannot take and hand TorchNeuron's backend the pieces, as on the reference device."""
    tests = str(Path(__file__).parent)
    result = torchneuron.python(
        f"""
        import sys, torch, optimum_neuron_torch as ont
        sys.path.insert(0, {tests!r})
        from optimum_neuron_torch.compiler import recording_partitions, regions
        from torch_neuronx.neuron_dynamo_backend import backend as standin
        from test_partition import ComplexRotation

        model, x = ComplexRotation().eval(), torch.randn(2, 8)
        with torch.no_grad():
            expected = model(x)
            model.to("neuron")
            try:
                torch.compile(model, backend="neuron", fullgraph=True)(x.to("neuron"))
            except Exception as error:
                print("refused:", type(error).__name__, str(error).splitlines()[1])
            torch._dynamo.reset()
            compiled = standin._stats["compiled"]
            with recording_partitions() as reports:
                got = torch.compile(model, backend=regions.backend, fullgraph=True)(x.to("neuron"))
        torch.testing.assert_close(got.cpu(), expected)
        print("split:", [(report.compiled_pieces, [node.op for node in report.fallback_nodes]) for report in reports],
              standin._stats["compiled"] - compiled)
        report = ont.check(ComplexRotation(), (x,))
        print("check:", report.compile_error, sorted({{op.op for op in report.unlowered_ops}}))
        """
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.splitlines() == [
        "refused: BackendCompilerFailed RuntimeError: Neuron backend NEFF execution setup failed with unexpected "
        "error: node arg3_1 (arg3_1) computes in torch.complex64, which the Neuron device does not have",
        "split: [(2, ['torch.view_as_complex', '_operator.mul', 'torch.view_as_real'])] 2",
        "check: None ['_operator.mul', 'torch.view_as_complex', 'torch.view_as_real']",
    ]


# ---- models ----------------------------------------------------------------------------------------------

def test_sharded_load_compiled_generate_pipeline_and_check(torchneuron, llama):
    prompt = [5, 17, 42, 9, 77, 3, 101]
    expected = _cpu_greedy(llama, prompt, 8)
    result = torchneuron.python(
        f"""
        import json, os, torch, transformers, optimum_neuron_torch as ont
        from torch_neuronx.neuron_dynamo_backend import backend

        model = ont.NeuronAutoModelForCausalLM.from_pretrained({str(llama)!r})
        devices = sorted({{str(t.device) for t in (*model.parameters(), *model.buffers())}})
        ids = torch.tensor([{prompt}])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                do_sample=False)
        compiled = backend._stats["compiled"]
        again = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False)
        recompiled = backend._stats["compiled"] - compiled
        generator = ont.pipeline("text-generation", model=model,
                                 tokenizer=transformers.AutoTokenizer.from_pretrained({str(llama)!r}))
        text = generator("the capital of france is", max_new_tokens=4, do_sample=False)[0]["generated_text"]
        report = ont.check(model)
        from torch.nn.modules import module as modules
        from optimum_neuron_torch.fallbacks.policy import _after_model_call
        hooks = {{"global": len(modules._global_forward_pre_hooks) + len(modules._global_forward_hooks),
                  "model": [hook is _after_model_call for hook in model._forward_hooks.values()]}}
        print(json.dumps({{"devices": devices, "tokens": tokens[0].tolist(), "again": again[0].tolist(),
                          "compiled": compiled, "recompiled": recompiled, "hooks": hooks,
                          "text": text, "backend": report.backend, "verdict": report.verdict,
                          "stablehlo": report.stablehlo, "compile_error": report.compile_error,
                          "disable_fallback_execution": os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION")}}))
        """
    )
    assert result.returncode == 0, result.stderr[-5000:]
    out = _last_json(result.stdout)
    assert out["devices"] == ["neuron:0"]
    # check() reports TorchNeuron's own lowering and compile of the graphs (the library's Torch-MLIR is not its)
    assert out["compile_error"] is None
    assert re.fullmatch(r"[1-9]\d* graph\(s\) lowered to StableHLO and compiled by TorchNeuron", out["stablehlo"]), \
        out["stablehlo"]
    assert out["disable_fallback_execution"] is None  # (set during the check only)
    # no module of the process observed; the loaded model's fallbacks told after each call
    assert out["hooks"] == {"global": 0, "model": [True]}
    assert out["tokens"] == expected == out["again"]
    assert out["compiled"] >= PROGRAMS and out["recompiled"] == 0  # prefill + decode, through TorchNeuron's backend
    assert out["text"].startswith("the capital of france is")
    assert out["backend"].startswith("torchneuron 2.13.3.0")


@pytest.mark.slow
def test_tensor_parallel_load_with_one_visible_core_per_rank(torchneuron, llama, tmp_path):
    """The usual launch on Trn: each rank sees its own core only (NEURON_RT_VISIBLE_CORES), where
    TorchNeuron's memory queries answer total_memory 0 from rank 1 on and memory_reserved 0. The
    model loads split in two, each rank holds its share, and generates the CPU's tokens."""
    prompt = [5, 17, 42, 9, 77, 3, 101]
    expected = _cpu_greedy(llama, prompt, 6)
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(
        f"""
        import os
        os.environ["NEURON_RT_VISIBLE_CORES"] = os.environ["LOCAL_RANK"]  # (before `import torch` starts it)
        import json, torch, torch.distributed as dist
        from torch.distributed.tensor import DTensor
        import optimum_neuron_torch as ont

        before = torch.neuron.memory_allocated()
        model = ont.NeuronAutoModelForCausalLM.from_pretrained({str(llama)!r}, tp_size=2)
        tensors = {{id(t): t for t in (*model.parameters(), *model.buffers())}}.values()
        share = sum((t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors)
        ids = torch.tensor([{prompt}])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                                do_sample=False)
        device = torch.neuron.current_device()
        line = json.dumps({{"rank": dist.get_rank(), "device": device, "count": torch.neuron.device_count(),
                           "total": torch.neuron.get_device_properties(device).total_memory,
                           "reserved": torch.neuron.memory_reserved(), "share": share,
                           "allocated": torch.neuron.memory_allocated() - before,
                           "split": any(isinstance(t, DTensor) for t in tensors), "tokens": tokens[0].tolist(),
                           "mem_get_info": ont.device.mem_get_info(), "in_use": torch.neuron.memory_allocated()}})
        os.write(1, (line + "\\n").encode())
        dist.destroy_process_group()
        """
    ))
    result = torchneuron.run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), env={"TORCH_NEURONX_STANDIN_CORES": "2"}, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    ranks = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                   key=lambda rank: rank["rank"])
    assert [(rank["rank"], rank["device"], rank["count"], rank["reserved"]) for rank in ranks] == [(0, 0, 2, 0),
                                                                                                 (1, 1, 2, 0)]
    assert ranks[0]["total"] > 0 and ranks[1]["total"] == 0  # (TorchNeuron's answer from rank 1 on)
    # free memory counts what tensors hold (TorchNeuron reserves nothing); unknown is (0, 0), not "full"
    assert ranks[0]["mem_get_info"] == [ranks[0]["total"] - ranks[0]["in_use"], ranks[0]["total"]]
    assert ranks[1]["mem_get_info"] == [0, 0]
    for rank in ranks:
        assert rank["split"] and rank["tokens"] == expected
        assert rank["allocated"] >= rank["share"]  # (its share, plus what generation keeps: the cache)


@pytest.mark.slow
def test_ranks_that_cannot_have_a_core_each_fail_naming_rank_variable_and_fix(torchneuron, llama, tmp_path):
    """Two cores visible to every rank (a launch that forgot the per-rank NEURON_RT_VISIBLE_CORES): TorchNeuron's
    process-group setup refuses; the job fails at once, each rank naming itself, the variable and the fix."""
    script = tmp_path / "ranks.py"
    script.write_text(f"import optimum_neuron_torch as ont\n"
                      f"ont.NeuronAutoModelForCausalLM.from_pretrained({str(llama)!r}, tp_size=2)\n")
    result = torchneuron.run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), env={"TORCH_NEURONX_STANDIN_CORES": "2", "NEURON_RT_VISIBLE_CORES": "0-1"},
                             timeout=300)
    assert result.returncode != 0
    # (torch's launcher stops the other rank once one has failed: it may not get to print its own)
    failed = re.findall(r"ConfigurationError: rank (\d) \(local rank \1\) cannot have a NeuronCore of its own: "
                        r"AssertionError: Attempted to have more than one device per process in distributed setup\. "
                        r"It was launched with NEURON_RT_VISIBLE_CORES='0-1'\. Launch one process per core",
                        result.stderr)
    assert failed and set(failed) <= {"0", "1"}, result.stderr[-3000:]


def machine(tmp_path: Path, name: str) -> dict[str, str]:
    """The environment of machine `name`: a NEFF cache and a compile cache of its own."""
    return {"TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / f"neff_{name}"),
            COMPILE_CACHE_ENV: str(tmp_path / f"cache_{name}")}


@pytest.mark.slow
def test_compile_save_and_reload_carry_torchneuron_s_artifacts(torchneuron, llama, tmp_path):
    saved = tmp_path / "saved"
    compiled = torchneuron.cli("compile", str(llama), "--batch-sizes", "1", "--prompt-buckets", "16",
                               "--max-length", "32",
                               "--save", str(saved), env=machine(tmp_path, "a"))
    assert compiled.returncode == 0, compiled.stderr[-5000:]
    assert "graphs compiled by TorchNeuron" in compiled.stdout
    assert f"saved with TorchNeuron's compiled artifacts ({SAVED_PROGRAMS} neuron_neff)" in compiled.stdout, \
        compiled.stdout
    spec = json.loads((saved / "neuron_generation.json").read_text())
    assert spec["torch_cache_artifacts"] == {"neuron_neff": SAVED_PROGRAMS}
    assert spec["environment"]["backend"] == "torchneuron"

    prompt = [5, 17, 42, 9]
    expected = _cpu_greedy(llama, prompt, 6)
    # Another machine: an empty NEFF cache, filled from the saved artifacts; nothing compiles.
    result = torchneuron.python(
        f"""
        import json, os, torch, optimum_neuron_torch as ont
        from torch_neuronx.neuron_dynamo_backend import backend

        model = ont.NeuronAutoModelForCausalLM.from_pretrained({str(saved)!r})
        neffs = sum(len(files) for _, _, files in os.walk(os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"]))
        ids = torch.tensor([{prompt}])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, eos_token_id=None,
                                do_sample=False)
        print(json.dumps({{"neffs": neffs, "tokens": tokens[0].tolist(), **backend._stats}}))
        """,
        env=machine(tmp_path, "b"),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    out = _last_json(result.stdout)
    assert out["neffs"] == SAVED_PROGRAMS and out["tokens"] == expected
    assert out["compiled"] == 0 and out["neff_cache_hits"] == PROGRAMS  # (the prefill's and the greedy step's)

    # `cache push` / `cache pull` carry TorchNeuron's NEFF cache: a third machine pulls the first's
    # NEFFs and generates with the plain model folder (no saved artifacts), compiling nothing.
    remote_folder = tmp_path / "remote"
    pushed = torchneuron.cli("cache", "push", str(remote_folder),
                             env=machine(tmp_path, "a"))
    # (the NEFFs, and the compiled functions saved for warm starts)
    assert pushed.returncode == 0 and f"pushed {SAVED_PROGRAMS + SAVED_FUNCTIONS} compiled graphs" in pushed.stdout, \
        pushed.stderr[-3000:]
    pulled = torchneuron.cli("cache", "pull", str(remote_folder),
                             env=machine(tmp_path, "c"))
    assert pulled.returncode == 0 and f"pulled {SAVED_PROGRAMS + SAVED_FUNCTIONS} compiled graphs" in pulled.stdout, \
        pulled.stderr[-3000:]
    result = torchneuron.python(
        f"""
        import json, torch, optimum_neuron_torch as ont
        from torch_neuronx.neuron_dynamo_backend import backend

        model = ont.NeuronAutoModelForCausalLM.from_pretrained({str(llama)!r})
        model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=32, show_progress=False, sampling=True)
        ids = torch.tensor([{prompt}])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, eos_token_id=None,
                                do_sample=False)
        print(json.dumps({{"tokens": tokens[0].tolist(), **backend._stats}}))
        """,
        env=machine(tmp_path, "c"),
    )
    assert result.returncode == 0, result.stderr[-5000:]
    out = _last_json(result.stdout)
    # (each of the 4 graphs loads its 3 programs, those the graphs share included)
    assert out["tokens"] == expected and out["compiled"] == 0
    assert out["neff_cache_hits"] == SAVED_FUNCTIONS * PROGRAMS_PER_GRAPH


def test_saving_without_compiled_artifacts_says_so(torchneuron, llama, tmp_path):
    result = torchneuron.python(
        f"""
        import optimum_neuron_torch as ont
        model = ont.NeuronAutoModelForCausalLM.from_pretrained({str(llama)!r})
        model.save_pretrained({str(tmp_path / "saved")!r})
        """
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "TorchNeuron recorded no compiled artifacts in this process" in result.stderr
    assert not (tmp_path / "saved" / "neuron_compiled").exists()


# ---- env and the fallback policy --------------------------------------------------------------------------

@pytest.mark.slow
def test_env_separates_user_settings_from_torchneuron_defaults(torchneuron, tmp_path):
    result = torchneuron.cli("env", "--format", "json",
                             env={"NEURON_RT_DBG_ZEROCOPY": "0",
                                  "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path / "neff")})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"]["name"] == "torchneuron"
    assert report["devices"][0]["name"] == "neuron:0" and report["devices"][0]["memory_bytes"] > 0
    user, defaults = report["environment_variables"], report["torchneuron_defaults"]
    assert user["NEURON_RT_DBG_ZEROCOPY"] == "0" and "NEURON_RT_DBG_ZEROCOPY" not in defaults
    assert defaults["NEURON_LAUNCH_BLOCKING"] == "1" and "NEURON_LAUNCH_BLOCKING" not in user
    assert defaults["TORCH_NEURONX_ENABLE_ASYNC_NRT"] == "1"
    neff = report["neff_cache_variables"]
    assert neff["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neff")
    assert neff["TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR"] == "/tmp/local_cache (default)"
    assert {"TORCH_NEURONX_DISABLE_NEFF_CACHE", "TORCH_NEURONX_NEFF_DISABLE_CACHE"} <= neff.keys()
    text = torchneuron.cli("env", env={"NEURON_RT_DBG_ZEROCOPY": "0"}).stdout
    assert "set by TorchNeuron at import (its defaults):\n" in text and "  NEURON_LAUNCH_BLOCKING=1" in text


@pytest.mark.parametrize("launch_blocking", ["1", "0"], ids=["synchronous", "asynchronous"])
def test_fallback_policy_on_torchneuron(torchneuron, launch_blocking):
    # Asynchronous: the stand-in's tracker shows ops only once synchronize() was called, as queued ops
    # are recorded when they run.
    result = torchneuron.python(
        """
        import os, warnings, torch, optimum_neuron_torch as ont

        class Head(torch.nn.Module):
            def forward(self, x):
                return torch.argmax(x, dim=-1)  # not native on TorchNeuron: falls back

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.body, self.head = torch.nn.Linear(4, 4), Head()
            def forward(self, x):
                return self.head(self.body(x))

        from torch.nn.modules import module as modules
        from optimum_neuron_torch.fallbacks.policy import watch

        net = Net().to("neuron")
        # The default policy observes no module of the process (no global hooks, no wait per call)...
        print("default hooks:", len(modules._global_forward_pre_hooks), len(modules._global_forward_hooks))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = torch.randn(2, 4, device="neuron")  # aten::normal_ falls back outside any module
            net(x)
            print("default, a module of its own:", len([w for w in caught if "fell back" in str(w.message)]))
            watch(net)  # ...but the models the library loads, after each call (here: a model it did not load)
            net(x); net(x)
            torch.neuron.synchronize()
            net(x)  # (asynchronous: what was queued during a call is told after a later one)
        print("default, watched:", [str(w.message).split(";")[0] for w in caught if "fell back" in str(w.message)])
        class Roll(torch.nn.Module):
            def forward(self, x):
                return torch.roll(x, 1)  # not native either

        ont.set_fallback_policy("warn")  # asked for: every module of the watched models is observed
        roll = Roll()
        watch(roll)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            x = torch.sort(x)[0]  # outside any module
            roll(x)
        print("warn:", [str(w.message).split(";")[0] for w in caught if "fell back" in str(w.message)])
        print("policy:", ont.get_fallback_policy(), "ops:", ont.fallback_ops())
        print("observed:", sum(len(m._forward_pre_hooks) for m in (*net.modules(), *roll.modules())),
              "global hooks:", len(modules._global_forward_pre_hooks) + len(modules._global_forward_hooks))
        if os.fork() == 0:  # a forked child cannot use the runtime: nothing observes its modules
            os._exit(sum(len(m._forward_pre_hooks) for m in (*net.modules(), *roll.modules())))
        print("forked child's hooks:", os.WEXITSTATUS(os.wait()[1]))
        with ont.fallback_policy("error"):
            for attempt in range(2):  # the op was seen under warn: it must raise all the same, each time
                try:
                    net(x)
                    print("error: no error")
                except NotImplementedError as error:
                    print("error:", str(error).split(", and")[0])
            print("error, native only:", net.body(x).shape)
            print("backend_info:", ont.backend_info().fallback, ont.backend_info().profile)
        print("backend_info:", ont.backend_info().fallback)
        ont.clear_op_tracking()
        with ont.fallback_policy("silent"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net(x)
        print("silent:", len([w for w in caught if "fell back" in str(w.message)]), ont.fallback_ops(),
              ont.fallback_stats()["aten::argmax.out"])
        """,
        env={"NEURON_LAUNCH_BLOCKING": launch_blocking},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.splitlines() == [
        "default hooks: 0 0",
        "default, a module of its own: 0",
        ("default, watched: [\"Operator 'aten::argmax.out' fell back to CPU (during a call of 'Net')\", "
         "\"Operator 'aten::normal_' fell back to CPU (during a call of 'Net')\"]"),
        ("warn: [\"Operator 'aten::sort.values_stable' fell back to CPU (outside any module)\", "
         "\"Operator 'aten::roll' fell back to CPU (during a call of 'Roll')\"]"),
        "policy: warn ops: ['aten::argmax.out', 'aten::normal_', 'aten::roll', 'aten::sort.values_stable']",
        "observed: 4 global hooks: 0",  # (Net, its body and head, Roll: one pre-hook each)
        "forked child's hooks: 0",
        "error: Operator 'aten::argmax.out' fell back to CPU in module 'Net.head'",
        "error: Operator 'aten::argmax.out' fell back to CPU in module 'Net.head'",
        "error, native only: torch.Size([2, 4])",
        "backend_info: error hardware",
        "backend_info: warn",
        "silent: 0 ['aten::argmax.out'] FallbackStats(calls=None, seconds=None)",
    ]


def test_a_graph_failing_on_the_device_runs_again_eagerly_unless_the_policy_is_error(torchneuron):
    """TorchNeuron re-runs a compiled graph that fails on the device eagerly (a slow success); a user
    who asked for `error` gets the failure instead, and their own setting back afterwards; `check()`
    reports the failure too."""
    result = torchneuron.python(
        """
        import os, torch, optimum_neuron_torch as ont

        double = torch.compile(lambda x: x * 2 + 1, backend="neuron")
        x = torch.ones(3, device="neuron")
        print("warn:", double(x).cpu().tolist(), os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"))
        with ont.fallback_policy("error"):
            try:
                double(x)
                print("error: no error")
            except RuntimeError as error:
                print("error:", str(error).split(" (")[0], os.environ["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"])
        print("after:", double(x).cpu().tolist(), os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"))
        report = ont.check(torch.nn.Linear(3, 3), (torch.ones(2, 3),))  # (check() reports it too)
        print("check:", report.compile_error.startswith("RuntimeError: NRT execution failed"),
              os.environ.get("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"), report.stablehlo)
        """,
        env={"TORCH_NEURONX_STANDIN_FAIL_EXECUTION": "1"},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.splitlines() == ["warn: [3.0, 3.0, 3.0] None",
                                          "error: NRT execution failed: NRT_EXEC_BAD_INPUT 1",
                                          "after: [3.0, 3.0, 3.0] None",
                                          "check: True None 1 graph(s) lowered to StableHLO and compiled by "
                                          "TorchNeuron before the compile error"]
    assert "Falling back to original GraphModule execution" in result.stderr


def test_error_policy_block_refuses_a_fallback_outside_any_module_or_in_compiled_code(torchneuron):
    """TorchNeuron tells the library of a fallback only through its tracker, read at module boundaries:
    a fallback no module's end saw (outside any module, in a compiled function) raises when the
    `fallback_policy("error")` block ends, naming the op."""
    result = torchneuron.python(
        """
        import torch, optimum_neuron_torch as ont

        x = torch.arange(4.0, device="neuron")
        rolled = torch.compile(lambda x: torch.roll(x, 1) * 2, backend="neuron")
        rolled(x)  # compiled (and run) under `warn`
        for name, code in (("outside", lambda: torch.roll(x, 1)), ("compiled", lambda: rolled(x)),
                           ("native only", lambda: x * 2)):
            try:
                with ont.fallback_policy("error"):
                    code()
                print(name, "no error")
            except NotImplementedError as error:
                print(name, str(error).split(", and")[0])
        print(ont.get_fallback_policy())
        """
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.stdout.splitlines() == [
        "outside Operator 'aten::roll' fell back to CPU in code outside any module (or in a compiled function)",
        "compiled Operator 'aten::roll' fell back to CPU in code outside any module (or in a compiled function)",
        "native only no error",
        "warn",
    ]


def test_untested_torch_warns_once(monkeypatch):
    from optimum_neuron_torch.device import reference

    monkeypatch.setattr(reference, "TESTED_TORCH", ("2.99",))
    with pytest.warns(UserWarning, match=r"tested with torch 2\.99, not torch 2\.13"):
        reference._warn_if_untested_torch()


@pytest.mark.slow
def test_the_standin_neuron_process_group_runs_collectives_and_the_library_s_messages_compile_none(
        torchneuron, tmp_path):
    """The `neuron` c10d backend that multi-core code meets on TorchNeuron: two ranks under torchrun, one core
    each. Each collective there is a program compiled for its shapes; the library's own messages between ranks
    (pickled objects of any size) go through the rendezvous store: they compile none, leave no key behind, and a
    rank that never comes is named within the store's timeout."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(
        """
        import os, datetime, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch_neuronx.distributed import _compiled_collectives
        import optimum_neuron_torch as ont
        from optimum_neuron_torch import object_collectives
        from optimum_neuron_torch.errors import RankFailedError
        from optimum_neuron_torch.generation.split_model import gather_keys, share_random_state
        from optimum_neuron_torch.loading.sharding import agree

        dist.init_process_group()  # no backend named: `neuron` for the neuron device
        rank = dist.get_rank()
        x = torch.full((3,), float(rank + 1), device="neuron")
        dist.all_reduce(x)
        gathered = torch.empty(6, device="neuron")
        dist.all_gather_into_tensor(gathered, torch.arange(3.0, device="neuron") + 10 * rank)
        mesh = init_device_mesh("neuron", (2,))
        dist.barrier()
        before = len(_compiled_collectives)
        keys = [gather_keys(mesh, {"k" * (rank + 1) * size}) for size in (1, 10, 100)]
        agree("loading", None)
        torch.manual_seed(rank)
        share_random_state(mesh)
        dist.barrier()
        stores = {dist.distributed_c10d._get_process_group_store(g) for g in (dist.group.WORLD, mesh.get_group())}
        keys_left = sum(s.check([f"optimum_neuron_torch/{n}/{k}"])
                        for s in stores for n in range(9) for k in (0, 1, "read"))
        programs = len(_compiled_collectives) - before
        store = dist.distributed_c10d._get_process_group_store(mesh.get_group())
        dist.barrier()  # (both have counted before rank 0 writes again)
        missing = "-"
        if rank == 0:  # rank 1 never joins this one
            store.set_timeout(datetime.timedelta(seconds=2))
            try:
                object_collectives.all_gather(rank, mesh.get_group(), "a test exchange")
            except RankFailedError as error:
                missing = str(error).replace(" ", "_")
        dist.barrier()
        line = (f"{rank} {ont.backend_info().name} {dist.get_default_backend_for_device('neuron')} "
                f"{torch.neuron.get_device_name(0)} {x.cpu().tolist()} {gathered.cpu().tolist()} "
                f"{programs} {keys_left} {[len(k) for k in keys]} {missing} {torch.rand(1).item()}\\n")
        os.write(1, line.encode())  # one write: the two ranks share stdout
        dist.destroy_process_group()
        """
    ))
    result = torchneuron.run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), env={"TORCH_NEURONX_STANDIN_CORES": "2"}, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    lines = sorted(result.stdout.strip().splitlines())
    assert len({line.split()[-1] for line in lines}) == 1  # rank 1 draws what rank 0 draws
    assert [line.rsplit(" ", 2)[0] for line in lines] == [
        f"{rank} torchneuron neuron neuron:0 [3.0, 3.0, 3.0] [0.0, 1.0, 2.0, 10.0, 11.0, 12.0] 0 0 [2, 2, 2]"
        for rank in (0, 1)]
    assert lines[0].split()[-2] == "rank_0_waited_2_s_for_rank(s)_[1]_of_its_process_group_at_a_test_exchange:_they" \
        "_failed_or_stopped_before_it_(see_their_logs)"
    assert lines[1].split()[-2] == "-"
