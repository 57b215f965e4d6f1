"""Tiny models of many architectures, built from configs (no downloads), saved as checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

import optimum_neuron_torch as ont

VOCAB = 128
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)


@dataclass(frozen=True)
class TinyModel:
    name: str
    config: transformers.PretrainedConfig
    auto_class: type  # Transformers' Auto class
    neuron_class: type  # ours

    @property
    def seq2seq(self) -> bool:
        return self.config.is_encoder_decoder

    def build(self, seed: int = 0) -> PreTrainedModel:
        torch.manual_seed(seed)
        return self.auto_class.from_config(self.config).eval()

    def save(self, folder: Path, dtype: torch.dtype = torch.float32, shard_size: str | None = None) -> Path:
        model = self.build().to(dtype)
        model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
        return folder

    def inputs(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(4, VOCAB, (2, 10), generator=generator)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self.seq2seq:
            inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (2, 6), generator=generator)
        return {key: value.to(device) for key, value in inputs.items()}


def _tiny(name, config_class, auto, neuron, **kwargs):
    return TinyModel(name, getattr(transformers, config_class)(**kwargs), getattr(transformers, auto), getattr(ont, neuron))


CAUSAL = ("AutoModelForCausalLM", "NeuronAutoModelForCausalLM")
TINY_MODELS = {
    m.name: m
    for m in [
        _tiny("llama", "LlamaConfig", *CAUSAL, **DECODER, tie_word_embeddings=True),
        _tiny("mistral", "MistralConfig", *CAUSAL, **DECODER),
        _tiny("qwen2", "Qwen2Config", *CAUSAL, **DECODER),
        _tiny("gemma2", "Gemma2Config", *CAUSAL, **DECODER, head_dim=8),
        _tiny("phi3", "Phi3Config", *CAUSAL, **DECODER, pad_token_id=0),
        _tiny("gpt2", "GPT2Config", *CAUSAL, vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        _tiny("gpt_neox", "GPTNeoXConfig", *CAUSAL, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
        _tiny("opt", "OPTConfig", *CAUSAL, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
              num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64),
        _tiny("bert", "BertConfig", "AutoModelForMaskedLM", "NeuronAutoModelForMaskedLM", vocab_size=VOCAB, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
        _tiny("roberta", "RobertaConfig", "AutoModelForSequenceClassification", "NeuronAutoModelForSequenceClassification",
              vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, pad_token_id=1, num_labels=3),
        _tiny("bert_tokens", "BertConfig", "AutoModelForTokenClassification", "NeuronAutoModelForTokenClassification",
              vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, num_labels=5),
        _tiny("roberta_qa", "RobertaConfig", "AutoModelForQuestionAnswering", "NeuronAutoModelForQuestionAnswering",
              vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, pad_token_id=1),
        _tiny("bert_base", "BertConfig", "AutoModel", "NeuronAutoModel", vocab_size=VOCAB, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
        _tiny("t5", "T5Config", "AutoModelForSeq2SeqLM", "NeuronAutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32,
              d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0),
        _tiny("bart", "BartConfig", "AutoModelForSeq2SeqLM", "NeuronAutoModelForSeq2SeqLM", vocab_size=VOCAB, d_model=32,
              encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
              encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64),
    ]
}


def outputs(model: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's main output tensor (logits, or the last hidden state), on the CPU."""
    with torch.no_grad():
        result = model(**inputs)
    main = result.logits if hasattr(result, "logits") else getattr(result, "start_logits", None)
    if main is None:
        main = result.last_hidden_state
    return main.cpu()
