"""Backend selection: TorchNeuron when present, the reference device otherwise, clear errors."""

from __future__ import annotations

from testing_utils import run_python


def test_forcing_torchneuron_when_absent_is_a_clear_error():
    result = run_python(
        """
        try:
            import optimum_neuron_torch
        except Exception as error:
            print(type(error).__name__, error)
        """,
        env={"OPTIMUM_NEURON_TORCH_BACKEND": "torchneuron"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("BackendUnavailableError")
    assert "torch_neuronx" in result.stdout and "OPTIMUM_NEURON_TORCH_BACKEND=reference" in result.stdout


def test_forcing_reference_works(tmp_path):
    # An XLA-era torch_neuronx (no `neuron` device) on the path: `auto` also ends on the reference device, but
    # warns why (test_torchneuron.py); forced, the reference device is chosen without a look at it.
    (tmp_path / "torch_neuronx").mkdir()
    (tmp_path / "torch_neuronx" / "__init__.py").write_text("__version__ = '2.1.2.2.3.0'\n")
    code = "import optimum_neuron_torch; print(optimum_neuron_torch.backend_info().name)"
    result = run_python(code, env={"OPTIMUM_NEURON_TORCH_BACKEND": "reference", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "reference"
    assert "torch-neuronx" not in result.stderr and "OPTIMUM_NEURON_TORCH_BACKEND" not in result.stderr


def test_unknown_backend_value_is_rejected():
    result = run_python("import optimum_neuron_torch", env={"OPTIMUM_NEURON_TORCH_BACKEND": "tpu"})
    assert result.returncode == 1
    assert "OPTIMUM_NEURON_TORCH_BACKEND='tpu' must be one of auto, torchneuron, reference" in result.stderr


def test_another_privateuse1_backend_stops_cleanly():
    result = run_python(
        """
        import torch
        torch.utils.rename_privateuse1_backend("otherdev")
        try:
            import optimum_neuron_torch
        except Exception as error:
            print(type(error).__name__, error)
        print("still alive")
        """
    )
    assert result.returncode == 0, result.stderr  # no abort
    first, second = result.stdout.strip().splitlines()
    assert first.startswith("BackendConflictError") and "'otherdev'" in first
    assert second == "still alive"


def test_missing_compiler_is_a_clear_error(tmp_path):
    result = run_python(
        """
        try:
            import optimum_neuron_torch
        except Exception as error:
            print(type(error).__name__, error)
        """,
        env={"CXX": "/nonexistent/g++", "OPTIMUM_NEURON_TORCH_CACHE": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ReferenceDeviceBuildError no C++ compiler found")
    assert "apt-get install g++" in result.stdout


def test_import_does_not_patch_transformers():
    result = run_python(
        """
        import transformers, transformers.modeling_utils as mu, transformers.generation.utils as gu
        before = {name: getattr(mu.PreTrainedModel, name) for name in dir(mu.PreTrainedModel)}
        generate = gu.GenerationMixin.generate
        import optimum_neuron_torch
        unchanged = all(getattr(mu.PreTrainedModel, name) == value for name, value in before.items())
        # torch's PrivateUse1 registration adds Module.neuron(), like Module.cuda(); nothing else changes
        added = set(dir(mu.PreTrainedModel)) - set(before)
        print(unchanged and added == {"neuron"} and gu.GenerationMixin.generate is generate)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
