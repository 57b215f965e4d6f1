"""Programs that tests/test_tensor_parallel.py launches under `torchrun`: tensor-parallel models.

`python tests/tensor_parallel_programs.py OUT MODELS PROGRAM [PROGRAM...]` runs each program on this
rank, with the tiny checkpoints saved under MODELS, and writes `OUT/rank<r>.json`: every check made.
Each check compares the split model on `neuron` with the same model run whole by this one process on
the CPU with Transformers.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import optimum_neuron_torch as ont
from optimum_neuron_torch.compiler import cache_stats
from optimum_neuron_torch.device import mem_get_info
from optimum_neuron_torch.loading import default_model_path

sys.path.insert(0, str(Path(__file__).parent))
from distributed_programs import check, check_raises, record, run_programs  # noqa: E402

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
MODELS = Path(sys.argv[2]) if len(sys.argv) > 2 else Path()
PROMPT = torch.randint(4, 128, (2, 9), generator=torch.Generator().manual_seed(3))
MASK = torch.ones_like(PROMPT)
MASK[1, :2] = 0  # a padded row


def _gathered(value) -> list:
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, value)
    return everyone


def _settled_memory(expected: int) -> int:
    """Device memory in use, once it reaches `expected` or after 30 s: gloo's thread drops its references to
    a collective's tensors a moment after the collective returns (later on a loaded machine)."""
    deadline = time.monotonic() + 30
    while torch.neuron.memory_allocated() != expected and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return torch.neuron.memory_allocated()


def _local_bytes(model) -> int:
    """What this rank should hold of the model: its pieces of split tensors, replicated ones whole."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum((t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors.values())


def check_model(name: str) -> None:
    """Loads one architecture split over the job's ranks and compares it with the whole model on the CPU."""
    path = MODELS / name
    gc.collect()
    before = torch.neuron.memory_allocated()
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(path, tp_size=WORLD)
    split = [key for key, p in model.named_parameters() if isinstance(p, DTensor)]
    check(f"{name}: parameters split by the model's plan", bool(split), True)
    share = _local_bytes(model)
    check(f"{name}: device memory is this rank's share plus the replicated tensors",
          _settled_memory(before + share) - before, share)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=PROMPT.to("neuron"), attention_mask=MASK.to("neuron")).logits.cpu()
        expected = reference(input_ids=PROMPT, attention_mask=MASK).logits
    check(f"{name}: logits", logits, expected, atol=1e-4, rtol=0)

    greedy = dict(attention_mask=MASK, max_new_tokens=5, do_sample=False)
    expected_tokens = reference.generate(PROMPT, **greedy, pad_token_id=0)
    tokens = model.generate(PROMPT.to("neuron"), **{**greedy, "attention_mask": MASK.to("neuron")},
                            pad_token_id=0).cpu()
    check(f"{name}: compiled greedy tokens", tokens, expected_tokens)
    check(f"{name}: every rank has the same tokens", all(torch.equal(t, tokens) for t in _gathered(tokens)), True)
    before_stats = cache_stats()
    torch._dynamo.utils.counters.clear()
    again = model.generate(PROMPT.to("neuron"), **{**greedy, "attention_mask": MASK.to("neuron")},
                           pad_token_id=0).cpu()
    after_stats = cache_stats()
    check(f"{name}: no compile after warm-up", (after_stats.misses - before_stats.misses,
                                                sum(torch._dynamo.utils.counters["recompiles"].values())), (0, 0))
    check(f"{name}: the same tokens again", again, expected_tokens)

    sampling = dict(attention_mask=MASK.to("neuron"), max_new_tokens=4, do_sample=True, top_k=0, pad_token_id=0)
    if name != "llama":  # (one architecture samples in the graph; the others on the host, through a processor
        # the graph does not hold, which compiles no graph more: many ranks on 2 cores compile slowly)
        sampling["logits_processor"] = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=1.0)])
    torch.manual_seed(100 + RANK)  # a different seed on every rank: the first rank's state is used by all
    first = model.generate(PROMPT.to("neuron"), **sampling).cpu()
    check(f"{name}: sampled tokens identical on every rank", all(torch.equal(t, first) for t in _gathered(first)),
          True)
    torch.manual_seed(7)
    seeded = model.generate(PROMPT.to("neuron"), **sampling).cpu()
    torch.manual_seed(7)
    check(f"{name}: sampling reproducible under a seed", model.generate(PROMPT.to("neuron"), **sampling).cpu(),
          seeded)
    del model, sampling
    gc.collect()
    check(f"{name}: device memory given back", _settled_memory(before), before)


def program_models() -> None:
    """Every architecture saved under MODELS (the test saves those it wants checked)."""
    for path in sorted(MODELS.iterdir()):
        if (path / "config.json").is_file() and not path.name.startswith("_"):
            try:
                check_model(path.name)
            except Exception:  # noqa: BLE001 (recorded; the next architecture still runs)
                record(f"{path.name} raised", False, traceback.format_exc()[-3000:])


def program_errors() -> None:
    """Refusals before any allocation, the same on every rank; a rank that fails is named by the others."""
    before = torch.neuron.memory_allocated()
    llama = MODELS / "llama"
    check_raises("a degree other than the world size", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        llama, tp_size=WORLD * 2), ont.errors.ConfigurationError, f"tp_size={WORLD * 2}", f"has {WORLD} process",
        "torchrun --nproc-per-node")
    check_raises("a model without a plan", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        MODELS / "_gpt2", tp_size=WORLD), ont.errors.UnsupportedModelError, "gpt2", "no tensor-parallel plan")
    check_raises("SmolLM2-135M: 9 heads, 3 key-value heads", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        default_model_path(), tp_size=WORLD), ont.errors.ConfigurationError, "9 attention heads",
        "3 key-value heads", f"tp_size={WORLD} does not divide", "divides them: 1, 3")
    check_raises("distributed_config and tp_size together", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        llama, tp_size=WORLD, distributed_config={"tp_size": WORLD}), ont.errors.ConfigurationError, "not both")
    # Rank 1 alone sees a corrupt file: every rank raises, rank 1 its own error, the others naming rank 1.
    corrupt = MODELS / "_corrupt" if RANK == 1 else llama
    check_raises("a corrupt file seen by one rank", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        corrupt, tp_size=WORLD), ont.errors.CheckpointError if RANK == 1 else ont.errors.RankFailedError,
        *(["model.safetensors"] if RANK == 1 else ["rank 1 failed: CheckpointError", "model.safetensors"]))
    # Rank 0 alone has too little device memory left: every rank raises before allocating anything.
    torch.neuron.empty_cache()  # (blocks kept for reuse are free memory the check would reclaim)
    free = mem_get_info(torch.device("neuron", torch.neuron.current_device()))[0]
    filler = torch.empty(free - 4096, dtype=torch.uint8, device="neuron") if RANK == 0 else None
    check_raises("a rank without the device memory", lambda: ont.NeuronAutoModelForCausalLM.from_pretrained(
        llama, tp_size=WORLD), ont.errors.InsufficientDeviceMemoryError if RANK == 0 else ont.errors.RankFailedError,
        *(["needs", "free"] if RANK == 0 else ["rank 0 failed: InsufficientDeviceMemoryError"]))
    del filler
    gc.collect()
    check("nothing left allocated after the refusals", _settled_memory(before), before)


def program_save() -> None:
    """precompile() and save_pretrained() under tensor parallelism carry the degree and every rank's graphs."""
    folder = MODELS / "_saved"
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(MODELS / "llama", tp_size=WORLD)
    model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=32, show_progress=False)
    prompt = PROMPT[:1].to("neuron")
    tokens = model.generate(prompt, max_new_tokens=4, do_sample=False).cpu()
    model.save_pretrained(folder)
    dist.barrier()
    spec = json.loads((folder / "neuron_generation.json").read_text())
    check("the spec records the degree", spec["tp_size"], WORLD)
    own = sorted(model.neuron_generation.cache_keys)
    everyone = sorted(set().union(*_gathered(own)))
    check("every rank's graphs are saved, each rank's its own", (spec["graphs"], len(everyone)),
          (everyone, WORLD * len(own)))
    del model
    os.environ["OPTIMUM_NEURON_TORCH_COMPILE_CACHE"] = str(MODELS / "_empty_cache")  # graphs come from the folder now
    torch._dynamo.reset()
    before = cache_stats()
    again = ont.NeuronAutoModelForCausalLM.from_pretrained(folder, tp_size=WORLD)
    check("the saved weights load split", again(input_ids=prompt).logits.shape[-1], 128)
    check("generation from the saved folder", again.generate(prompt, max_new_tokens=4, do_sample=False).cpu(), tokens)
    check("its graphs came from the folder (nothing compiled)", cache_stats().misses - before.misses, 0)


def program_context() -> None:
    """Context buckets under tensor parallelism: every rank narrows its cache shard to the same bucket at
    each step, from the same host-side lengths; a generation growing through every bucket equals the CPU's."""
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(MODELS / "llama", tp_size=WORLD)
    model.precompile(batch_sizes=(1,), prompt_buckets=(16,), max_length=96, context_buckets=(24, 48),
                     show_progress=False)
    reference = AutoModelForCausalLM.from_pretrained(MODELS / "llama").eval()
    greedy = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False)
    before = cache_stats()
    torch._dynamo.utils.counters.clear()
    contexts, device = [], model.neuron_generation.engine.device
    run = device.run

    def recording(*call):
        contexts.append(call[3])  # (ids, positions, last, context, ...)
        return run(*call)

    device.run = recording
    tokens = model.generate(PROMPT[:1].to("neuron"), **greedy).cpu()
    # 9 tokens: the prefill over its bucket (16), then the decode steps of positions 9-23 over 24 positions,
    # 24-47 over 48 and 48-77 over 96 (the 70th token comes from the step at position 77).
    check("context buckets: the steps' contexts", contexts, [16] + [24] * 15 + [48] * 24 + [96] * 30)
    check("context buckets: tokens through every bucket", tokens, reference.generate(PROMPT[:1], **greedy))
    check("context buckets: nothing compiled after precompile()",
          (cache_stats().misses - before.misses, sum(torch._dynamo.utils.counters["recompiles"].values())), (0, 0))


def program_pipeline() -> None:
    """`pipeline("text-generation", tp_size=N)` inside the job: every rank gets the CPU pipeline's text."""
    from transformers import pipeline as transformers_pipeline

    folder = MODELS / "_with_tokenizer"
    generator = ont.pipeline("text-generation", model=folder, tp_size=WORLD)
    expected = transformers_pipeline("text-generation", model=str(folder), device="cpu")
    prompt = "the quick brown fox"
    settings = dict(max_new_tokens=6, do_sample=False)
    check("pipeline text equals the CPU pipeline's", generator(prompt, **settings)[0]["generated_text"],
          expected(prompt, **settings)[0]["generated_text"])


def program_hub() -> None:
    """A Hub id (the test serves it over HTTP; HF_ENDPOINT points there): the split model equals the CPU's."""
    model = ont.NeuronAutoModelForCausalLM.from_pretrained("tiny-org/tp-llama", tp_size=WORLD)
    reference = AutoModelForCausalLM.from_pretrained(model.neuron_checkpoint_folder).eval()
    with torch.no_grad():
        logits, expected = model(input_ids=PROMPT.to("neuron")).logits, reference(input_ids=PROMPT).logits
    check("logits of the Hub model", logits, expected, atol=1e-4, rtol=0)


def program_killed() -> None:
    """Rank 1 is killed (SIGKILL) in the middle of a generation; rank 0 must fail naming it, not hang."""
    model = ont.NeuronAutoModelForCausalLM.from_pretrained(MODELS / "llama", tp_size=WORLD)
    prompt = PROMPT[:1].to("neuron")
    model.generate(prompt, max_new_tokens=3, do_sample=False)  # warm-up: both ranks compile
    dist.barrier()

    class KillAfterTwoTokens:
        seen = 0

        def put(self, value) -> None:
            self.seen += 1
            if RANK == 1 and self.seen == 3:
                os.kill(os.getpid(), signal.SIGKILL)

        def end(self) -> None:
            pass

    try:
        model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, streamer=KillAfterTwoTokens())
    except Exception as error:  # noqa: BLE001 (what rank 0 sees is the check)
        failed = getattr(error, "failed_ranks", None)
        record("generation failed", failed == [1], f"{type(error).__name__}: {error}"[:3000])
        return
    record("generation failed", False, "generate() returned")


PROGRAMS = {name[len("program_"):]: value for name, value in globals().items() if name.startswith("program_")}


def main() -> None:
    out, programs = Path(sys.argv[1]), sys.argv[3:]
    warnings.simplefilter("ignore")
    run_programs(PROGRAMS, programs, out)
    if dist.is_initialized() and "killed" not in programs:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
