"""The causal-LM coverage sweep (benchmarks/coverage.py): its tiny configs keep to each type's own
attributes, the committed table is the rendering of its JSON, and a fixed sample of types, spread
over the families, still generates on `neuron` as the committed table says."""

from __future__ import annotations

import json

import pytest
import transformers
from transformers import CONFIG_MAPPING

from testing_utils import load_benchmark

pytestmark = pytest.mark.slow  # a sample of the architecture sweep, each type in its own process

coverage = load_benchmark("coverage.py")

COMMITTED = json.loads(coverage.RESULTS.read_text())
BY_TYPE = {result["type"]: result for result in COMMITTED["results"]}
SAME_TRANSFORMERS = COMMITTED["transformers"] == transformers.__version__


def test_the_table_is_the_rendering_of_its_json():
    assert coverage.TABLE.read_text() == coverage.render_table(COMMITTED)
    assert COMMITTED["summary"] == coverage.summary(COMMITTED["results"])


@pytest.mark.skipif(not SAME_TRANSFORMERS, reason="the committed sweep is of another Transformers version")
def test_the_committed_sweep_covers_every_causal_lm_type_of_transformers():
    assert sorted(BY_TYPE) == coverage.causal_lm_types()


def test_the_sample_has_at_least_25_types_spread_over_the_families():
    sample = coverage.SAMPLE
    assert len(set(sample)) == len(sample) >= 25 and set(sample) <= set(coverage.causal_lm_types())
    runnable = [BY_TYPE[model_type] for model_type in sample if coverage.runnable_on_cpu(BY_TYPE[model_type])]
    assert len(runnable) == len(sample)  # every sampled type runs on the CPU at tiny size
    assert any(result.get("degraded") for result in runnable)  # the graceful path is sampled too
    assert any(result["patches"] for result in runnable)  # and the model patches


def test_tiny_configs_set_only_attributes_the_default_config_has():
    checked = 0
    for model_type in coverage.causal_lm_types():
        try:
            config, changed = coverage.tiny_config(model_type)
        except Exception:  # multimodal, or a default config Transformers refuses: the table says so
            assert not SAME_TRANSFORMERS or BY_TYPE[model_type]["error"]["stage"] == "config", model_type
            continue
        default = CONFIG_MAPPING[model_type]()
        text = default.get_text_config(decoder=True)
        present = {**default.to_dict(), **text.to_dict()}
        for name in changed:
            assert name in present, f"{model_type}: {name} is not an attribute of its default config"
            assert present[name] is not None or name in coverage.OVERRIDES.get(model_type, {}), (model_type, name)
        checked += 1
    assert checked > 100


def test_per_layer_lists_keep_one_layer_of_each_kind():
    config, changed = coverage.tiny_config("qwen3_next")
    default = CONFIG_MAPPING["qwen3_next"]()
    assert "layer_types" in changed and set(config.layer_types) == set(default.layer_types)
    assert config.num_hidden_layers == len(config.layer_types) == 2
    assert coverage._one_of_each(["a", "a", "b", "a", "c"]) == [0, 2, 4]


@pytest.fixture(scope="module")
def sweep_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("coverage-compile-cache")


# The table's columns of how a type generates (its other columns, graphs and StableHLO, are of how it compiles).
GENERATION = ("eager_identical", "compiled_identical", "degraded", "patches", "fallback_ops")


@pytest.mark.parametrize("model_type", coverage.SAMPLE)
def test_a_sampled_type_generates_on_neuron_as_the_table_says(model_type, sweep_cache):
    result = coverage.run_in_subprocess(model_type, timeout=400, cache_dir=sweep_cache)
    assert "error" not in result, result["error"]  # never an exception on `neuron`
    assert result["eager_identical"], "eager generation on neuron gives other tokens than the CPU"
    # Compiled generation gives the CPU's tokens, or degrades to eager generation with a warning.
    assert result["compiled_identical"] or result["degraded"], "compiled tokens differ, and nothing said so"
    # ... as the table says, whatever the Transformers version: identical tokens where it says so (or the
    # same reason to degrade), the same patches and the same ops falling back to the CPU.
    found = {name: result.get(name) for name in GENERATION}
    assert found == {name: BY_TYPE[model_type].get(name) for name in GENERATION}, (
        f"{model_type} no longer generates as docs/coverage.md says (swept with Transformers "
        f"{COMMITTED['transformers']}, here {transformers.__version__}): fix the regression, or re-measure its "
        f"row with `python benchmarks/coverage.py --types {model_type} --update`"
    )
