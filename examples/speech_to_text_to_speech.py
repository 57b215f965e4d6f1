"""Text to speech to text on the `neuron` device: a text-to-speech model reads a sentence aloud, and a
speech recognition model transcribes the speech back, each checked against the same pipeline on the CPU.

Both run as Transformers pipelines (`optimum_neuron_torch.pipeline(task, model)`), loaded with the Neuron
Auto classes. Whisper's generation runs on compiled graphs: an encoder and a decode step per batch size,
compiled once, whatever the audio's length (30-second windows; longer audio in chunks). Prints the speech's
length, the transcript, whether each output equals the CPU's, and the real-time factor of the
transcription (seconds of compute per second of audio). It runs unchanged on a Trainium instance with
TorchNeuron installed.

Usage:
    python examples/speech_to_text_to_speech.py [--tts-model facebook/mms-tts-eng]
        [--asr-model openai/whisper-tiny.en] [--text "..."] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import numpy
import transformers

import optimum_neuron_torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tts-model", default="facebook/mms-tts-eng", help="a text-to-speech Hub id or folder")
    parser.add_argument("--asr-model", default="openai/whisper-tiny.en", help="a speech recognition Hub id or folder")
    parser.add_argument("--text", default="The capital of France is Paris.")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    # Greedy decoding: Transformers' speech recognition pipeline searches 5 beams by default, whose
    # decode steps run eagerly (its beam search calls the model itself, not the compiled step).
    greedy = {"generate_kwargs": {"num_beams": 1, "max_new_tokens": args.max_new_tokens}}

    speaker = optimum_neuron_torch.pipeline("text-to-audio", args.tts_model)
    speech = speaker(args.text)
    expected = transformers.pipeline("text-to-audio", model=args.tts_model, device="cpu")(args.text)
    audio, rate = speech["audio"].squeeze(), speech["sampling_rate"]
    print(f"speech: {audio.shape[-1] / rate:.2f} s at {rate} Hz on {speaker.model.device} "
          f"(same as the CPU: {numpy.allclose(speech['audio'], expected['audio'], rtol=1e-4, atol=1e-5)})")

    listener = optimum_neuron_torch.pipeline("automatic-speech-recognition", args.asr_model)
    clip = {"raw": audio, "sampling_rate": rate}
    transcript = listener(dict(clip), **greedy)["text"]  # (compiles Whisper's graphs, once)
    began = time.perf_counter()
    listener(dict(clip), **greedy)
    seconds = time.perf_counter() - began
    cpu = transformers.pipeline("automatic-speech-recognition", model=args.asr_model, device="cpu")
    print(f"transcript: {transcript!r} (same as the CPU: {transcript == cpu(dict(clip), **greedy)['text']})")
    print(f"real-time factor of the transcription: {seconds / (audio.shape[-1] / rate):.3f}")


if __name__ == "__main__":
    main()
