"""Model patches: each rewrites a construct TorchNeuron cannot run in real Transformers models (tiny
configs, no downloads), matches the unpatched model on the CPU, reverts exactly, and is applied by
`from_pretrained`, whose model then runs on `neuron` with the CPU's outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optimum_neuron_torch import NeuronAutoModel, NeuronAutoModelForCausalLM
from optimum_neuron_torch.patches import PATCHES, apply_patches, patched, patches_for, revert_patches

DECODER = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
# float64_to_float32 announces that it narrows; test_float64_narrowing_is_announced checks it.
pytestmark = pytest.mark.filterwarnings("ignore:.*float64 in .* is computed in float32:UserWarning")

DATA_DEPENDENT_OPS = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


class OpRecorder(TorchDispatchMode):
    """Records every ATen op run in the block, with the dtypes of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        dtypes = {leaf.dtype for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)}
        name = func.overloadpacket.__name__
        if name == "topk" and not kwargs_or_position(args, kwargs, "sorted", 4, default=True):
            name = "topk(sorted=False)"
        self.ops.append((name, dtypes))
        return result


def kwargs_or_position(args, kwargs, name, position, default):
    """An op argument given by keyword or position."""
    if kwargs and name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def complex_tensors(ops) -> bool:
    return any(dtype.is_complex for _, dtypes in ops for dtype in dtypes)


def float64_tensors(ops) -> bool:
    return any(torch.float64 in dtypes for _, dtypes in ops)


def unsorted_topk(ops) -> bool:
    return any(name == "topk(sorted=False)" for name, _ in ops)


def triangular_solves(ops) -> bool:
    return any(name == "linalg_solve_triangular" for name, _ in ops)


def data_dependent_shapes(ops) -> bool:
    return any(name in DATA_DEPENDENT_OPS for name, _ in ops)


@dataclass(frozen=True)
class Case:
    config: transformers.PretrainedConfig
    auto_class: type
    neuron_class: type
    patches: list[str]  # what from_pretrained applies
    constructs: tuple[Callable, ...]  # the ops the unpatched model runs and the patched one does not
    vision: bool = False

    def build(self) -> transformers.PreTrainedModel:
        torch.manual_seed(0)
        return self.auto_class.from_config(self.config).eval()

    def inputs(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        if self.vision:
            return {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator).to(device)}
        ids = torch.randint(4, 128, (2, 10), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        result = model(**inputs)
    return (result.logits if hasattr(result, "logits") else result.last_hidden_state).cpu()


CAUSAL = (transformers.AutoModelForCausalLM, NeuronAutoModelForCausalLM)
CASES = {
    # Llama4: rotary embedding via torch.polar, apply_rotary_emb via view_as_complex (its experts are static bmm).
    "llama4": Case(transformers.Llama4TextConfig(**DECODER, intermediate_size_mlp=64, num_local_experts=4, head_dim=8),
                   *CAUSAL, ["complex_rope"], (complex_tensors,)),
    # DeepSeek-V2: complex RoPE, and MoE experts whose eager loop routes with nonzero/where.
    "deepseek_v2": Case(transformers.DeepseekV2Config(**{**DECODER, "num_key_value_heads": 4},
                                                      moe_intermediate_size=16,
                                                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                                      kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                                      qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                                                      experts_implementation="eager"),
                        *CAUSAL, ["complex_rope", "static_moe_experts", "sorted_topk"],
                        (complex_tensors, data_dependent_shapes, unsorted_topk)),
    "mixtral": Case(transformers.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                                               experts_implementation="eager"),
                    *CAUSAL, ["static_moe_experts"], (data_dependent_shapes,)),
    # DeepSeek-V3: its router picks expert groups and experts with topk(sorted=False).
    "deepseek_v3": Case(transformers.DeepseekV3Config(**{**DECODER, "num_key_value_heads": 4},
                                                      moe_intermediate_size=16, n_routed_experts=8,
                                                      num_experts_per_tok=2, n_group=4, topk_group=2,
                                                      n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
                                                      qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                                      first_k_dense_replace=1),
                        *CAUSAL, ["static_moe_experts", "sorted_topk"], (unsorted_topk,)),
    # Qwen3.5: gated delta rule linear attention solves a unit lower-triangular system per chunk.
    "qwen3_5_text": Case(transformers.Qwen3_5TextConfig(**DECODER, head_dim=8, layer_types=["linear_attention",
                                                                                             "full_attention"],
                                                         linear_key_head_dim=8, linear_num_key_heads=2,
                                                         linear_num_value_heads=4, linear_value_head_dim=8),
                         *CAUSAL, ["unit_triangular_solve"], (triangular_solves,)),
    # AIMv2 (native resolution): its sinusoidal position embedding is computed in float64 at every forward.
    "aimv2": Case(transformers.Aimv2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=32, patch_size=8, is_native=True),
                  transformers.AutoModel, NeuronAutoModel, ["float64_to_float32"], (float64_tensors,), vision=True),
    # PhiMoE: its rotary embedding recomputes the frequencies on the CPU at every forward (the copy to
    # the device is what rope_on_device removes: test_rope_on_device_copies_nothing_to_the_device).
    "phimoe": Case(transformers.PhimoeConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2,
                                             experts_implementation="eager"),
                   *CAUSAL, ["static_moe_experts", "rope_on_device"], (data_dependent_shapes,)),
    "llama": Case(transformers.LlamaConfig(**DECODER), *CAUSAL, [], ()),
}
PATCHED_CASES = [name for name, case in CASES.items() if case.patches]


def instance_state(model: transformers.PreTrainedModel) -> tuple[list, dict]:
    """What the patches may change on an instance: its modules, their own forwards, the experts switch."""
    modules = [(name, module, module.__dict__.get("forward")) for name, module in model.named_modules()]
    return modules, model.get_experts_implementation()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("patches")
    for name, case in CASES.items():
        case.build().save_pretrained(folder / name)
    return {name: folder / name for name in CASES}


@pytest.mark.parametrize("name", PATCHED_CASES)
def test_patched_model_matches_unpatched_on_cpu_and_reverts_exactly(name):
    case = CASES[name]
    model = case.build()
    class_forwards = {type(m): type(m).forward for m in model.modules()}
    before = instance_state(model)
    expected = run(model, case.inputs())
    assert [patch.name for patch in patches_for(model)] == case.patches

    assert apply_patches(model) == case.patches
    assert model.neuron_patches == case.patches
    assert instance_state(model) != before
    torch.testing.assert_close(run(model, case.inputs()), expected)
    assert apply_patches(model) == []  # nothing applies twice

    revert_patches(model)
    assert model.neuron_patches == []
    assert instance_state(model) == before  # the same modules, forwards and experts switch
    assert {type(m): type(m).forward for m in model.modules()} == class_forwards  # no class was touched


@pytest.mark.parametrize("name", PATCHED_CASES)
def test_patches_remove_the_constructs_torchneuron_lacks(name):
    case = CASES[name]
    model = case.build()
    with OpRecorder() as unpatched:
        run(model, case.inputs())
    with patched(model), OpRecorder() as patched_run:
        run(model, case.inputs())
    assert model.neuron_patches == []
    for construct in case.constructs:
        assert construct(unpatched.ops), construct.__name__
        assert not construct(patched_run.ops), construct.__name__


@pytest.mark.parametrize("name", PATCHED_CASES)
def test_patched_model_traces_with_dynamo(name):
    """The rewritten forwards keep Dynamo's guards valid and need no graph break (compiled generation)."""
    case = CASES[name]
    model = case.build()
    expected = run(model, case.inputs())
    apply_patches(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(run(compiled, case.inputs()), expected)


class HostToDeviceCopies(TorchDispatchMode):
    """Counts the ops that take a CPU tensor and return a `neuron` one."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        if any(t.device.type == "cpu" for t in inputs) and any(t.device.type == "neuron" for t in outputs):
            self.count += 1
        return result


def test_rope_on_device_copies_nothing_to_the_device():
    """A host-to-device copy inside forward is a `prims.device_put` in a compiled graph, which does not lower."""
    case = CASES["phimoe"]
    model, inputs = case.build().to("neuron"), case.inputs("neuron")
    expected = run(model, inputs)
    with HostToDeviceCopies() as unpatched:
        run(model, inputs)
    with patched(model, ["rope_on_device"]), HostToDeviceCopies() as patched_run:
        torch.testing.assert_close(run(model, inputs), expected)
    assert unpatched.count > 0 and patched_run.count == 0
    model.to("cpu")  # the patched forward follows the module's device, read at each call
    with patched(model, ["rope_on_device"]):
        torch.testing.assert_close(run(model, case.inputs()), expected)


def test_patches_are_scoped_to_the_instance():
    case = CASES["deepseek_v2"]
    model, other = case.build(), case.build()
    apply_patches(model)
    assert all("forward" not in module.__dict__ for module in other.modules())
    assert model.config is other.config and model.config._experts_implementation == "eager"  # shared, untouched
    with OpRecorder() as recorder:
        run(other, case.inputs())
    assert complex_tensors(recorder.ops) and data_dependent_shapes(recorder.ops)


def test_float64_narrowing_is_announced():
    model = CASES["aimv2"].build()
    with pytest.warns(UserWarning, match="float64 in Aimv2VisionEmbeddings is computed in float32"):
        apply_patches(model)
    assert "float32" in PATCHES["float64_to_float32"].description


def test_named_patches_and_unknown_names():
    model = CASES["deepseek_v2"].build()
    assert apply_patches(model, ["static_moe_experts"]) == ["static_moe_experts"]
    assert apply_patches(model, ["dense_embeddings"]) == []  # named, but this model does not need it
    assert model.neuron_patches == ["static_moe_experts"]
    with pytest.raises(ValueError, match=r"'rope_complex'.*complex_rope, dense_embeddings, float64_to_float32"):
        apply_patches(model, ["rope_complex"])
    assert model.neuron_patches == ["static_moe_experts"]


@pytest.mark.parametrize("name", list(CASES))
def test_from_pretrained_applies_the_patches_and_matches_cpu_on_neuron(name, checkpoints):
    case = CASES[name]
    expected = run(case.build(), case.inputs())
    model = case.neuron_class.from_pretrained(checkpoints[name])
    assert model.neuron_patches == case.patches
    assert model.device.type == "neuron"
    torch.testing.assert_close(run(model, case.inputs("neuron")), expected)


def test_from_pretrained_without_patches(checkpoints):
    model = NeuronAutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v2"], patches=False)
    assert model.neuron_patches == []
    assert all("forward" not in module.__dict__ for module in model.modules())
    named = NeuronAutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v2"], patches=["complex_rope"])
    assert named.neuron_patches == ["complex_rope"]


def sparse_model() -> nn.Module:
    """No Transformers 5.24 architecture builds sparse embeddings; custom models do."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8, sparse=True), nn.Linear(8, 2))


def embedding_gradient(model: nn.Module, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    output = model(torch.tensor([[1, 3, 3, 7]], device=device))
    output.square().sum().backward()
    return output.detach().cpu(), model[0].weight.grad


def test_dense_embeddings_same_outputs_and_gradients_and_trains_on_neuron():
    model = sparse_model()
    expected_output, sparse_gradient = embedding_gradient(model)
    assert sparse_gradient.is_sparse
    assert [patch.name for patch in patches_for(model)] == ["dense_embeddings"]

    with patched(model) as names:
        assert names == ["dense_embeddings"]
        output, gradient = embedding_gradient(model)
        assert not gradient.is_sparse
        torch.testing.assert_close(output, expected_output)
        torch.testing.assert_close(gradient, sparse_gradient.to_dense())
        model.to("neuron")
        output, gradient = embedding_gradient(model, "neuron")
        assert gradient.device.type == "neuron"
        torch.testing.assert_close(output, expected_output)
        torch.testing.assert_close(gradient.cpu(), sparse_gradient.to_dense())
    assert model[0].sparse and model.neuron_patches == []
    with pytest.raises(NotImplementedError, match="Sparse"):  # why the patch exists: no sparse tensors on neuron
        embedding_gradient(model, "neuron")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 64])
def test_unit_triangular_solve_by_products_matches_the_solver(size):
    """Every power of the strictly lower part counts up to size - 1 (a chunk of 64 fills them all)."""
    from optimum_neuron_torch.patches.unit_triangular_solve import solve_unit_lower_triangular

    generator = torch.Generator().manual_seed(size)
    matrix = 0.3 * torch.randn(2, 3, size, size, generator=generator)
    rhs = torch.randn(2, 3, size, 5, generator=generator)
    expected = torch.linalg.solve_triangular(matrix, rhs, upper=False, unitriangular=True)
    torch.testing.assert_close(solve_unit_lower_triangular(matrix, rhs), expected, rtol=1e-4, atol=1e-4)
