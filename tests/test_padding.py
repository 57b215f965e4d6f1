"""How compiled generation pads a call to its buckets and cuts the output back, exactly
(optimum_neuron_torch.generation.padding). End to end, tests/test_generation.py compares padded
compiled generation with eager Transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput

from optimum_neuron_torch.generation.padding import (
    PaddingRowsDone,
    PromptStreamed,
    UnpaddedStreamer,
    default_attention_mask,
    fill_rows,
    pad_prompt,
    pad_token_id,
    prompt_streamed,
    unpad,
)

IDS = torch.tensor([[5, 6, 7], [8, 9, 1]])
MASK = torch.tensor([[1, 1, 1], [0, 1, 1]])


def test_pad_token_id_is_the_pad_token_when_it_is_in_the_vocabulary_else_0():
    assert pad_token_id(GenerationConfig(pad_token_id=7), vocab_size=8) == 7
    assert pad_token_id(GenerationConfig(pad_token_id=0), vocab_size=8) == 0
    assert pad_token_id(GenerationConfig(pad_token_id=8), vocab_size=8) == 0  # one past the vocabulary
    assert pad_token_id(GenerationConfig(pad_token_id=None), vocab_size=8) == 0
    for invalid in (-1, [3, 4]):  # GenerationConfig() refuses these; a config edited afterwards may hold them
        config = GenerationConfig()
        config.pad_token_id = invalid
        assert pad_token_id(config, vocab_size=8) == 0
    assert type(pad_token_id(GenerationConfig(pad_token_id=7), vocab_size=8)) is int


def test_default_attention_mask_masks_pad_tokens_unless_they_end_sequences():
    ids = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]])
    masked = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    ones = torch.ones_like(ids)
    for config, expected in [
        (GenerationConfig(pad_token_id=0, eos_token_id=2), masked),
        (GenerationConfig(pad_token_id=0, eos_token_id=[2, 3]), masked),
        (GenerationConfig(pad_token_id=0, eos_token_id=None), masked),
        (GenerationConfig(pad_token_id=0, eos_token_id=0), ones),  # pad == eos: Transformers masks nothing
        (GenerationConfig(pad_token_id=0, eos_token_id=[2, 0]), ones),
        (GenerationConfig(pad_token_id=None, eos_token_id=2), ones),
        (GenerationConfig(pad_token_id=9, eos_token_id=2), ones),  # no pad token in the ids
    ]:
        mask = default_attention_mask(ids, config)
        assert mask.dtype == torch.long and torch.equal(mask, expected), (config.pad_token_id, config.eos_token_id)
    only_padding = torch.zeros(2, 3, dtype=torch.int32)  # every token is the pad token: all masked
    assert torch.equal(default_attention_mask(only_padding, GenerationConfig(pad_token_id=0, eos_token_id=2)),
                       torch.zeros(2, 3, dtype=torch.long))
    ones = default_attention_mask(only_padding, GenerationConfig(pad_token_id=None))
    assert ones.dtype == torch.long and torch.equal(ones, torch.ones(2, 3, dtype=torch.long))  # long, whatever the ids


def test_fill_rows_appends_copies_of_the_first_row():
    ids, mask = fill_rows(IDS, MASK, batch=4)
    assert torch.equal(ids, torch.tensor([[5, 6, 7], [8, 9, 1], [5, 6, 7], [5, 6, 7]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]))
    ids, mask = fill_rows(IDS, MASK, batch=2)
    assert torch.equal(ids, IDS) and torch.equal(mask, MASK)


def test_pad_prompt_left_and_right_with_masked_pad_ids():
    ids, mask = pad_prompt(IDS, MASK, 5, pad_id=3, left=True)
    assert torch.equal(ids, torch.tensor([[3, 3, 5, 6, 7], [3, 3, 8, 9, 1]]))
    assert torch.equal(mask, torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]))
    ids, mask = pad_prompt(IDS, MASK, 4, pad_id=3, left=False)
    assert torch.equal(ids, torch.tensor([[5, 6, 7, 3], [8, 9, 1, 3]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]]))
    ids, mask = pad_prompt(IDS, MASK.bool(), 3, pad_id=3, left=True)  # already at the bucket
    assert torch.equal(ids, IDS) and torch.equal(mask, MASK.bool())
    ids, mask = pad_prompt(IDS.int(), MASK.bool(), 4, pad_id=3, left=True)
    assert ids.dtype == torch.int32 and mask.dtype == torch.bool


def test_padding_is_made_on_the_device_of_the_inputs():
    ids, mask = pad_prompt(IDS.to("neuron"), MASK.to("neuron"), 5, pad_id=3, left=True)
    assert ids.device.type == mask.device.type == "neuron"
    assert torch.equal(ids.cpu(), torch.tensor([[3, 3, 5, 6, 7], [3, 3, 8, 9, 1]]))
    assert torch.equal(mask.cpu(), torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]))
    done = PaddingRowsDone(rows=1)(IDS.to("neuron"), None)
    assert done.device.type == "neuron" and done.cpu().tolist() == [False, True]


def test_unpad_moves_the_output_to_the_device_of_the_inputs():
    padded = torch.arange(24).reshape(4, 6)
    result = unpad(padded, rows=2, columns=2, device=torch.device("neuron"))
    assert result.device.type == "neuron" and torch.equal(result.cpu(), padded[:2, 2:])
    steps = (torch.ones(4, 3),)
    output = unpad(GenerateDecoderOnlyOutput(sequences=padded, scores=steps, logits=steps), rows=2, columns=1,
                   device=torch.device("neuron"))
    assert output.sequences.device.type == "neuron" and torch.equal(output.sequences.cpu(), padded[:2, 1:])
    assert [step.device.type for step in output.scores + output.logits] == ["neuron", "neuron"]


@dataclass
class SequencesOnly(ModelOutput):
    sequences: torch.Tensor | None = None


def test_unpad_an_output_with_sequences_only_adds_nothing():
    result = unpad(SequencesOnly(sequences=torch.arange(6).reshape(2, 3)), rows=1, columns=1,
                   device=torch.device("cpu"))
    assert torch.equal(result.sequences, torch.tensor([[1, 2]]))
    assert list(result.keys()) == ["sequences"] and not hasattr(result, "cache") and not hasattr(result, "scores")


def test_unpad_a_tensor_drops_padding_rows_and_left_columns():
    padded = torch.arange(24).reshape(4, 6)
    assert torch.equal(unpad(padded, rows=2, columns=2, device=torch.device("cpu")), padded[:2, 2:])
    assert torch.equal(unpad(padded, rows=4, columns=0, device=torch.device("cpu")), padded)


def test_unpad_an_output_cuts_sequences_scores_and_logits_and_drops_the_cache():
    steps = tuple(torch.full((4, 3), float(step)) for step in range(2))
    output = GenerateDecoderOnlyOutput(sequences=torch.arange(24).reshape(4, 6), scores=steps, logits=steps,
                                       cache="the model's static cache")
    result = unpad(output, rows=3, columns=1, device=torch.device("cpu"))
    assert torch.equal(result.sequences, torch.arange(24).reshape(4, 6)[:3, 1:])
    for name in ("scores", "logits"):
        assert [step.shape for step in getattr(result, name)] == [(3, 3), (3, 3)]
        assert [step[0, 0].item() for step in getattr(result, name)] == [0.0, 1.0]
    assert result.cache is None and result.attentions is None
    result = unpad(GenerateDecoderOnlyOutput(sequences=torch.zeros(2, 3)), rows=1, columns=0,
                   device=torch.device("cpu"))
    assert result.sequences.shape == (1, 3) and result.scores is None and result.logits is None


def test_padding_rows_are_done_from_the_first_token():
    done = PaddingRowsDone(rows=2)(torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, 10))
    assert done.tolist() == [False, False, True, True] and done.dtype == torch.bool  # (what generate() combines)
    assert PaddingRowsDone(rows=3)(torch.zeros(3, 1, dtype=torch.long), None).tolist() == [False, False, False]


class Recorder(BaseStreamer):
    def __init__(self):
        self.values, self.ended = [], 0

    def put(self, value):
        self.values.append(value.tolist())

    def end(self):
        self.ended += 1


def test_the_streamer_sees_the_prompt_without_its_padding_and_every_token_after():
    recorder = Recorder()
    streamer = UnpaddedStreamer(recorder, padding=2)
    streamer.put(torch.tensor([[0, 0, 5, 6]]))
    streamer.put(torch.tensor([7]))
    streamer.put(torch.tensor([8]))
    streamer.end()
    assert recorder.values == [[[5, 6]], [7], [8]] and recorder.ended == 1


def test_a_retried_call_streams_its_prompt_once():
    recorder = Recorder()
    streamer = UnpaddedStreamer(recorder, padding=1)
    kwargs = {"max_new_tokens": 3, "streamer": streamer}
    assert prompt_streamed(kwargs, streamer) is kwargs  # nothing streamed yet: the retry streams the prompt
    assert prompt_streamed(kwargs, None) is kwargs and prompt_streamed(kwargs, recorder) is kwargs
    streamer.put(torch.tensor([[0, 5, 6]]))
    streamer.put(torch.tensor([7]))
    retry = prompt_streamed(kwargs, streamer)
    assert retry["max_new_tokens"] == 3 and kwargs["streamer"] is streamer  # (the caller's dict untouched)
    assert isinstance(retry["streamer"], PromptStreamed) and retry["streamer"].streamer is recorder
    retry["streamer"].put(torch.tensor([[5, 6]]))  # the retried call's prompt: dropped
    retry["streamer"].put(torch.tensor([7]))
    retry["streamer"].put(torch.tensor([8]))
    retry["streamer"].end()
    assert recorder.values == [[[5, 6]], [7], [7], [8]] and recorder.ended == 1
