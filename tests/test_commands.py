"""`optimum-cli neuron-torch` commands, run as subprocesses: generate, compile, env, their help and
their errors (check and cache have their own tests in test_check.py and test_compile_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import optimum_neuron_torch
from optimum_neuron_torch.commands.models import load_generative_model
from optimum_neuron_torch.commands.serve import serving_buckets
from optimum_neuron_torch.compiler.cache import CompileCache, cache_stats, reset_cache_stats
from optimum_neuron_torch.generation.buckets import Buckets
from optimum_neuron_torch.generation.engine import GenerationEngine
from optimum_neuron_torch.settings import COMPILE_CACHE_ENV as CACHE_ENV
from testing_utils import optimum_cli
from tiny_models import PROGRAMS_PER_GRAPH, TINY_MODELS, chat_tokenizer

PROMPT = "what is the capital of france?"
NEW_TOKENS = 8
BUCKETS = ("--batch-sizes", "1", "--prompt-buckets", "16", "--max-length", "64", "--context-buckets", "32")
RUN, DISTINCT = 7 * PROGRAMS_PER_GRAPH, 13  # the programs the 7 graphs of BUCKETS run, and the distinct ones


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Mistral with a real tokenizer that has a chat template; seed 5 makes its greedy answers to
    both prompts vary (with 6 different tokens of 8) rather than repeat one token."""
    folder = TINY_MODELS["mistral"].save(tmp_path_factory.mktemp("commands") / "mistral", seed=5)
    chat_tokenizer().save_pretrained(folder)  # (the same special-token ids as the tiny Mistral's config)
    return folder


@pytest.fixture(scope="module")
def compiled(chat_model, tmp_path_factory) -> tuple[str, Path, Path]:
    """`compile` into an empty cache, saving the model: its stdout, the cache and the saved folder.
    The generate tests run with this cache, so that they load its graphs instead of compiling them."""
    root = tmp_path_factory.mktemp("compiled")
    done = optimum_cli("compile", str(chat_model), *BUCKETS, "--save", str(root / "saved"),
                       env={CACHE_ENV: str(root / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, root / "cache", root / "saved"


def cpu_greedy_text(folder: Path, inputs: dict[str, torch.Tensor]) -> str:
    """What Transformers on the CPU generates greedily for `inputs`, decoded as the streamer decodes."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokens = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert len(set(tokens.tolist())) > 1, "the tiny model repeats one token: the comparison would prove little"
    return AutoTokenizer.from_pretrained(folder).decode(tokens, skip_special_tokens=True)


MODEL_OPTIONS = ["--model", "--dtype", "float32", "bfloat16"]
SPLIT = ["--tensor-parallel-size", "--tp-size"]


@pytest.mark.parametrize("command, described", [
    ((), ["generate", "check", "compile", "cache", "env"]),
    (("generate",), ["prompt", *MODEL_OPTIONS, *SPLIT, "--max-new-tokens", "--do-sample", "--temperature", "--top-k",
                     "--top-p", "--seed", "--no-chat-template", "--system"]),
    (("check",), ["MODEL", *MODEL_OPTIONS, "--format", "--strict", "--no-patches", "--no-compile",
                  "--sequence-length"]),
    (("compile",), ["MODEL", *MODEL_OPTIONS, *SPLIT, "--batch-sizes", "--prompt-buckets", "--max-length",
                    "--context-buckets", "--save", "--dry-run"]),
    (("serve",), ["MODEL", *MODEL_OPTIONS, *SPLIT, "--host", "--port", "--batch-size", "--prefill-budget",
                  "--prompt-logprobs", "--tool-call-parser", "--task", "--enable-prefix-caching"]),
    (("cache",), ["list", "stats", "clear", "push", "pull"]),
    (("cache", "push"), ["destination", "hf://"]),
    (("cache", "pull"), ["source", "@revision"]),
    (("cache", "list"), ["List the compiled graphs"]),
    (("cache", "stats"), ["Show where the compile cache is"]),
    (("cache", "clear"), ["Remove every compiled graph"]),
    (("env",), ["--format", "text", "json"]),
])
def test_every_command_has_help_with_examples(command, described):
    done = optimum_cli(*command, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: optimum-cli neuron-torch {' '.join(command)}".rstrip())
    for word in described:
        assert word in done.stdout
    examples = done.stdout.partition("\nexamples:\n")[2].splitlines()
    assert examples and all(f"optimum-cli neuron-torch {' '.join(command)}".rstrip() in line
                            for line in examples), done.stdout


def test_the_help_names_the_default_model_the_library_loads():
    # (the commands' arguments import no library code: they spell the name out, and must agree)
    from optimum.commands.register.neuron_torch_commands.base import DEFAULT_MODEL_HELP

    assert f"default: {optimum_neuron_torch.DEFAULT_MODEL}," in DEFAULT_MODEL_HELP


@pytest.mark.parametrize("args, error", [
    (("check",), "a model is needed: give it as MODEL or with --model"),
    (("compile", "--dry-run"), "a model is needed: give it as MODEL or with --model"),
    (("compile", "one", "--model", "other"), "two models given: 'one' and --model 'other'; give one"),
    (("serve", "--dtype", "int3"), "argument --dtype: invalid choice: 'int3'"),
])
def test_a_model_argument_missing_twice_or_wrong_is_a_usage_error(args, error):
    done = optimum_cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: optimum-cli neuron-torch") and error in done.stderr, done.stderr


def test_generate_streams_the_chat_answer_of_transformers(chat_model, compiled):
    """On the folder `compile --save` wrote: its graphs serve generate(), which compiles nothing."""
    system = "answer in one word"
    entries = sorted(entry.key for entry in CompileCache(compiled[1]).entries())
    done = optimum_cli("generate", PROMPT, "--model", str(compiled[2]), "--max-new-tokens", str(NEW_TOKENS),
                       "--system", system, env={CACHE_ENV: str(compiled[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(entry.key for entry in CompileCache(compiled[1]).entries()) == entries

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert done.stdout == cpu_greedy_text(chat_model, inputs) + "\n"  # the answer only: no prompt, no notes


def test_generate_reads_the_prompt_from_stdin(chat_model, compiled):
    done = optimum_cli("generate", "--model", str(compiled[2]), "--max-new-tokens", str(NEW_TOKENS),
                       "--no-chat-template",
                       env={CACHE_ENV: str(compiled[1])}, input=f"{PROMPT}\n")
    assert done.returncode == 0, done.stderr[-3000:]

    inputs = AutoTokenizer.from_pretrained(chat_model)(PROMPT, return_tensors="pt")
    assert done.stdout == cpu_greedy_text(chat_model, inputs) + "\n"


def test_compile_reports_its_graphs_and_saves_them_with_the_model(chat_model, compiled, tmp_path):
    stdout, cache, saved = compiled
    assert "batch sizes [1], prompt buckets [16], max length 64, context buckets [32, 64]" in stdout
    # the prompt bucket's prefill, a chunk of a longer prompt per context bucket (32, 64), a decode step
    # and one that samples per context bucket: 7 graphs, 21 programs (PROGRAMS_PER_GRAPH), of which 13
    # distinct (the bill's count, below); the other 8 load what another graph compiled
    assert f"{DISTINCT} graphs compiled" in stdout and f"{RUN - DISTINCT} loaded from the compile cache" in stdout
    assert str(cache) in stdout

    spec = json.loads((saved / "neuron_generation.json").read_text())
    assert spec["buckets"] == {"batch_sizes": [1], "prompt_buckets": [16], "max_length": 64,
                               "context_buckets": [32, 64]}
    assert sorted(spec["graphs"]) == sorted(entry.key for entry in CompileCache(cache).entries())
    assert AutoTokenizer.from_pretrained(saved).get_vocab() == AutoTokenizer.from_pretrained(chat_model).get_vocab()

    # The saved folder arrives precompiled: its graphs join an empty cache and nothing compiles.
    again = optimum_cli("compile", str(saved), *BUCKETS, env={CACHE_ENV: str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 graphs compiled" in again.stdout and f"{RUN} loaded from the compile cache" in again.stdout


def test_serve_on_a_compiled_and_saved_model_compiles_nothing(compiled, monkeypatch):
    """The server's engine on the folder `compile --save` wrote, with the buckets it was saved with:
    every graph it warms up loads from the cache (a warm start, traced by Dynamo or not, compiles no
    program)."""
    monkeypatch.setenv(CACHE_ENV, str(compiled[1]))
    torch._dynamo.reset()
    reset_cache_stats()
    model = load_generative_model(str(compiled[2]))
    engine = GenerationEngine(model, serving_buckets(model), AutoTokenizer.from_pretrained(compiled[2]))
    engine.warm_up(show_progress=False)
    assert (cache_stats().misses, cache_stats().hits) == (0, RUN)
    assert serving_buckets(model, batch_size=2).batch_sizes == (1, 2)  # (options given replace the saved ones)


def test_serve_with_a_shorter_max_length_keeps_the_prompt_buckets_that_fit():
    """`serve --max-length 512` on a model saved with prompt buckets up to 1024: those up to half of 512."""
    model = SimpleNamespace(config=transformers.LlamaConfig(max_position_embeddings=4096),
                            neuron_generation=SimpleNamespace(buckets=Buckets((1, 8), (16, 64, 256, 1024), 2048)))
    assert serving_buckets(model, max_length=512) == Buckets((1, 2, 4, 8), (16, 64, 256), 512)
    assert serving_buckets(model, max_length=20).prompt_buckets == (10,)  # (none fits: the defaults for 20)
    assert serving_buckets(model, max_length=512, prompt_buckets=(32,)).prompt_buckets == (32,)


@pytest.mark.parametrize("model_as", ["MODEL", "--model"])
def test_compile_dry_run_prints_the_bill_and_compiles_nothing(chat_model, tmp_path, model_as):
    model = [str(chat_model)] if model_as == "MODEL" else ["--model", str(chat_model)]
    done = optimum_cli("compile", *model, *BUCKETS, "--dry-run", env={CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    # the same 7 graphs `compile` reports compiling for these buckets (test above)
    assert "MistralForCausalLM: the compile bill (--dry-run: nothing compiled)" in done.stdout
    assert "graphs to compile: 7 graphs: 1 prefill, 2 chunk, 2 decode, 2 sampling decode" in done.stdout
    assert f"distinct programs after layer reuse: {DISTINCT} (" in done.stdout
    assert list(CompileCache(tmp_path / "cache").entries()) == []


def test_env_reports_backend_versions_devices_and_caches(tmp_path):
    cache = tmp_path / "cache"
    env = {CACHE_ENV: str(cache), "OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "1GiB"}
    text = optimum_cli("env", env=env)
    assert text.returncode == 0, text.stderr[-3000:]
    expected = {f"backend: reference {optimum_neuron_torch.__version__}", f"torch: {torch.__version__}",
                f"transformers: {transformers.__version__}", "devices: 1",
                "  neuron:0: 1.00 GiB", "support profile: torchneuron",
                f"compile cache: {cache}", f"  {CACHE_ENV}={cache}"}
    assert expected <= set(text.stdout.splitlines()), text.stdout

    report = json.loads(optimum_cli("env", "--format", "json", env=env).stdout)
    assert report["backend"] == {"name": "reference", "version": optimum_neuron_torch.__version__}
    assert report["versions"]["transformers"] == transformers.__version__
    assert [device["memory_bytes"] for device in report["devices"]] == [2**30]
    assert report["caches"]["compile"] == str(cache)
    assert env.items() <= report["environment_variables"].items()  # and whatever else the caller's environment sets


@pytest.mark.parametrize("args, env, failure", [
    (("generate", "hi", "--model", "{missing}"), {}, "cannot generate with {missing}: CheckpointNotFoundError:"),
    (("env",), {"OPTIMUM_NEURON_TORCH_DEVICE_MEMORY": "lots"},
     "cannot report the environment: ConfigurationError: OPTIMUM_NEURON_TORCH_DEVICE_MEMORY='lots' is not a size"),
])
def test_failures_are_one_line_and_status_2(tmp_path, args, env, failure):
    missing = str(tmp_path / "missing")
    done = optimum_cli(*(arg.format(missing=missing) for arg in args), env=env)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {failure.format(missing=missing)}")
