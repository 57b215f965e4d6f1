"""Tiny models of many architectures, built from configs (no downloads), saved as checkpoints."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedModel, PreTrainedTokenizerFast

import optimum_neuron_torch as ont

VOCAB = 128
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
# Compiled generation hands the compiler each graph of a decoder as programs: the code before its
# decoder layers, one layer (compiled once for all of them, see `compiler/regions.py`), the code after.
PROGRAMS_PER_GRAPH = 3


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
        """The model with every floating parameter and saved buffer randomized under `seed`.

        Transformers' init leaves norms at 1 and biases at 0: a tensor left at its init could not be
        told from a loaded one, and a bug that skips it would pass. Each gets noise (std 0.1) on top."""
        torch.manual_seed(seed)
        model = self.auto_class.from_config(self.config).eval()
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            seen: set[int] = set()
            for tensor in model.state_dict().values():  # parameters and persistent buffers
                if tensor.is_floating_point() and tensor.data_ptr() not in seen:  # a tied tensor once
                    seen.add(tensor.data_ptr())
                    tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))
        return model

    def save(self, folder: Path, dtype: torch.dtype = torch.float32, shard_size: str | None = None,
             seed: int = 0) -> Path:
        model = self.build(seed).to(dtype)
        model.save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
        return folder

    def save_with_tokenizer(self, folder: Path) -> Path:
        """The checkpoint and a tokenizer of its family (`tiny_tokenizer`), in one folder."""
        self.save(folder)
        tiny_tokenizer(self.config.model_type).save_pretrained(folder)
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
    return TinyModel(name, getattr(transformers, config_class)(**kwargs), getattr(transformers, auto),
                     getattr(ont, neuron))


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
        _tiny("bert", "BertConfig", "AutoModelForMaskedLM", "NeuronAutoModelForMaskedLM", vocab_size=VOCAB,
              hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64),
        _tiny("roberta", "RobertaConfig", "AutoModelForSequenceClassification",
              "NeuronAutoModelForSequenceClassification",
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
        _tiny("bart", "BartConfig", "AutoModelForSeq2SeqLM", "NeuronAutoModelForSeq2SeqLM", vocab_size=VOCAB,
              d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
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


# Tokenizers for the tiny models: WordPiece over a vocabulary of VOCAB tokens drawn from a few sentences (each
# family's special tokens, in id order so that their ids are those of the tiny configs; the characters, alone and
# as word continuations; then the most frequent words), with the family's templates.
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "paris is the capital of france and berlin is the capital of germany",
    "a small model runs on the neuron device",
    "compiled graphs make generation fast, and nothing recompiles after warm-up",
    "my name is sarah and i live in london",
    "what is the answer to the question?",
    "rivers flow through green valleys while birds sing in tall trees near the old stone bridge",
    "engineers write tests that compare every output with the reference on the cpu",
    "she bought seven apples, three oranges and a loaf of fresh bread at the market yesterday",
]
TOKENIZER_FAMILIES = {  # model_type: (special tokens in id order, single template, pair template)
    "bert": (dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"),
             "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "roberta": (dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", mask_token="<mask>"),
                "<s> $A </s>", "<s> $A </s> </s> $B </s>"),
    "llama": (dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>"), "<s> $A", "<s> $A <s> $B"),
    "t5": (dict(pad_token="<pad>", eos_token="</s>", unk_token="<unk>"), "$A </s>", "$A </s> $B </s>"),
}


def tiny_tokenizer(model_type: str) -> PreTrainedTokenizerFast:
    """A real WordPiece tokenizer of VOCAB tokens, the same in every run, for the tiny models of `model_type`."""
    special_tokens, single, pair = TOKENIZER_FAMILIES[model_type]
    words = Counter(word for sentence in SENTENCES for word in re.findall(r"\w+|[^\w\s]", sentence))
    characters = sorted({character for word in words for character in word})
    pieces = [*special_tokens.values(), *characters,
              *("##" + character for character in characters if character.isalpha())]
    frequent = sorted((word for word in words if word not in pieces), key=lambda word: (-words[word], word))
    vocabulary = {token: index for index, token in enumerate((pieces + frequent)[:VOCAB])}
    backend = Tokenizer(models.WordPiece(vocabulary, unk_token=special_tokens["unk_token"]))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(token, vocabulary[token]) for token in special_tokens.values()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


# Chat models for the commands and the server: a template that writes each message as "role content ".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny Llama family's tokenizer with CHAT_TEMPLATE."""
    tokenizer = tiny_tokenizer("llama")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def noisy_llama(**config) -> transformers.LlamaForCausalLM:
    """A tiny Llama (DECODER, with `config` over it) whose random weights carry extra noise, so that its
    greedy answers vary from token to token, and without an end-of-sequence token: every answer runs to
    its token limit or a stop string. The same weights in every run (seed 0)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**DECODER, **config})).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(0.1 * torch.randn_like(tensor))
    model.generation_config.eos_token_id = None
    return model


# A tiny Whisper: ids below 60 are text (bytes 32-91), then end of text (60), start of transcript (61),
# transcribe (62), no timestamps (63) and the 1501 timestamps (64-1564) its long-form generation needs.
WHISPER = dict(vocab_size=1565, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
               max_source_positions=1500, max_target_positions=64, bos_token_id=60, eos_token_id=60, pad_token_id=60,
               decoder_start_token_id=61, suppress_tokens=[], begin_suppress_tokens=[60])


def tiny_whisper() -> transformers.WhisperForConditionalGeneration:
    """A tiny Whisper (WHISPER) whose random weights carry noise strong enough (std 0.5) that its
    greedy transcripts vary from token to token; the same weights in every run (seed 0)."""
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER)).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.5 * torch.randn_like(tensor))
    config = model.generation_config
    config.no_timestamps_token_id, config.max_initial_timestamp_index, config.forced_decoder_ids = 63, 50, None
    config._from_model_config = False  # (else a saved checkpoint's generation config is made again from its config)
    return model


def whisper_tokenizer() -> transformers.WhisperTokenizer:
    """The tokenizer of `tiny_whisper`'s ids (byte-level: "Ġ" is the space)."""
    vocab = {("\u0120" if byte == 32 else chr(byte)): index for index, byte in enumerate(range(32, 92))}
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|transcribe|>", "<|notimestamps|>"]
    for token in specials + [f"<|{index * 0.02:.2f}|>" for index in range(1501)]:
        vocab[token] = len(vocab)
    return transformers.WhisperTokenizer(vocab=vocab, merges=[], pad_token=specials[0],
                                         additional_special_tokens=specials[1:])


W2V = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=4, classifier_proj_size=16, pad_token_id=0)


def save_audio_and_image_checkpoint(name: str, folder: Path) -> Path:
    """A tiny checkpoint with the preprocessing its pipeline loads, in `folder`: "whisper" (speech
    recognition: `tiny_whisper` and a `WhisperProcessor`), "wav2vec2_ctc" (speech recognition,
    CTC), "wav2vec2_audio" (audio classification), "vit" (image classification), "vits" (text
    to speech, without phonemizer) or "llava" (image-text-to-text: a CLIP vision tower, a Llama
    and a processor with a chat template of text and image parts)."""
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    if name == "whisper":
        model = tiny_whisper()
        parts = [transformers.WhisperFeatureExtractor(), whisper_tokenizer()]
    elif name == "wav2vec2_ctc":
        characters = ["<pad>", "<s>", "</s>", "<unk>", "|", *"abcdefghijklmnopqrstuvwxyz'"]
        (folder / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(characters)}))
        model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**W2V))
        parts = [transformers.Wav2Vec2FeatureExtractor(), transformers.Wav2Vec2CTCTokenizer(folder / "vocab.json")]
    elif name == "wav2vec2_audio":
        labels = {0: "yes", 1: "no", 2: "up"}
        model = transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(**W2V, id2label=labels))
        parts = [transformers.Wav2Vec2FeatureExtractor()]
    elif name == "vit":
        labels = {index: f"class {index}" for index in range(5)}
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8, id2label=labels))
        parts = [transformers.ViTImageProcessor(size={"height": 32, "width": 32})]
    elif name == "vits":
        characters = ["k", "_", *"abcdefghijklmnopqrstuvwxyz ", "<unk>"]
        (folder / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(characters)}))
        model = transformers.VitsModel(transformers.VitsConfig(
            vocab_size=len(characters), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
            flow_size=16, spectrogram_bins=33, upsample_initial_channel=32, upsample_rates=[4, 4],
            upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
            prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=1, duration_predictor_num_flows=2,
            duration_predictor_filter_channels=32, posterior_encoder_num_wavenet_layers=1, noise_scale=0.0,
            noise_scale_duration=0.0, sampling_rate=16000))
        parts = [transformers.VitsTokenizer(folder / "vocab.json", phonemize=False)]
    elif name == "llava":
        tokenizer = tiny_tokenizer("llama")
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        tokenizer.chat_template = (
            "{% for message in messages %}{{ message['role'] }} {% for part in message['content'] %}"
            "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %} {% endfor %}"
            "{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=32, patch_size=8)
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=vision, text_config=transformers.LlamaConfig(**{**DECODER, "vocab_size": len(tokenizer)}),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>")))
        with torch.no_grad():  # (noise strong enough that its greedy answers vary)
            for tensor in model.state_dict().values():
                tensor.add_(0.3 * torch.randn_like(tensor))
        model.generation_config.eos_token_id = None
        parts = [transformers.LlavaProcessor(
            image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                            crop_size={"height": 32, "width": 32}),
            tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=tokenizer.chat_template)]
    else:
        raise ValueError(f"no tiny audio or image checkpoint {name!r}")
    model.eval().save_pretrained(folder)
    for part in parts:
        part.save_pretrained(folder)
    return folder


def tones(seconds: float, seed: int = 0, rate: int = 16000) -> numpy.ndarray:
    """`seconds` of audio at `rate` Hz: a tone whose pitch depends on `seed`, with some noise."""
    random = numpy.random.RandomState(seed)
    samples = numpy.arange(int(rate * seconds))
    return (0.5 * numpy.sin(samples * (0.01 + 0.05 * random.rand())) + 0.05 * random.randn(len(samples))
            ).astype(numpy.float32)


def greedy_answer(cpu_model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompt: list[int],
                  new_tokens: int) -> tuple[list[int], str]:
    """Transformers' greedy tokens on the CPU after `prompt`, and their text."""
    with torch.no_grad():
        output = cpu_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    tokens = output[0, len(prompt):].tolist()
    return tokens, tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# Tiny models for tensor parallelism: heads, key-value heads, experts and intermediate sizes that 2 and 4 ranks divide.
SPLITTABLE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=64)
TENSOR_PARALLEL_MODELS = {
    m.name: m
    for m in [
        _tiny("llama", "LlamaConfig", *CAUSAL, **SPLITTABLE, tie_word_embeddings=True),
        _tiny("mistral", "MistralConfig", *CAUSAL, **SPLITTABLE),
        _tiny("qwen2", "Qwen2Config", *CAUSAL, **SPLITTABLE),
        _tiny("qwen3", "Qwen3Config", *CAUSAL, **SPLITTABLE, head_dim=8),
        _tiny("gemma2", "Gemma2Config", *CAUSAL, **SPLITTABLE, head_dim=8),
        _tiny("gemma3", "Gemma3TextConfig", *CAUSAL, **SPLITTABLE, head_dim=8),
        _tiny("phi3", "Phi3Config", *CAUSAL, **SPLITTABLE, pad_token_id=0),
        _tiny("olmo2", "Olmo2Config", *CAUSAL, **SPLITTABLE),
        _tiny("qwen3_moe", "Qwen3MoeConfig", *CAUSAL, **SPLITTABLE, head_dim=8, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, decoder_sparse_step=1),
    ]
}
