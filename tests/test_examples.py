"""The examples run as written and print what they promise. The generation examples use the default
model, so they share its compiled graphs (batch 1, prompt bucket 64) through the compile
cache: only the first to run compiles them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import optimum_neuron_torch as ont
from optimum_neuron_torch.compatibility import NEEDS_PATCHES
from tiny_models import save_audio_and_image_checkpoint

pytestmark = pytest.mark.slow  # the examples run as written, on the real default model

EXAMPLES = Path(__file__).parent.parent / "examples"


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """Runs `examples/NAME ARGS` in a fresh interpreter and checks that it succeeded."""
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_quickstart_answers_on_neuron_with_the_cpu_tokens():
    stdout = run_example("quickstart.py").stdout  # the README's main command
    assert "generated on neuron:0: 'The capital of France is Paris.'" in stdout
    assert "same tokens as on the CPU: True" in stdout
    assert "ops that fell back to the CPU: none" in stdout  # compiled generation: decoding ops run natively
    assert float(re.search(r"device memory in use: ([\d.]+) MiB", stdout).group(1)) > 500  # 134.5M float32 weights


def test_streaming_prints_the_answer_as_it_comes():
    folder = str(ont.default_model_path())  # a local folder given as --model works like the default
    greedy = run_example("text_generation_streaming.py", "--model", folder,
                         "--prompt", "What is the capital of France?", "--new-tokens", "12").stdout
    assert re.fullmatch(r"The capital of France is Paris\.\n\[8 new tokens in [\d.]+ s.*\]\n", greedy), greedy

    sampling = ["--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--new-tokens", "12"]
    first, second = (run_example("text_generation_streaming.py", *sampling).stdout for _ in range(2))
    text, summary = first.rsplit("\n[", 1)
    assert text.strip() and summary.startswith("12 new tokens")
    assert first.split("\n[")[0] == second.split("\n[")[0]  # the same seed samples the same text


def test_batch_generation_equals_one_prompt_at_a_time():
    stdout = run_example("batch_generation.py").stdout
    assert re.search(r"3 prompts of \[\d+, \d+, \d+\] tokens -> batch bucket 4, prompt bucket 64", stdout), stdout
    assert "'What is the capital of France?' -> 'The capital of France is Paris.'" in stdout
    assert "same answers as one prompt at a time: True" in stdout


def test_embeddings_rank_the_similar_sentences_first():
    stdout = run_example("embeddings.py").stdout
    assert "4 embeddings of size 384 on neuron:0" in stdout
    assert "most similar pair: 'A man is eating food.' and 'A man is eating a piece of bread.'" in stdout
    assert "same embeddings as on the CPU: True" in stdout


def test_compatibility_check_reports_the_complex_rope_patch():
    report = json.loads(run_example("compatibility_check.py", "--format", "json").stdout)
    assert report["verdict"] == NEEDS_PATCHES
    assert [patch["name"] for patch in report["patches"]] == ["complex_rope"]
    assert [use["dtype"] for use in report["unpatched_dtypes"]] == ["complex64"]  # what the model hit without it
    assert report["graph_count"] == 1 and report["graph_breaks"] == []


def test_finetune_trains_a_lora_adapter_on_neuron():
    stdout = run_example("finetune.py", "--epochs", "2").stdout
    assert "training on neuron:0, 6 steps" in stdout
    first, last = map(float, re.search(r"loss: ([\d.]+) \(first step\) -> ([\d.]+)", stdout).groups())
    assert last < first - 1.0, stdout  # the answers are learnt
    assert "the merged model answers as the adapter model does" in stdout


def test_speech_to_text_to_speech_equals_the_cpu(tmp_path):
    """The example on tiny checkpoints (its defaults are Hub models, unreachable here): speech read by a
    VITS model and transcribed by a Whisper model on compiled graphs, each equal to the CPU's."""
    tts = save_audio_and_image_checkpoint("vits", tmp_path / "vits")
    asr = save_audio_and_image_checkpoint("whisper", tmp_path / "whisper")
    stdout = run_example("speech_to_text_to_speech.py", "--tts-model", str(tts), "--asr-model", str(asr),
                         "--text", "hello world", "--max-new-tokens", "16").stdout
    assert re.search(r"speech: [\d.]+ s at 16000 Hz on neuron:0 \(same as the CPU: True\)", stdout), stdout
    assert "(same as the CPU: True)\nreal-time factor of the transcription: " in stdout, stdout
