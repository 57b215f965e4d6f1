"""The speech and vision-language coverage sweep (benchmarks/coverage_multimodal.py): the committed
table is the rendering of its JSON and covers every type of Transformers' five mappings, the tiny
configs follow the rules, and a fixed sample of types still runs on `neuron` as the table says."""

from __future__ import annotations

import json

import pytest
import transformers

from testing_utils import load_benchmark

coverage = load_benchmark("coverage_multimodal.py")

COMMITTED = json.loads(coverage.RESULTS.read_text())
BY_TYPE = {result["type"]: result for result in COMMITTED["results"]}
SAME_TRANSFORMERS = COMMITTED["transformers"] == transformers.__version__


def test_the_table_is_the_rendering_of_its_json():
    assert coverage.TABLE.read_text() == coverage.render_table(COMMITTED)
    assert COMMITTED["summary"] == coverage.summary(COMMITTED["results"])


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason="the committed sweep is of another Transformers version")
def test_the_committed_sweep_covers_every_type_of_the_five_mappings():
    assert sorted(BY_TYPE) == sorted(coverage.task_types())
    assert {task for task in coverage.TASKS} == {name.split(":")[0] for name in BY_TYPE}


def test_tiny_configs_shrink_every_sub_config_and_keep_placeholders_in_the_vocabulary():
    """LLaVA's vision tower and language model are both shrunk, its image token (32000 by default)
    moves into the tiny vocabulary, and positions keep their defaults (an image takes hundreds)."""
    config, changed = coverage.tiny_config("llava")
    default = transformers.LlavaConfig()
    assert config.text_config.hidden_size == config.vision_config.hidden_size == 32
    assert config.text_config.vocab_size == coverage.causal.VOCAB
    assert config.image_token_id < coverage.causal.VOCAB and "image_token_index" in changed
    assert config.image_token_id not in {config.text_config.bos_token_id, config.text_config.eos_token_id,
                                         config.text_config.pad_token_id}
    assert config.text_config.max_position_embeddings == default.text_config.max_position_embeddings


def test_tiny_configs_split_multimodal_rotary_sections_over_the_tiny_head():
    """Qwen2-VL splits each head's rotary frequencies into temporal, height and width sections (16,
    24, 24 of 64 by default): the tiny head has 4."""
    config, changed = coverage.tiny_config("qwen2_vl")
    text = config.text_config
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert "mrope_section" in changed
    assert "mrope_section" not in coverage.tiny_config("llava")[1]


def test_the_sample_spreads_over_the_tasks_and_runs_on_the_cpu():
    assert set(coverage.SAMPLE) <= set(BY_TYPE)
    assert all(coverage.causal.runnable_on_cpu(BY_TYPE[name]) for name in coverage.SAMPLE)
    assert len({name.split(":")[0] for name in coverage.SAMPLE}) >= 2  # (speech and images)


# The table's columns of how a type runs (its other columns, graphs and StableHLO, are of how it compiles).
OUTCOME = ("eager_identical", "compiled_identical", "degraded", "fallback_ops")


@pytest.mark.slow
@pytest.mark.parametrize("task_type", coverage.SAMPLE)
def test_a_sampled_type_runs_on_neuron_as_the_table_says(task_type, tmp_path):
    result = coverage.sweeps.run_in_subprocess(task_type, 400, tmp_path, coverage.__file__)
    assert "error" not in result, result["error"]  # never an exception on `neuron`
    assert result["eager_identical"], "eager outputs on neuron differ from the CPU's"
    assert result["compiled_identical"] or result["degraded"], "compiled outputs differ, and nothing said so"
    found = {name: result.get(name) for name in OUTCOME}
    assert found == {name: BY_TYPE[task_type].get(name) for name in OUTCOME}, (
        f"{task_type} no longer runs as docs/coverage_multimodal.md says (swept with Transformers "
        f"{COMMITTED['transformers']}, here {transformers.__version__}): fix the regression, or re-measure its "
        f"row with `python benchmarks/coverage_multimodal.py --types {task_type} --update`"
    )
