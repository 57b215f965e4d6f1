"""Sentence embeddings on compiled graphs of fixed shapes: the engine behind a server's `/v1/embeddings`.

An encoder (a `NeuronAutoModel`, e.g. a sentence-transformers folder) embeds each input as
`modeling.embeddings.embed` does (its last hidden states pooled over the input's tokens, then
normalized, as the folder declares), in one compiled graph per (batch bucket, length bucket): an
input is right-padded (masked) to the smallest length bucket that holds it, and inputs of the same
length bucket are embedded together, up to the largest batch bucket, whichever requests they came
from; a batch is padded to the smallest batch bucket with rows of one token, thrown away. Every row
is computed as if alone (its own mask), so an input's embedding does not depend on the others.

One thread runs the device (`run`: the server's main thread, as the generation engine's); requests
come from any thread (`submit`, a future). The engine compiles (or loads) every graph before it
serves (`ready`), so no mix of inputs compiles anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from itertools import product
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..compiler import regions
from ..errors import DEVICE_OR_JOB_FAILURES, InvalidRequestError
from ..generation.compiling import COMPILE_CONFIG, QUIET_WHILE_TRACED
from ..modeling.embeddings import pool, sentence_transformers_pooling
from .queued_engine import Job, QueuedEngine

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (16, 64, 128, 256, 512)  # (the length buckets, up to the engine's max_length)


def embedding_step(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, pooling: str,
                   normalize: bool) -> torch.Tensor:
    """What gets compiled: the embeddings of a batch, `[rows, hidden]`, from its int64 `[rows, length]`
    inputs and their masks (1: a token, 0: padding)."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    vectors = pool(hidden, attention_mask, pooling)
    return torch.nn.functional.normalize(vectors, dim=-1) if normalize else vectors


class EmbeddingEngine(QueuedEngine):
    """Embeds token sequences with an encoder on its compiled graphs (see the module's docstring).

    Args:
        model (`PreTrainedModel`): the encoder on the device (from `NeuronAutoModel`).
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer.
        batch_size (`int`): the most inputs embedded at once; the batch buckets are the powers of two
            below it, and it.
        max_length (`int`, *optional*): the most tokens of an input (longer ones are refused); the
            length buckets are those of `DEFAULT_LENGTHS` below it, and it. Default: the model's
            positions, at most 512.

    Example:

    ```python
    >>> engine = EmbeddingEngine(NeuronAutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
    >>> engine.start()
    >>> engine.wait_ready()
    >>> vectors = engine.submit([tokenizer("A cat.").input_ids]).result()
    ```
    """

    name = "embedding"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 8,
                 max_length: int | None = None) -> None:
        super().__init__(model)
        positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_LENGTHS[-1]
        max_length = min(max_length or DEFAULT_LENGTHS[-1], positions)
        self.tokenizer = tokenizer
        self.batch_sizes = (*(2**power for power in range(batch_size.bit_length()) if 2**power < batch_size),
                            batch_size)
        self.lengths = (*(length for length in DEFAULT_LENGTHS if length < max_length), max_length)
        folder = Path(model.name_or_path)
        self.pooling, self.normalize = sentence_transformers_pooling(folder) if folder.is_dir() else ("mean", False)
        self.pad_token_id = tokenizer.pad_token_id or 0
        self.step = regions.compile_by_layer(embedding_step, **COMPILE_CONFIG.to_dict())

    @property
    def batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def dimensions(self) -> int:
        """The size of an embedding (the model's hidden size)."""
        return self.model.config.hidden_size

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    def submit(self, inputs: list[list[int]], field: str = "input") -> concurrent.futures.Future:
        """Queues token sequences to embed: a future of their embeddings, float32 `[len(inputs), hidden]`
        on the host.

        Raises:
            InvalidRequestError: an empty input, or one longer than the largest length bucket
                (names `field`, and the input's index in a batch).
            ServerBusyError: the engine is not serving (starting, stopping or failed).
        """
        for index, tokens in enumerate(inputs):
            if not 0 < len(tokens) <= self.max_length:
                where = field if len(inputs) == 1 else f"{field}.{index}"
                raise InvalidRequestError(f"{where}: {len(tokens)} tokens; this server embeds 1 to {self.max_length} "
                                          "tokens per input (--max-length)", where)
        return self.enqueue(inputs)

    def device_context(self) -> contextlib.AbstractContextManager:
        """No gradients; dynamo may keep a graph per (batch bucket, length bucket)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch._dynamo.config.patch(recompile_limit=len(self.batch_sizes) * len(self.lengths) + 8,
                                                       ignore_logging_functions=QUIET_WHILE_TRACED))
        return stack

    def warm_up(self, show_progress: bool) -> None:
        """Compiles (or loads) the graph of every (batch bucket, length bucket)."""
        for rows, length in tqdm(list(product(self.batch_sizes, self.lengths)), disable=not show_progress,
                                 desc="Compiling neuron graphs"):
            self._embed([[self.pad_token_id]] * rows, length)

    def serve(self, jobs: list[Job]) -> None:
        """Embeds the inputs of `jobs`, grouped by length bucket, in batches of the largest batch
        bucket; each job's future gets its rows (or the error of a batch it had rows in)."""
        rows = [(job, index, tokens) for job, (inputs, _) in enumerate(jobs) for index, tokens in enumerate(inputs)]
        rows.sort(key=lambda row: len(row[2]))
        results = [[None] * len(inputs) for inputs, _ in jobs]
        failed: dict[int, BaseException] = {}
        self.busy_slots = len(rows)
        try:
            while rows:
                length = next(bucket for bucket in self.lengths if bucket >= len(rows[0][2]))
                batch = [row for row in rows[:self.batch_size] if len(row[2]) <= length]
                rows = rows[len(batch):]
                try:
                    vectors = self._embed([tokens for _, _, tokens in batch], length)
                except DEVICE_OR_JOB_FAILURES:
                    raise
                except Exception as error:  # (these jobs fail; the others go on)
                    logger.exception("an embedding batch failed")
                    failed.update((job, error) for job, _, _ in batch)
                    continue
                for (job, index, _), vector in zip(batch, vectors, strict=False):
                    results[job][index] = vector
        except BaseException as error:  # (the device failed: every job of the turn fails with it)
            for _, future in jobs:
                future.set_exception(self.stopped(error))
            raise
        finally:
            self.busy_slots = 0
        for job, (_, future) in enumerate(jobs):
            if job in failed:
                future.set_exception(failed[job])
            else:
                future.set_result(torch.stack(results[job]))

    def _embed(self, inputs: list[list[int]], length: int) -> torch.Tensor:
        """The embeddings of `inputs` (each at most `length` tokens), on the host: one call of the
        graph of (the smallest batch bucket that holds them, `length`)."""
        rows = next(size for size in self.batch_sizes if size >= len(inputs))
        padded = [tokens + [self.pad_token_id] * (length - len(tokens)) for tokens in inputs]
        masks = [[1] * len(tokens) + [0] * (length - len(tokens)) for tokens in inputs]
        filler = [[self.pad_token_id] * length], [[1] + [0] * (length - 1)]  # (rows thrown away: one token each)
        device = self.model.device
        vectors = self.step(self.model, torch.tensor(padded + filler[0] * (rows - len(inputs)), device=device),
                            torch.tensor(masks + filler[1] * (rows - len(inputs)), device=device), self.pooling,
                            self.normalize)
        return vectors[:len(inputs)].float().cpu()
