"""The fallback policy (warn / error / silent), exact counters, and native decoding ops."""

from __future__ import annotations

import copy
import io
import os
import warnings

import pytest
import torch
from transformers import LlamaForCausalLM

import optimum_neuron_torch as ont
from optimum_neuron_torch.errors import ConfigurationError
from optimum_neuron_torch.fallbacks import watch
from testing_utils import run_python
from tiny_models import TINY_MODELS


class Head(torch.nn.Module):
    """Two argmax and one cumprod per call: neither is native on TorchNeuron."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1) + x.argmax(0).sum() + x.cumprod(-1).sum().long()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.linear(x))


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().to("neuron"), torch.randn(3, 5).to("neuron")


def test_policy_is_scoped_and_validated():
    assert ont.get_fallback_policy() == "warn"
    with ont.fallback_policy("silent"):
        assert ont.get_fallback_policy() == "silent"
        with ont.fallback_policy("error"):
            assert ont.get_fallback_policy() == "error"
        assert ont.get_fallback_policy() == "silent"
    assert ont.get_fallback_policy() == "warn"
    with pytest.raises(ConfigurationError, match="unknown fallback policy 'strict'.*warn, error, silent"):
        ont.set_fallback_policy("strict")


def test_counters_are_exact_for_known_op_counts(net):
    model, x = net
    ont.clear_op_tracking()
    with ont.fallback_policy("silent"), warnings.catch_warnings():
        warnings.simplefilter("error")  # silent: no warning at all
        for _ in range(4):
            model(x)
    stats = ont.fallback_stats()
    assert {op: s.calls for op, s in stats.items()} == {"aten::argmax.out": 8, "aten::cumprod.out": 4}
    assert all(s.seconds > 0 for s in stats.values())


def hooks(model: torch.nn.Module) -> int:
    """The forward hooks on `model`'s modules, and the global ones (which every module runs)."""
    modules = torch.nn.modules.module
    return (sum(len(module._forward_pre_hooks) + len(module._forward_hooks) for module in model.modules())
            + len(modules._global_forward_pre_hooks) + len(modules._global_forward_hooks))


def test_error_policy_names_op_module_and_setting(net):
    model, x = net
    watch(model)  # (as the library watches the models it loads)
    with ont.fallback_policy("error"):
        with pytest.raises(NotImplementedError) as caught:
            model(x)
        model.linear(x)  # native ops still run
    message = str(caught.value)
    assert "Operator 'aten::argmax.out' fell back to CPU" in message
    assert "fallback policy 'error'" in message and "OPTIMUM_NEURON_TORCH_FALLBACK=error" in message
    assert message.endswith("Called from module 'Net.head'.")
    with ont.fallback_policy("silent"):
        model(x)  # the policy restored, the model still works


def test_the_policy_hooks_the_watched_models_while_it_needs_to_and_nothing_else(net):
    model, x = net
    other = Net().to("neuron")
    assert ont.get_fallback_policy() == "warn" and hooks(model) == hooks(other) == 0  # importing hooked nothing
    watch(model)
    watch(model)  # (twice: once)
    assert hooks(model) == 0  # the default `warn` needs no hook on the reference device
    with ont.fallback_policy("error"):
        assert hooks(model) == 2 * len(list(model.modules())) and hooks(other) == 0
        with pytest.raises(NotImplementedError) as caught:
            other(x)  # not watched: refused all the same, by the device, without its module's name
        assert "Called from module" not in str(caught.value)
        late = Net().to("neuron")
        watch(late)  # watched while the policy needs it: hooked at once
        assert hooks(late) == hooks(model)
        with pytest.raises(NotImplementedError, match=r"Called from module 'Net.head'\.$"):
            late(x)
        torch.save(model, io.BytesIO())  # an observed model still saves whole (its hooks pickle)
        copied = copy.deepcopy(model)  # a copy carries the hooks, which do nothing for it
        with pytest.raises(NotImplementedError) as caught:
            copied(x)
        assert "Called from module" not in str(caught.value)
    assert hooks(model) == hooks(late) == hooks(other) == 0  # removed with the policy


def test_error_policy_from_the_environment_names_the_module():
    result = run_python(
        """
        import torch, optimum_neuron_torch
        from optimum_neuron_torch.fallbacks import watch
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Softmax(-1)).to("neuron")
        class Pick(torch.nn.Module):
            def forward(self, x):
                return x.argmax()
        model.append(Pick())
        watch(model)
        print(optimum_neuron_torch.get_fallback_policy())
        try:
            model(torch.ones(2, 3).to("neuron"))
        except NotImplementedError as error:
            print(str(error).split("Called from module ")[1])
        """,
        env={"OPTIMUM_NEURON_TORCH_FALLBACK": "error"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["error", "'Sequential.2'."]


def test_decoding_kernels_match_cpu_and_are_removed_after_the_block():
    torch.manual_seed(0)
    x = torch.randn(4, 50)
    x[0, 7] = x[0, 9] = x.max() + 1  # a tie: the first index wins
    elements, stops = torch.randint(0, 20, (3, 8)), torch.tensor([2, 5, 11])
    with ont.native_generation_ops(), ont.fallback_policy("error"):
        d = x.to("neuron")
        torch.testing.assert_close(d.argmax(-1).cpu(), x.argmax(-1))
        torch.testing.assert_close(d.argmax(0, keepdim=True).cpu(), x.argmax(0, keepdim=True))
        torch.testing.assert_close(d.argmax().cpu(), x.argmax())
        assert d.argmax(-1)[0].item() == 7
        for invert in (False, True):
            found = torch.isin(elements.to("neuron"), stops.to("neuron"), invert=invert)
            torch.testing.assert_close(found.cpu(), torch.isin(elements, stops, invert=invert))
        values, indices = torch.sort(d[1:], descending=True, stable=True)
        expected = torch.sort(x[1:], descending=True, stable=True)
        torch.testing.assert_close((values.cpu(), indices.cpu()), tuple(expected))
        torch.testing.assert_close(torch.sort(d, dim=0).values.cpu(), torch.sort(x, dim=0).values)
    with ont.fallback_policy("error"), pytest.raises(NotImplementedError, match="argmax"):
        x.to("neuron").argmax()


@pytest.mark.parametrize("replacement", [False, True])
def test_native_multinomial_samples_the_distribution(replacement):
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    with ont.native_generation_ops(), ont.fallback_policy("error"):
        torch.manual_seed(0)
        draws = torch.multinomial(probs.repeat(20000, 1).to("neuron"), 2 if replacement else 1, replacement).cpu()
        torch.manual_seed(0)
        again = torch.multinomial(probs.repeat(20000, 1).to("neuron"), 2 if replacement else 1, replacement).cpu()
        distinct = torch.multinomial(probs.repeat(50, 1).to("neuron"), 3).cpu()
    assert torch.equal(draws, again)  # reproducible under torch.manual_seed
    frequencies = torch.bincount(draws.flatten(), minlength=4) / draws.numel()
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)
    assert frequencies[1] == 0  # never a zero-probability token
    assert all(len(set(row.tolist())) == 3 and 1 not in row.tolist() for row in distinct)


def test_native_multinomial_moves_one_random_number_per_draw_to_the_device():
    """A generation step's draw: one uniform number per row crosses from the host, not one per token."""
    from optimum_neuron_torch.device import reference

    probs = torch.softmax(torch.randn(3, 1000), -1).to("neuron")
    with ont.native_generation_ops():
        reference.clear_transfer_counts()
        torch.multinomial(probs, 1)
        assert reference.transfer_counts()["host_to_device_bytes"] == 3 * 4


def test_eager_generate_on_the_device_takes_no_fallback(tmp_path):
    folder = TINY_MODELS["llama"].save(tmp_path / "llama")
    cpu = LlamaForCausalLM.from_pretrained(folder).eval()
    device = LlamaForCausalLM.from_pretrained(folder).eval().to("neuron")
    ids = torch.randint(4, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    inputs = {"input_ids": ids.to("neuron"), "attention_mask": mask.to("neuron"), "max_new_tokens": 8}
    sampling = dict(do_sample=True, top_k=10, top_p=0.9, temperature=0.7, repetition_penalty=1.2)
    ont.clear_op_tracking()
    with ont.native_generation_ops(), ont.fallback_policy("error"):
        greedy = device.generate(**inputs, do_sample=False)
        sampled = []
        for _ in range(2):
            torch.manual_seed(3)
            sampled.append(device.generate(**inputs, **sampling).cpu())
    assert ont.fallback_ops() == []
    assert torch.equal(greedy.cpu(), cpu.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                  do_sample=False))
    assert torch.equal(*sampled)


# --- The TorchNeuron branch, in process ----------------------------------------------------------
# TorchNeuron's fallback never reports itself: it records each op name once in a tracker that the
# policy reads at module boundaries. tests/test_torchneuron.py runs this branch against the
# TorchNeuron stand-in in a subprocess; these tests run it in this process (where mutation testing
# can reach it) with a tracker that keeps TorchNeuron's conventions: names only, each once, until
# cleared.


class Tracker:
    """TorchNeuron's fallback tracker: a set of op names, read and cleared."""

    def __init__(self) -> None:
        self.ops: set[str] = set()
        self.clears = 0
        self.reads: list[bool] = []  # (whether each read waited for queued work)

    def fallback_ops(self, wait: bool = True) -> list[str]:
        self.reads.append(wait)
        return sorted(self.ops)

    def clear_op_tracking(self) -> None:
        self.ops.clear()
        self.clears += 1


class Falls(torch.nn.Module):
    """Records the ops of `names` as fallen back when it runs, as TorchNeuron's CPU fallback does."""

    def __init__(self, tracker: Tracker, *names: str) -> None:
        super().__init__()
        self.tracker, self.names = tracker, names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.tracker.ops.update(self.names)
        return x


class Outer(torch.nn.Module):
    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.first = Falls(tracker)
        self.inner = Falls(tracker, "aten::cumprod", "aten::argmax")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.first(x))


@pytest.fixture
def torchneuron(monkeypatch):
    """A policy object as it runs on TorchNeuron, its tracker, and a model that falls back."""
    from optimum_neuron_torch.fallbacks import policy

    tracker = Tracker()
    monkeypatch.setattr(policy, "_applied_per_op", lambda: False)
    monkeypatch.setattr(policy, "fallback_ops", tracker.fallback_ops)
    monkeypatch.setattr(policy, "clear_op_tracking", tracker.clear_op_tracking)
    monkeypatch.delenv("OPTIMUM_NEURON_TORCH_FALLBACK", raising=False)
    previous = ont.get_fallback_policy()  # the mode is kept by the device layer: restored afterwards
    created = []

    def make():
        created.append(policy._Policy())
        return created[-1]

    yield make, tracker, Outer(tracker)
    for made in created:
        made.set("silent")  # removes the hooks on the watched models' modules
    monkeypatch.undo()  # back on the reference device before the process's policy is restored
    ont.set_fallback_policy(previous)


def test_torchneuron_error_refuses_a_fallback_when_the_module_that_ran_it_ends(torchneuron):
    make, tracker, model = torchneuron
    watch(model)
    tracker.ops.add("aten::seen_before")
    current = make()
    assert current.mode == "warn" and tracker.clears == 0
    current.set("error")
    assert current.mode == "error"
    assert tracker.clears == 1 and tracker.ops == set()  # entering `error`: earlier ops count again
    current.set("error")
    assert tracker.clears == 1  # staying in `error` clears nothing
    with pytest.raises(NotImplementedError) as caught:
        model(torch.ones(2))
    assert str(caught.value) == (
        "Operator 'aten::argmax' fell back to CPU in module 'Outer.inner' (also aten::cumprod), and "
        "OPTIMUM_NEURON_TORCH_FALLBACK=error forbids fallbacks. On TorchNeuron the op has already run on "
        "the CPU when this is raised (at the start or end of the module that ran it)."
    )
    assert tracker.ops == set()  # forgotten once reported: the next module is judged on its own ops
    model.first(torch.ones(2))  # a module without fallbacks runs


def test_torchneuron_error_refuses_an_unwatched_models_fallback_when_its_block_ends(torchneuron):
    """A model neither loaded by the library nor passed to `watch`: nothing observes its modules, so
    on TorchNeuron its fallback is refused at the end of the `fallback_policy("error")` block."""
    make, tracker, model = torchneuron
    finished = False
    with pytest.raises(NotImplementedError, match=r"^Operator 'aten::argmax' fell back to CPU in code outside any "
                                                  r"module \(or in a compiled function\) \(also aten::cumprod\)"):
        with ont.fallback_policy("error"):
            model(torch.ones(2))
            finished = True
    assert finished


def test_torchneuron_error_lists_every_op_that_fell_back(torchneuron):
    make, tracker, _ = torchneuron
    make().set("error")
    falls = Falls(tracker, "aten::c", "aten::a", "aten::b")
    watch(falls)
    with pytest.raises(NotImplementedError, match=r"^Operator 'aten::a' fell back to CPU in module 'Falls' "
                                                  r"\(also aten::b, aten::c\), and "):
        falls(torch.ones(2))


def test_torchneuron_error_names_code_outside_any_module(torchneuron):
    make, tracker, model = torchneuron
    watch(model)
    current = make()
    current.set("error")
    tracker.ops.add("aten::nonzero")  # ran before the model call, outside any module
    with pytest.raises(NotImplementedError,
                       match=r"^Operator 'aten::nonzero' fell back to CPU in code outside any module "
                             r"\(or in a compiled function\), and"):
        model(torch.ones(2))
    assert tracker.ops == set()
    # Refused before the model's forward began: the module stack is still balanced, so the next
    # refusal names the right module.
    with pytest.raises(NotImplementedError,
                       match=r"^Operator 'aten::argmax' fell back to CPU in module 'Outer.inner' "):
        model(torch.ones(2))
    tracker.ops.add("aten::nonzero")
    with pytest.raises(NotImplementedError, match="in code outside any module"):
        model(torch.ones(2))


def test_torchneuron_error_names_the_caller_of_a_submodule(torchneuron):
    make, tracker, model = torchneuron
    current = make()
    current.set("error")

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Falls(tracker)

        def forward(self, x):
            tracker.ops.add("aten::sort")  # in the parent's own code, before it calls its child
            return self.child(x)

    parent = Parent()
    watch(parent)
    with pytest.raises(NotImplementedError, match=r"^Operator 'aten::sort' fell back to CPU in module 'Parent', and"):
        parent(torch.ones(2))


def test_torchneuron_default_warn_observes_only_the_models_the_library_loaded(torchneuron):
    """By default nothing observes the process's modules (no global hook, no wait per call): a model
    the library loaded warns after each call, reading the tracker without waiting for the device."""
    make, tracker, model = torchneuron
    modules = torch.nn.modules.module
    hooks = len(modules._global_forward_pre_hooks), len(modules._global_forward_hooks)
    make()
    assert (len(modules._global_forward_pre_hooks), len(modules._global_forward_hooks)) == hooks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2))  # not watched: nothing said
        tracker.ops.clear()
        watch(model)
        model(torch.ones(2))
        model(torch.ones(2))  # the same ops again: no new warning
    assert [str(warning.message).split(";")[0] for warning in caught] == [
        "Operator 'aten::argmax' fell back to CPU (during a call of 'Outer')",
        "Operator 'aten::cumprod' fell back to CPU (during a call of 'Outer')",
    ]
    assert tracker.reads and all(wait is False for wait in tracker.reads)  # never waited


def test_torchneuron_warn_once_per_op_after_the_outermost_call(torchneuron, monkeypatch):
    make, tracker, model = torchneuron
    tracker.ops.add("aten::known")  # recorded before the policy existed: never warned
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_FALLBACK", "warn")  # asked for: every module of a watched model
    current = make()  # the policy under test (kept alive by the fixture's `created` list)
    watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2))
        model(torch.ones(2))  # the same ops again: no new warning
        tracker.ops.add("aten::topk")  # outside any module: warned when the next call starts
        model(torch.ones(2))
    messages = [str(warning.message) for warning in caught]
    assert messages == [
        "Operator 'aten::argmax' fell back to CPU (during a call of 'Outer'); "
        "see optimum_neuron_torch.fallback_ops().",
        "Operator 'aten::cumprod' fell back to CPU (during a call of 'Outer'); "
        "see optimum_neuron_torch.fallback_ops().",
        "Operator 'aten::topk' fell back to CPU (outside any module); see optimum_neuron_torch.fallback_ops().",
    ]
    assert tracker.clears == 0  # `warn` never clears what the user may read
    assert tracker.reads and all(wait is True for wait in tracker.reads)  # asked for: each read waits for the device
    current.set("silent")
    tracker.ops.clear()  # (as the user's clear_op_tracking())
    current.set("warn")  # observing again: what it warned of before is not warned of again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2))
    assert caught == [] and tracker.ops == {"aten::argmax", "aten::cumprod"}


def test_torchneuron_warn_names_an_op_run_before_a_leaf_module_as_outside_any_module(torchneuron, monkeypatch):
    make, tracker, _ = torchneuron
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_FALLBACK", "warn")
    make()
    falls = Falls(tracker, "aten::sort")  # a module without submodules
    watch(falls)
    tracker.ops.add("aten::topk")  # before the call, outside any module
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        falls(torch.ones(2))
    assert [str(warning.message).split(";")[0] for warning in caught] == [
        "Operator 'aten::topk' fell back to CPU (outside any module)",
        "Operator 'aten::sort' fell back to CPU (during a call of 'Falls')",
    ]


def test_torchneuron_silent_from_the_start_warns_nothing(torchneuron, monkeypatch):
    make, tracker, model = torchneuron
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_FALLBACK", "silent")
    current = make()
    assert current.mode == "silent" and current.explicit and not current.observing
    # A model the library loaded, with an op no other test reports: the default `warn` would warn of it
    # after the call (so the check below fails unless the variable took effect).
    watch(model)
    tracker.ops.add("aten::silent_from_the_start")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(2))
    assert tracker.ops == {"aten::silent_from_the_start", "aten::argmax", "aten::cumprod"}


def test_torchneuron_silent_removes_the_observer(torchneuron):
    make, tracker, model = torchneuron
    watch(model)
    current = make()
    current.set("silent")
    assert current.mode == "silent"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(2))  # recorded, not warned
    assert tracker.ops == {"aten::argmax", "aten::cumprod"}
    current.set("error")
    with pytest.raises(NotImplementedError):
        model(torch.ones(2))
    current.set("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.ones(2))
    assert len(caught) == 2  # the observer is back for `warn`


def test_torchneuron_policy_from_the_environment(torchneuron, monkeypatch):
    make, tracker, model = torchneuron
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_FALLBACK", " Error ")
    assert make().mode == "error"
    monkeypatch.setenv("OPTIMUM_NEURON_TORCH_FALLBACK", "strict")
    with pytest.raises(ConfigurationError,
                       match=r"OPTIMUM_NEURON_TORCH_FALLBACK='strict' must be one of warn, error, silent\."):
        make()



@pytest.mark.parametrize("users_value", [None, "0"])
def test_torchneuron_error_stops_the_eager_rerun_of_failed_graphs_and_gives_the_setting_back(
        torchneuron, monkeypatch, users_value):
    make, tracker, model = torchneuron
    name = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"  # TorchNeuron reads it at each failed graph execution
    if users_value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, users_value)
    forks = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hooks: forks.append(hooks))
    current = make()
    assert current.mode == "warn" and current.explicit is False and os.environ.get(name) == users_value
    assert not current.observing and forks == []  # the default registers nothing
    for _ in range(2):  # (twice: the user's value is kept from the first time, not the library's "1")
        current.set("error")
        assert os.environ[name] == "1" and current.explicit is True and current.observing
        current.set("error")
        assert os.environ[name] == "1"
        current.set("warn", explicit=False)
        assert os.environ.get(name) == users_value and current.explicit is False
    assert len(forks) == 1 and set(forks[0]) == {"after_in_child"}  # a fork stops observing, registered once
    current.set("error")
    forks[0]["after_in_child"]()  # (what a forked child runs)
    assert not current.observing
