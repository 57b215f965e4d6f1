"""Fine-tuning on `neuron` with Transformers' Trainer: the same runs on the CPU and on `neuron`
(one process, DDP and FSDP2 over two ranks) agree step by step; checkpoints resume exactly (at
another world size for FSDP2); compiled steps stop recompiling; LoRA round trips; bf16 trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from training_programs import dataset, train
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.training import SAVE_RANDOM_OPS, BucketingDataCollator, trainer_integration
from optimum_neuron_torch.training.activation_checkpointing import _save_random_ops, with_random_ops_saved
from testing_utils import launch
from tiny_models import TINY_MODELS

PROGRAM = str(Path(__file__).parent / "training_programs.py")
STEPS = 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return TINY_MODELS["llama"].save(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cpu_run(folder, tmp_path_factory) -> dict:
    """The reference: Transformers' model and Trainer on the CPU, one process, batches of 4."""
    return train(folder, tmp_path_factory.mktemp("cpu"), device="cpu", steps=STEPS)


def _assert_same_losses(run: dict, reference: dict, steps=range(1, STEPS + 1)) -> None:
    for step in steps:
        assert abs(run["losses"][str(step)] - reference["losses"][str(step)]) < 1e-4, (step, run, reference)


def _launch(tmp_path: Path, folder: Path, world: int, **options) -> dict:
    out = tmp_path / f"result-{world}.json"
    launch(world, PROGRAM, str(out), str(folder), *(f"{key}={json.dumps(value)}" for key, value in options.items()))
    return json.loads(out.read_text())


def _jsonable(run: dict) -> dict:
    return json.loads(json.dumps(run))  # step keys as strings, as the launched runs return them


def test_plain_trainer_trains_on_neuron_like_the_cpu(folder, cpu_run, tmp_path):
    run = _jsonable(train(folder, tmp_path, steps=STEPS))
    assert run["device"] == "neuron:0" and run["devices"] == ["neuron"]  # never silently on the CPU
    assert cpu_run["device"] == "cpu" and cpu_run["devices"] == ["cpu"]
    _assert_same_losses(run, _jsonable(cpu_run))


def _floor(package: str) -> str:
    """The lowest version of `package` that pyproject.toml accepts."""
    text = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    return re.search(rf'^\s*"{package}>=([^,"]+)', text, re.MULTILINE).group(1)


@pytest.mark.slow
def test_the_oldest_transformers_and_accelerate_accepted_train_on_neuron_like_the_newest(folder, cpu_run, tmp_path):
    """The floor pyproject.toml declares (the first releases that choose `neuron` themselves) trains on
    `neuron`, compiled as Trainer compiles it, like the CPU: the library builds on their support, with the
    same adjustment as with the newest releases (the other tests)."""
    oldest = tmp_path / "oldest"
    versions = {"transformers": _floor("transformers"), "accelerate": _floor("accelerate")}
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(oldest),
                    *(f"{package}=={version}" for package, version in versions.items())], check=True, timeout=600)
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, PROGRAM, str(out), str(folder), f"output_dir={json.dumps(str(tmp_path / 'out'))}",
         "steps=6", "torch_compile=true"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(oldest), str(Path(__file__).parent)])},
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-5000:]
    run = json.loads(out.read_text())
    assert {package: Version(version) for package, version in run["versions"].items()} == {
        package: Version(version) for package, version in versions.items()}
    assert run["device"] == "neuron:0" and run["devices"] == ["neuron"] and run["adjustments"] == ["neuron_detection"]
    # Trainer compiles with TorchNeuron's backend and static shapes (dynamic=None before 5.23: a second batch
    # length would make Dynamo mark sizes dynamic, which TorchNeuron refuses)
    assert run["torch_compile_backend"] == "neuron" and run["compile_dynamic"] is False
    _assert_same_losses(run, _jsonable(cpu_run), steps=range(1, 7))


@pytest.mark.slow
def test_ddp_on_two_ranks_like_one_cpu_process(folder, cpu_run, tmp_path):
    run = _launch(tmp_path, folder, 2, output_dir=str(tmp_path / "out"), steps=STEPS)
    assert run["distributed_type"] == "DistributedType.MULTI_NEURON" and run["devices"] == ["neuron"]
    _assert_same_losses(run, _jsonable(cpu_run))


@pytest.mark.slow
def test_fsdp2_shards_over_neuron_and_resumes_at_another_world_size(folder, cpu_run, tmp_path):
    run = _launch(tmp_path, folder, 2, output_dir=str(tmp_path / "out"), steps=STEPS, fsdp=True, save_steps=10)
    assert run["distributed_type"] == "DistributedType.FSDP" and run["devices"] == ["neuron"]
    assert run["placements"] == ["(Shard(dim=0),)"] and run["local_fraction"] < 0.6  # each rank holds half
    _assert_same_losses(run, _jsonable(cpu_run))
    checkpoint = tmp_path / "out" / "checkpoint-10"
    shards = sorted(path.name for path in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank: saved sharded

    resumed = _launch(tmp_path, folder, 1, output_dir=str(tmp_path / "resumed"), steps=STEPS, fsdp=True,
                      resume=str(checkpoint))
    assert resumed["local_fraction"] == 1.0  # one rank holds it all
    _assert_same_losses(resumed, run, steps=range(11, STEPS + 1))


def test_resume_with_dropout_repeats_the_uninterrupted_run(folder, tmp_path):
    # Dropout on `neuron` draws from the CPU generator, as on TorchNeuron: the resumed steps repeat the
    # uninterrupted ones because Trainer restores its state (the second run starts from the seeded state,
    # not the one of step 4), with nothing of the library's in the checkpoint.
    options = dict(steps=8, save_steps=4)
    dropout_folder = tmp_path / "dropout"
    model = AutoModelForCausalLM.from_pretrained(folder, attention_dropout=0.3)
    model.save_pretrained(dropout_folder)
    whole = train(dropout_folder, tmp_path / "whole", **options)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    assert sorted(path.name for path in checkpoint.glob("rng_state*")) == ["rng_state.pth"]
    resumed = train(dropout_folder, tmp_path / "resumed", resume=str(checkpoint), **options)
    for step in range(5, 9):
        assert resumed["losses"][step] == pytest.approx(whole["losses"][step], abs=1e-6), (step, whole, resumed)
    # ... and dropout is what made it matter: without the CPU state, step 5 differs
    (checkpoint / "rng_state.pth").unlink()
    unrestored = train(dropout_folder, tmp_path / "unrestored", resume=str(checkpoint), **options)
    assert abs(unrestored["losses"][5] - whole["losses"][5]) > 1e-4


@pytest.mark.slow
def test_compiled_steps_stop_recompiling_over_random_lengths(folder, tmp_path):
    # 50 steps of 4 examples whose lengths vary at random (3 to 60 tokens, the longest of a batch in any of the
    # three buckets): one compiled graph per bucket, then none.
    generator = torch.Generator().manual_seed(3)
    longest = torch.tensor([12, 30, 60])[torch.randint(0, 3, (50,), generator=generator)]
    lengths = [int(torch.randint(3, int(high) + 1, (1,), generator=generator)) for high in longest for _ in range(4)]
    buckets = []

    class Recording(BucketingDataCollator):
        def __call__(self, features):
            batch = super().__call__(features)
            buckets.append(batch["input_ids"].shape[1])
            return batch

    graphs = []

    class CountGraphs(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    args = TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=50, torch_compile=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # (not cleared by reset: graphs of earlier tests would count)
    Trainer(model=model, args=args, train_dataset=dataset(lengths),
            data_collator=Recording(pad_token_id=0, buckets=(16, 32, 64), batch_size=4),
            callbacks=[CountGraphs()]).train()
    assert len(buckets) == len(graphs) == 50 and sorted(set(buckets)) == [16, 32, 64]
    warm = max(buckets.index(bucket) for bucket in set(buckets))  # the step that met the last new bucket
    assert warm < 40 and graphs[warm] == graphs[-1] == 3, (buckets, graphs)  # one graph per bucket, none after


def test_padding_changes_neither_loss_nor_gradients(folder):
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder).train()
    examples = dataset([5, 11])

    def loss_and_grads(batch):
        model.zero_grad()
        loss = model(**{key: value.to("neuron") for key, value in batch.items()}).loss
        loss.backward()
        return loss.detach().cpu(), [p.grad.detach().cpu().clone() for p in model.parameters()]

    tight = BucketingDataCollator(pad_token_id=0, buckets=(11,))(examples)
    padded = BucketingDataCollator(pad_token_id=0, buckets=(8, 32), batch_size=4)(examples)
    assert padded["input_ids"].shape == (4, 32) and padded["labels"][2:].eq(-100).all()
    tight_loss, tight_grads = loss_and_grads(tight)
    padded_loss, padded_grads = loss_and_grads(padded)
    torch.testing.assert_close(padded_loss, tight_loss, atol=1e-6, rtol=1e-6)
    for padded_grad, tight_grad in zip(padded_grads, tight_grads, strict=True):
        torch.testing.assert_close(padded_grad, tight_grad, atol=1e-6, rtol=1e-5)


def test_collator_refuses_what_would_change_the_shape():
    collator = BucketingDataCollator(pad_token_id=0, buckets=(8, 16), batch_size=2)
    with pytest.raises(ConfigurationError, match="17 tokens, more than the largest bucket \\(16\\)"):
        collator([{"input_ids": list(range(17))}])
    with pytest.raises(ConfigurationError, match="batch of 3 examples, more than batch_size=2"):
        collator([{"input_ids": [1]}] * 3)
    with pytest.raises(ConfigurationError, match="example 0 has 2 input_ids but 1 labels"):
        collator([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ConfigurationError, match="increasing"):
        BucketingDataCollator(pad_token_id=0, buckets=(16, 8))


def test_collator_pads_to_the_bucket_and_the_batch_size_exactly():
    collator = BucketingDataCollator(pad_token_id=9, buckets=[1, 4, 6], batch_size=3)
    batch = collator([{"input_ids": torch.tensor([[1, 2, 3, 4]])}, {"input_ids": (5,), "labels": [-100]}])
    assert {name: (value.dtype, value.tolist()) for name, value in batch.items()} == {
        "input_ids": (torch.long, [[1, 2, 3, 4], [5, 9, 9, 9], [9, 9, 9, 9]]),  # a 4-token bucket; a padding row
        "attention_mask": (torch.long, [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]),
        "labels": (torch.long, [[1, 2, 3, 4], [-100, -100, -100, -100], [-100, -100, -100, -100]])}
    assert collator.bucket(1) == 1 and collator.bucket(2) == 4 and collator.bucket(6) == 6
    assert collator([{"input_ids": [7] * 5}] * 3)["input_ids"].shape == (3, 6)  # exactly batch_size rows
    empty = collator([])  # (no examples: the smallest bucket, padding rows only)
    assert empty["input_ids"].tolist() == [[9]] * 3 and empty["attention_mask"].tolist() == [[1]] * 3
    unpadded = BucketingDataCollator(pad_token_id=0, buckets=(1, 2))([{"input_ids": [3]}, {"input_ids": [4, 5]}])
    assert unpadded["input_ids"].tolist() == [[3, 0], [4, 5]]  # without batch_size: the examples' rows only
    assert BucketingDataCollator(pad_token_id=0, buckets=(1,), batch_size=1).batch_size == 1
    messages = {
        "`buckets` must be increasing positive lengths, got (4, 4).": lambda: BucketingDataCollator(0, (4, 4)),
        "`buckets` must be increasing positive lengths, got (0, 4).": lambda: BucketingDataCollator(0, (0, 4)),
        "`buckets` must be increasing positive lengths, got ().": lambda: BucketingDataCollator(0, ()),
        "`batch_size` must be at least 1, got 0.": lambda: BucketingDataCollator(0, (4,), 0),
        "an example has 7 tokens, more than the largest bucket (6). Truncate the examples when tokenizing "
        "(truncation=True, max_length=6) or add a larger bucket.": lambda: collator([{"input_ids": [1] * 7}]),
        "a batch of 4 examples, more than batch_size=3; set batch_size to "
        "TrainingArguments.per_device_train_batch_size.": lambda: collator([{"input_ids": [1]}] * 4),
        "`input_ids` must be a list or tensor of token ids, got str.": lambda: collator([{"input_ids": "1 2"}]),
        "`labels` must be a list or tensor of token ids, got int.": lambda: collator([{"input_ids": [1],
                                                                                        "labels": 1}]),
        "example 1 has 1 input_ids but 2 labels; they must be as long.": lambda: collator(
            [{"input_ids": [1]}, {"input_ids": [1], "labels": [1, 2]}]),
    }
    for message, call in messages.items():
        with pytest.raises(ConfigurationError) as error:
            call()
        assert str(error.value) == f"BucketingDataCollator: {message}"


def test_bf16_autocast_on_neuron_trains(folder, tmp_path):
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    dtypes = set()
    model.lm_head.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    one_batch = [dict(e, labels=e["input_ids"]) for e in dataset()[:4]] * 10
    args = TrainingArguments(tmp_path, per_device_train_batch_size=4, max_steps=10, bf16=True, learning_rate=3e-3,
                             report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=one_batch)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.accelerator.mixed_precision == "bf16" and args.device.type == "neuron"
    assert dtypes == {torch.bfloat16}  # autocast ran the projections in bf16 on the device
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_script_for_torchneuron_runs_compiled_with_checkpointing(folder, cpu_run, tmp_path):
    # Deliver 1's script: bf16, gradient checkpointing and torch.compile together; checked in fp32 against the CPU.
    run = _jsonable(train(folder, tmp_path / "fp32", steps=6, gradient_checkpointing=True, torch_compile=True))
    _assert_same_losses(run, _jsonable(cpu_run), steps=range(1, 7))
    before = cache_stats()
    # (a fresh Dynamo, as in a new process: Transformers >= 5.25 wraps every model's forward in one
    # deprecation function, whose code object shares Dynamo's recompile limit, 8, across all the models a
    # process compiled; past it, Dynamo runs that code eagerly)
    torch._dynamo.reset()
    bf16 = train(folder, tmp_path / "bf16", steps=3, gradient_checkpointing=True, torch_compile=True, bf16=True)
    assert bf16["mixed_precision"] == "bf16" and bf16["devices"] == ["neuron"] and len(bf16["losses"]) == 3
    # It ran compiled: its bf16 graphs went through the neuron backend. (Before Transformers 5.25 AOTAutograd
    # would not serialize the autocast-inside-checkpointing graph, which then ran uncached; with 5.25 it is
    # stored: `uncached` is no longer asserted.)
    after = cache_stats()
    assert after.misses + after.uncached > before.misses + before.uncached


def test_adjustments_are_listed_and_reversible(folder, tmp_path):
    ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
    assert trainer_integration.active() == ["neuron_detection"]
    assert set(trainer_integration.active()) <= set(trainer_integration.ADJUSTMENTS)
    assert TrainingArguments(tmp_path, report_to=[]).device.type == "neuron"
    trainer_integration.disable()
    try:
        assert trainer_integration.active() == []
        assert TrainingArguments(tmp_path, report_to=[]).device.type == "cpu"  # what Transformers does alone
        with pytest.raises(ValueError, match="bf16"):
            TrainingArguments(tmp_path, report_to=[], bf16=True)
    finally:
        trainer_integration.enable()
    assert TrainingArguments(tmp_path, report_to=[], bf16=True).device.type == "neuron"


@pytest.mark.slow
def test_lora_trains_saves_reloads_and_merges_on_neuron(folder, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(ont.NeuronAutoModelForCausalLM.from_pretrained(folder),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert adapters and {p.device.type for p in adapters.values()} == {"neuron"}  # created on the device
    assert all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for name, p in model.named_parameters() if "lora_" not in name)
    examples = [dict(e, labels=e["input_ids"]) for e in dataset()[:8]]
    args = TrainingArguments(tmp_path / "run", per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=examples).train()
    trained = {name: p.detach().cpu().clone() for name, p in adapters.items()}
    assert any(name.endswith("lora_B.default.weight") and value.abs().sum() > 0 for name, value in trained.items())
    model.save_pretrained(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(ont.NeuronAutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter",
                                         torch_device="cpu")  # (read on the host: safetensors knows no `neuron`)
    for name, p in reloaded.named_parameters():
        if "lora_" in name:
            assert p.device.type == "neuron"
            torch.testing.assert_close(p.detach().cpu(), trained[name], rtol=0, atol=0)
    prompt = torch.tensor([dataset()[0]["input_ids"][:6]])
    with_adapter = reloaded.generate(input_ids=prompt.to("neuron"), max_new_tokens=8, do_sample=False).cpu()
    merged = reloaded.merge_and_unload()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    from_merged = merged.generate(input_ids=prompt.to("neuron"), max_new_tokens=8, do_sample=False).cpu()
    assert from_merged.tolist() == with_adapter.tolist()
    on_cpu = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter",
                                       torch_device="cpu")
    assert on_cpu.generate(input_ids=prompt, max_new_tokens=8, do_sample=False).tolist() == with_adapter.tolist()
    with torch.no_grad():  # the adapter changed the model
        base = AutoModelForCausalLM.from_pretrained(folder)
        change = on_cpu(input_ids=prompt).logits - base(input_ids=prompt).logits
    assert change.abs().max() > 1e-2


def test_the_random_op_policy_is_added_unless_the_caller_chose_reentrant_or_a_policy():
    saved = {"use_reentrant": False, "context_fn": SAVE_RANDOM_OPS}
    assert with_random_ops_saved(None) == saved and with_random_ops_saved({}) == saved
    assert with_random_ops_saved({"use_reentrant": False, "debug": True}) == {**saved, "debug": True}
    assert with_random_ops_saved({"use_reentrant": True}) == {"use_reentrant": True}
    own = {"context_fn": print}
    assert with_random_ops_saved(own) == own and with_random_ops_saved(own) is not own  # (a copy)
    policy = torch.utils.checkpoint.CheckpointPolicy
    assert _save_random_ops(None, torch.ops.aten.native_dropout.default) == policy.MUST_SAVE
    assert _save_random_ops(None, torch.ops.aten.mm.default) == policy.PREFER_RECOMPUTE


def test_checkpointing_gets_the_policy_through_the_models_own_method_once():
    from optimum_neuron_torch.training import save_random_ops_when_checkpointing

    class Model(torch.nn.Module):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, *args, **kwargs):
            self.calls.append((activation_checkpointing_kwargs, args, kwargs))

    model, plain = Model(), torch.nn.Linear(1, 1)
    model.calls = []
    save_random_ops_when_checkpointing(plain)  # (a module without the method: left alone)
    assert "activation_checkpointing_enable" not in vars(plain)
    save_random_ops_when_checkpointing(model)
    wrapper = model.activation_checkpointing_enable
    save_random_ops_when_checkpointing(model)  # (once: the wrapper is kept)
    assert model.activation_checkpointing_enable is wrapper
    model.activation_checkpointing_enable({"use_reentrant": True}, "extra", flag=1)
    model.activation_checkpointing_enable()
    assert model.calls == [({"use_reentrant": True}, ("extra",), {"flag": 1}),
                           ({"use_reentrant": False, "context_fn": SAVE_RANDOM_OPS}, (), {})]
