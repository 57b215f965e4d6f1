"""The settings module: every environment variable the library reads, its default and its parser
(optimum_neuron_torch.settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimum_neuron_torch import settings
from optimum_neuron_torch.errors import ConfigurationError


@pytest.mark.parametrize(("text", "expected"), [
    ("1", True), ("true", True), (" TRUE ", True), ("yes", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
])
def test_boolean_flags(monkeypatch, text, expected):
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_TEST_FLAG", text)
    assert settings.parse_flag("OPTIMUM_NEURON_TORCH_TEST_FLAG") is expected


def test_a_boolean_flag_that_is_unset_takes_its_default_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("OPTIMUM_NEURON_TORCH_TEST_FLAG", raising=False)
    assert settings.parse_flag("OPTIMUM_NEURON_TORCH_TEST_FLAG") is False
    assert settings.parse_flag("OPTIMUM_NEURON_TORCH_TEST_FLAG", default=True) is True
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_TEST_FLAG", "2")
    with pytest.raises(ConfigurationError, match=r"^OPTIMUM_NEURON_TORCH_TEST_FLAG='2' must be 0 or 1 "):
        settings.parse_flag("OPTIMUM_NEURON_TORCH_TEST_FLAG")


def test_choices(monkeypatch):
    monkeypatch.delenv(settings.FALLBACK_ENV, raising=False)
    assert settings.requested_fallback_mode() == "warn"
    monkeypatch.setenv(settings.FALLBACK_ENV, " Error ")
    assert settings.requested_fallback_mode() == "error"
    monkeypatch.setenv(settings.FALLBACK_ENV, "")
    assert settings.requested_fallback_mode() == "warn"
    monkeypatch.setenv(settings.FALLBACK_ENV, "strict")
    with pytest.raises(ConfigurationError,
                       match=r"^OPTIMUM_NEURON_TORCH_FALLBACK='strict' must be one of warn, error, silent\.$"):
        settings.requested_fallback_mode()
    monkeypatch.setenv(settings.BACKEND_ENV, "cuda")
    with pytest.raises(ConfigurationError, match="must be one of auto, torchneuron, reference"):
        settings.requested_backend()


@pytest.mark.parametrize(("text", "expected"), [
    ("1024", 1024), ("24GiB", 24 * 2**30), ("512 MB", 512 * 10**6), ("1.5kib", 1536), (" 2 tb ", 2 * 10**12),
])
def test_sizes(text, expected):
    assert settings.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "12 parsecs", "-5", "0", "0.1b"])
def test_bad_sizes_name_the_variable(text):
    with pytest.raises(ConfigurationError, match=r"^OPTIMUM_NEURON_TORCH_DEVICE_MEMORY="):
        settings.parse_bytes(text)


def test_cache_folders_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.CACHE_ENV, raising=False)
    monkeypatch.delenv(settings.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.cache_dir() == tmp_path / "xdg" / "optimum-neuron-torch"
    assert settings.compile_cache_dir() == tmp_path / "xdg" / "optimum-neuron-torch" / "compiled"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert settings.cache_dir() == Path.home() / ".cache" / "optimum-neuron-torch"
    monkeypatch.setenv(settings.CACHE_ENV, "~/library")
    assert settings.cache_dir() == Path.home() / "library"
    assert settings.compile_cache_dir() == Path.home() / "library" / "compiled"
    monkeypatch.setenv(settings.COMPILE_CACHE_ENV, "")
    assert settings.compile_cache_dir() == Path.home() / "library" / "compiled"
    monkeypatch.setenv(settings.COMPILE_CACHE_ENV, "~/graphs")
    assert settings.compile_cache_dir() == Path.home() / "graphs"
    monkeypatch.delenv(settings.NEFF_CACHE_ENV, raising=False)
    assert str(settings.neff_cache_dir()) == "/tmp/neff_cache"
    monkeypatch.setenv(settings.NEFF_CACHE_ENV, str(tmp_path))
    assert settings.neff_cache_dir() == tmp_path


def test_reference_device_settings(monkeypatch):
    for name in (settings.DEVICE_MEMORY_ENV, settings.DEVICE_COUNT_ENV, settings.PROFILE_ENV, settings.FALLBACK_ENV,
                 settings.FALLBACK_COPY_ENV):
        monkeypatch.delenv(name, raising=False)
    defaults = settings.reference_device_settings()
    assert defaults.device_count == 1 and defaults.profile == "torchneuron"
    assert defaults.fallback_copies is False
    assert 0 < defaults.device_memory <= settings.TRN2_LOGICAL_CORE_MEMORY
    monkeypatch.setenv(settings.DEVICE_MEMORY_ENV, "1GiB")
    monkeypatch.setenv(settings.DEVICE_COUNT_ENV, "64")
    monkeypatch.setenv(settings.PROFILE_ENV, "full")
    monkeypatch.setenv(settings.FALLBACK_COPY_ENV, "true")
    assert settings.reference_device_settings() == settings.ReferenceDeviceSettings(2**30, 64, "full", True)
    for count in ("0", "65", "two", "-1"):
        monkeypatch.setenv(settings.DEVICE_COUNT_ENV, count)
        with pytest.raises(ConfigurationError, match=rf"^OPTIMUM_NEURON_TORCH_DEVICE_COUNT='{count}' "
                                                     r"must be a whole number from 1 to 64"):
            settings.reference_device_settings()
