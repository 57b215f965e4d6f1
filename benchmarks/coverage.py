"""Which causal-LM architectures of the installed Transformers run on `neuron`: a generated table.

Every model type that Transformers maps to a causal-LM class is built tiny from its own default
config (see `tiny_config` for the rules), then, in a subprocess of its own with a time limit:

1. greedy `generate()` on the CPU with Transformers (the reference tokens; a type that fails
   here is listed as not runnable at tiny size and left out of the counts);
2. the same checkpoint loaded with `NeuronAutoModelForCausalLM` and generated eagerly on
   `neuron` (`disable_compile=True`);
3. the same model through compiled generation (the default `generate()`), counting the graphs
   compiled, the patches applied, the ops that fell back to the CPU, and whether the call had
   to degrade to eager generation (and why).

Usage:

    python benchmarks/coverage.py                      # every type: docs/coverage.md + docs/coverage.json
    python benchmarks/coverage.py --types llama,mamba  # some types, printed, nothing written
    python benchmarks/coverage.py --types mamba --update  # replace these types' rows of the table
    python benchmarks/coverage.py --sample             # the fixed sample CI runs (tests/test_coverage.py)

`--jobs` runs that many types at once (default 2), `--timeout` is each type's limit in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

# (a sibling file, loaded by path: this file runs as a script and is loaded by path by the tests)
_spec = importlib.util.spec_from_file_location("sweeps", Path(__file__).with_name("sweeps.py"))
sweeps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweeps)

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "coverage.md"
RESULTS = ROOT / "docs" / "coverage.json"
DEFAULT_TIMEOUT = 180.0
PROMPT_LENGTH = 10
NEW_TOKENS = 8
VOCAB = 128

# The shrinking rules. An attribute is set only where the type's default config already has it
# (as a value that is not None), so no architecture gets a setting it does not use.
SIZES = {
    # widths: 4 heads of 8
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64, "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64, "ffn_hidden_size": 64, "embedding_size": 32, "attention_hidden_size": 32,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    # positions (the compiled KV cache follows max_position_embeddings)
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128, "sliding_window": 16,
    # mixture of experts: 4 experts, 2 per token, the first layer dense where the config has dense layers
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1,
    # multi-head latent attention
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "rotary_dim": 4, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 16,
    # state-space and linear-attention mixers
    "state_size": 8, "ssm_state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_n_groups": 1, "n_groups": 1, "mamba_chunk_size": 16, "chunk_size": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_heads": 4, "linear_head_dim": 8,
}
# Per-layer lists (`layer_types`, ...) of the default depth keep one layer of each kind, in order.
PER_LAYER_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types", "block_types", "indexer_types",
                   "no_rope_layers")
# Special token ids past the tiny vocabulary move to its end, each to an id of its own.
TOKEN_IDS = {"bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 2, "pad_token_id": VOCAB - 3,
             "decoder_start_token_id": VOCAB - 4, "sep_token_id": VOCAB - 5}
MULTIMODAL_SUBCONFIGS = ("vision_config", "audio_config", "vq_config", "audio_encoder_config")
# Model types whose defaults need more than the rules above (each attribute the type's own).
# Hybrid models whose default layer pattern, cut to the tiny depth, would keep no attention layer:
# one attention layer, as their checkpoints have.
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
}

# The fixed sample of CI (tests/test_coverage.py): the families, the failure classes and their fixes. (Each type
# costs 30-80 s of the slow tier: dense decoders and experts of the same family as one sampled, e.g. mistral,
# qwen3, phi, gpt_neox, opt, olmo2, xglm, granitemoe, are left to the full sweep.)
SAMPLE = (
    # dense decoders
    "llama", "qwen2", "gemma2", "phi3", "gpt2", "bloom",
    # mixtures of experts (the static-experts patch; DeepSeek-V3's router: the sorted-top-k patch), multi-head latent
    # attention (caches allocated by one step), and a graph split around data-dependent routing (in-place cache writes)
    "mixtral", "qwen2_moe", "deepseek_v32", "deepseek_v3", "jetmoe",
    # hybrid, convolution and state-space caches (Transformers' linear-attention cache layers), multi-query attention
    "bamba", "jamba", "lfm2", "mamba", "falcon",
    # encoder architectures as decoders, seq2seq models' decoders (positions by cache slot: prompts kept unpadded;
    # positions sized by the cache length: read as a scalar)
    "bert", "roberta", "bart", "mbart", "trocr",
    # generated eagerly, with a warning: data-dependent branch, ALiBi sliced by a data-dependent length, a state
    # of its own (no `cache` argument), no KV cache at all
    "cpmant", "mpt", "rwkv", "openai-gpt",
)


def tiny_config(model_type: str):
    """The type's default config shrunk by the rules (`SIZES`, `PER_LAYER_LISTS`, `OVERRIDES`).

    Returns:
        `(config, changed)`: the config and the names of the attributes set.

    Raises:
        ValueError: if the type is multimodal (out of this sweep's scope).
    """
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    present = config.to_dict()
    multimodal = [name for name in MULTIMODAL_SUBCONFIGS if present.get(name) is not None]
    if multimodal:
        raise ValueError(f"multimodal ({', '.join(multimodal)}): out of scope")
    changes: dict = {}
    text = config.get_text_config(decoder=True)
    targets = [config] if text is config else [config, text]
    for target in targets:
        _shrink(target, changes)
    if getattr(text, "is_decoder", None) is False and not config.is_encoder_decoder and _reads_is_decoder(model_type):
        # The causal-LM classes of encoder architectures (BERT, RoBERTa, ...) attend causally and keep a
        # cache only as decoders; Transformers warns to set `is_decoder=True` for generation.
        text.is_decoder = True
        changes["is_decoder"] = True
    for name, value in OVERRIDES.get(model_type, {}).items():
        setattr(text, name, value)
        changes[name] = value
    return config, sorted(changes)


def _shrink(config, changes: dict, sizes: dict = SIZES) -> None:
    values = config.to_dict()
    layers = next((values[name] for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
                   if isinstance(values.get(name), int)), None)
    kept_layers = None
    for name in PER_LAYER_LISTS:
        if isinstance(values.get(name), list) and len(values[name]) == layers and layers:
            kept_layers = kept_layers or _one_of_each(values[name])
    for name, size in sizes.items():
        if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
            if name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") and kept_layers:
                size = max(size, len(kept_layers))
            if name == "num_key_value_heads" and values[name] == values.get("num_attention_heads"):
                size = sizes["num_attention_heads"]  # multi-head attention stays multi-head
            changes[name] = size
            setattr(config, name, size)
    if kept_layers:
        kept_layers += list(range(kept_layers[-1] + 1, layers))[: max(0, 2 - len(kept_layers))]
        for name in PER_LAYER_LISTS:
            if isinstance(values.get(name), list) and len(values[name]) == layers:
                setattr(config, name, [values[name][index] for index in kept_layers])
                changes[name] = True
        if isinstance(values.get("per_layer_config"), dict) and values["per_layer_config"]:
            # Settings of single layers, keyed by layer index: those of the kept layers, renumbered.
            by_index = {int(index): settings for index, settings in values["per_layer_config"].items()}
            config.per_layer_config = {f"{new:02d}": by_index[old] for new, old in enumerate(kept_layers)
                                       if old in by_index}
            changes["per_layer_config"] = True
    if isinstance(values.get("vocab_size"), int):
        config.vocab_size = VOCAB
        changes["vocab_size"] = VOCAB
        for name in TOKEN_IDS:
            value = values.get(name)
            if isinstance(value, int) and value >= VOCAB:
                setattr(config, name, TOKEN_IDS[name])
                changes[name] = True
            elif isinstance(value, list) and any(token >= VOCAB for token in value):
                setattr(config, name, [VOCAB - 2])
                changes[name] = True


def _reads_is_decoder(model_type: str) -> bool:
    """Whether the type's modeling code reads `config.is_decoder`."""
    import importlib
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = getattr(importlib.import_module("transformers"), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return "config.is_decoder" in inspect.getsource(inspect.getmodule(causal_lm))


def _one_of_each(kinds: list) -> list[int]:
    """The index of the first layer of each kind, in order."""
    first: dict = {}
    for index, kind in enumerate(kinds):
        first.setdefault(json.dumps(kind, sort_keys=True, default=str), index)
    return sorted(first.values())


# One type, in its own process ------------------------------------------------------------------
def run_one(model_type: str, folder: Path) -> dict:
    """Builds the tiny model of `model_type` and runs the three generations (see the module's docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    result: dict = {"type": model_type}
    stage = sweeps.Stage(result)
    with stage("config"):
        config, result["changed"] = tiny_config(model_type)
    if "error" in result:
        return result
    with stage("cpu"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        sweeps.randomize(model)
        model.save_pretrained(folder)
        ids = torch.randint(4, VOCAB - 4, (1, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
        settings = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)[0].tolist()
        result["architecture"] = type(model).__name__
        del model
    if "error" in result:
        return result
    import optimum_neuron_torch as ont

    with stage("load"):
        model = ont.NeuronAutoModelForCausalLM.from_pretrained(folder)
        result["patches"] = list(getattr(model, "neuron_patches", []))
    if "error" in result:
        return result
    device_ids = ids.to("neuron")
    with stage("eager"):
        ont.clear_op_tracking()
        with torch.no_grad():
            eager = model.generate(device_ids, attention_mask=torch.ones_like(device_ids), disable_compile=True,
                                   **settings)[0].tolist()
        result["eager_identical"] = eager == expected
        result["fallback_ops"] = sorted(ont.fallback_ops())
    with stage("compiled"):
        with warnings.catch_warnings(record=True) as caught, ont.compiler.recording_partitions() as splits:
            warnings.simplefilter("always")
            with torch.no_grad():
                compiled = model.generate(device_ids, attention_mask=torch.ones_like(device_ids),
                                          **settings)[0].tolist()
        degraded = [str(w.message).removeprefix("generate() with ").split(" does not run on the compiled")[0]
                    for w in caught if "does not run on the compiled neuron graphs" in str(w.message)]
        result["compiled_identical"] = compiled == expected and not degraded
        result["degraded"] = degraded[0] if degraded else None
        keys = getattr(getattr(model, "neuron_generation", None), "cache_keys", ())
        result["graphs"] = len(keys)
        result["split_graphs"] = len(splits)
        result["stablehlo"] = sweeps.lowering(keys)
        result["fallback_ops"] = sorted(set(result.get("fallback_ops", [])) | set(ont.fallback_ops()))
    return result


# The sweep -------------------------------------------------------------------------------------
def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_in_subprocess(model_type: str, timeout: float, cache_dir: Path) -> dict:
    """`run_one(model_type)` in a fresh Python process, stopped after `timeout` seconds."""
    return sweeps.run_in_subprocess(model_type, timeout, cache_dir, __file__)


def runnable_on_cpu(result: dict) -> bool:
    """Whether the type got past building its tiny config and generating on the CPU."""
    return not (result.get("error") and result["error"]["stage"] in ("config", "cpu"))


def status(result: dict) -> str:
    error = result.get("error")
    if not runnable_on_cpu(result):
        return f"{result['type']}: not runnable on the CPU at tiny size ({error['message']})"
    if error:
        return f"{result['type']}: FAILED at {error['stage']}: {error['message']}"
    eager = "eager identical" if result["eager_identical"] else "eager DIFFERENT"
    compiled = ("compiled identical" if result["compiled_identical"]
                else f"compiled degraded ({result['degraded']})" if result["degraded"] else "compiled DIFFERENT")
    lowering = sweeps.lowering_mark(result)
    return f"{result['type']}: {eager}, {compiled}, {result['graphs']} graphs, StableHLO: {lowering}"


def summary(results: list[dict]) -> dict:
    runnable = [result for result in results if runnable_on_cpu(result)]
    return {
        "types": len(results),
        "runnable_on_cpu": len(runnable),
        "no_exception_on_neuron": sum("error" not in r for r in runnable),
        "eager_identical": sum(bool(r.get("eager_identical")) for r in runnable),
        "compiled_identical": sum(bool(r.get("compiled_identical")) for r in runnable),
        # ... whose graphs lowered whole to StableHLO: what TorchNeuron's compiler takes as it is.
        "compiled_identical_whole_graphs": sum(bool(r.get("compiled_identical")) and r.get("stablehlo") == "ok"
                                               and not r.get("split_graphs") for r in runnable),
    }


def render_table(data: dict) -> str:
    """docs/coverage.md from docs/coverage.json's content."""
    counts = data["summary"]
    runnable = counts["runnable_on_cpu"] or 1
    lines = [
        "# Causal-LM coverage",
        "",
        "Generated by `python benchmarks/coverage.py` (do not edit by hand): every causal-LM model type of",
        f"Transformers {data['transformers']} (torch {data['torch']}, {data['machine']}), built tiny",
        f"from its default config, greedy `generate()` of {NEW_TOKENS} tokens after a {PROMPT_LENGTH}-token prompt on",
        "the CPU (Transformers), then on `neuron` eagerly and through compiled generation. *Identical* means",
        "the same tokens as the CPU. The rules that shrink each config are in `tiny_config`",
        "(benchmarks/coverage.py): only attributes the default config has are set.",
        "",
        f"- types: {counts['types']}; runnable on the CPU at tiny size: {counts['runnable_on_cpu']}",
        f"- generate on `neuron` without an exception: {counts['no_exception_on_neuron']} "
        f"({100 * counts['no_exception_on_neuron'] / runnable:.0f}%)",
        f"- eager tokens identical: {counts['eager_identical']} ({100 * counts['eager_identical'] / runnable:.0f}%)",
        f"- compiled tokens identical: {counts['compiled_identical']} "
        f"({100 * counts['compiled_identical'] / runnable:.0f}%), of which with whole graphs that lower to "
        f"StableHLO (what TorchNeuron's compiler takes as it is): {counts['compiled_identical_whole_graphs']}",
        f"- sweep time: {data['minutes']} min with {data['jobs']} jobs on {data['cpus']} CPUs",
        "",
        "*StableHLO*: whether the compiled graphs lower to StableHLO (*no*: they ran on the reference device,",
        "TorchNeuron's compiler would refuse them; *split*: graphs split around ops the compiler cannot take,",
        "which ran eagerly between compiled pieces).",
        "",
        "| type | eager identical | compiled identical | StableHLO | patches | fallback ops | graphs "
        "| error or reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in data["results"]:
        error = result.get("error")
        if not runnable_on_cpu(result):
            lines.append(f"| {result['type']} | – | – | – | – | – | – | not runnable on the CPU at tiny size: "
                         f"{sweeps.cell(error['message'])} |")
            continue
        reason = (f"{error['stage']}: {error['message']}" if error else
                  result.get("degraded") or ("" if result.get("compiled_identical") else "tokens differ"))
        lines.append(
            f"| {result['type']} | {sweeps.mark(result.get('eager_identical'))} "
            f"| {sweeps.mark(result.get('compiled_identical'))} | {sweeps.lowering_mark(result)} "
            f"| {', '.join(result.get('patches', []))}"
            f" | {', '.join(result.get('fallback_ops', []))} | {result.get('graphs', '')} | {sweeps.cell(reason)} |"
        )
    return "\n".join(lines) + "\n"


COMMITTED = sweeps.Table(RESULTS, TABLE, summary, render_table)


if __name__ == "__main__":
    sweeps.main(__file__, __doc__, run_one=run_one, all_types=causal_lm_types, sample=SAMPLE, table=COMMITTED,
                describe=status, timeout=DEFAULT_TIMEOUT)
