"""Hub ids resolve through huggingface_hub's own code, against a cache folder laid out the way
huggingface_hub writes it (no hub is reachable here), in offline mode."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from optimum_neuron_torch.errors import CheckpointError
from optimum_neuron_torch.loading import resolve_checkpoint
from testing_utils import run_python
from tiny_models import TINY_MODELS

TINY = TINY_MODELS["llama"]
REPO = "tiny-org/tiny-llama"


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Puts `folder`'s files into `cache` as huggingface_hub does: blobs, a snapshot of symlinks, refs."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for file in folder.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    first = TINY.save(root / "first")
    second = root / "second"
    TINY.build(seed=5).save_pretrained(second)
    sharded = TINY.save(root / "sharded", shard_size="20KB")
    add_to_hub_cache(cache, REPO, first, "a" * 40, refs=("main",))
    add_to_hub_cache(cache, REPO, second, "b" * 40, refs=("v2",))
    add_to_hub_cache(cache, "tiny-org/tiny-llama-sharded", sharded, "c" * 40)
    return cache, first, second


def test_offline_cache_resolution_in_process(hub_cache):
    cache, first, _ = hub_cache
    checkpoint = resolve_checkpoint(REPO, cache_dir=cache, local_files_only=True)
    assert checkpoint.folder.name == "a" * 40 and checkpoint.folder.parent.name == "snapshots"
    model = TINY.neuron_class.from_pretrained(REPO, cache_dir=cache, local_files_only=True)
    assert torch.equal(model.model.norm.weight.cpu(), TINY.build().model.norm.weight)
    assert model.config.name_or_path == REPO


def test_revision_selects_the_snapshot(hub_cache):
    cache, _, _ = hub_cache
    main = TINY.neuron_class.from_pretrained(REPO, cache_dir=cache, local_files_only=True)
    v2 = TINY.neuron_class.from_pretrained(REPO, cache_dir=cache, local_files_only=True, revision="v2")
    assert torch.equal(v2.model.layers[0].mlp.up_proj.weight.cpu(),
                       TINY.build(seed=5).model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(v2.model.layers[0].mlp.up_proj.weight.cpu(), main.model.layers[0].mlp.up_proj.weight.cpu())


def test_sharded_repository_from_the_cache(hub_cache):
    cache, _, _ = hub_cache
    checkpoint = resolve_checkpoint("tiny-org/tiny-llama-sharded", cache_dir=cache, local_files_only=True)
    assert checkpoint.index is not None and len(checkpoint.shards) > 1
    model = TINY.neuron_class.from_pretrained("tiny-org/tiny-llama-sharded", cache_dir=cache, local_files_only=True)
    assert torch.equal(model.lm_head.weight.cpu(), TINY.build().lm_head.weight)


def test_hf_hub_offline_environment_in_a_new_process(hub_cache):
    cache, _, _ = hub_cache
    result = run_python(
        f"""
        import optimum_neuron_torch as ont
        model = ont.NeuronAutoModelForCausalLM.from_pretrained({REPO!r})
        print(type(model).__name__, model.device)
        try:
            ont.NeuronAutoModelForCausalLM.from_pretrained("tiny-org/not-cached")
        except Exception as error:
            print(type(error).__name__, error)
        """,
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
    )
    assert result.returncode == 0, result.stderr
    loaded, missing = result.stdout.strip().splitlines()
    assert loaded == "LlamaForCausalLM neuron:0"
    assert missing.startswith("CheckpointNotFoundError file config.json: config.json of 'tiny-org/not-cached' "
                              "is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in missing


def test_a_name_that_is_neither_folder_nor_repo_id():
    with pytest.raises(CheckpointError, match="neither a local folder nor a Hub repository id"):
        resolve_checkpoint("not a/valid//repo id", local_files_only=True)


@pytest.mark.parametrize("disabled", [False, True])
def test_progress_bar_follows_hf_hub_disable_progress_bars(tmp_path, disabled):
    folder = TINY.save(tmp_path / "m")
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"} if disabled else {"HF_HUB_DISABLE_PROGRESS_BARS": ""}
    result = run_python(
        f"import optimum_neuron_torch as ont; ont.NeuronAutoModelForCausalLM.from_pretrained({str(folder)!r})", env=env
    )
    assert result.returncode == 0, result.stderr
    assert ("Loading" in result.stderr and "B/s" in result.stderr) is not disabled
