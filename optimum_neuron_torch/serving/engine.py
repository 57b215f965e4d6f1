"""In-flight batching on compiled graphs of fixed shapes: the scheduler of the server.

One thread runs the device (`run`: the server's main thread). It holds `batch_size` decode slots
over one `SlotCache`. Each turn of its loop:

1. requests waiting get free slots (the lowest first);
2. prompts are prefilled, one piece at a time, oldest request first, up to `prefill_budget` prompt
   tokens in the turn (at least one piece): a prompt that fits a prompt bucket is one piece, padded
   to the bucket; a longer one is cut into chunks of the largest bucket, each attending over the
   smallest context bucket that holds it (see `_next_piece`). A request whose last piece ran has its
   first token. So a long prompt never stalls the decoding requests for more than one chunk a turn;
3. one decode step runs for the first `b` slots (`b` the smallest batch bucket that holds every
   decoding slot), over the smallest context bucket that holds their longest sequence; the other
   slots among them (free, or prefilling) compute a token that is thrown away, written where their
   next piece writes anyway;
4. each request takes its token; one that is done (end-of-sequence token, stop string,
   `max_tokens`, or its client gone) leaves, and its slot is free for the next turn.

So the graphs are one prefill per prompt bucket, a chunk per context bucket a long prompt's chunks
reach, and two decode steps (greedy, and sampling) per (batch bucket, context bucket), all compiled
(or loaded from the compile cache) by `warm_up()` before the first request: no mix of requests
compiles anything. Every row of a step is computed as if alone (its own positions, mask and random
numbers), so a request's tokens do not depend on the others.

Requests come from any thread (the HTTP server's event loop) through `submit()`; what each one
produces goes to the `on_event` callback it carries, called on the engine's thread.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import traceback
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..compiler import regions
from ..errors import DEVICE_OR_JOB_FAILURES, InvalidRequestError, ServerBusyError
from ..generation.buckets import Buckets
from ..generation.compiled_generation import COMPILE_CONFIG
from ..generation.padding import pad_token_id
from ..generation.tensor_parallel import embeddings_without_padding_index, whole_graphs_reason
from .requests import NO_PENALTIES, PENALTIES, Event, Request, SamplingSettings
from .slots import SlotCache, slot_step
from .tensor_parallel import StepBroadcast
from .text import TextStream

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
DEFAULT_QUEUE_SIZE_PER_SLOT = 4  # requests that may wait, per decode slot, before the server answers 429


class ServingEngine:
    """Serves generation requests of one causal language model on its compiled graphs.

    Args:
        model (`PreTrainedModel`): a decoder-only model on the device (from `NeuronAutoModelForCausalLM`).
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (turns the tokens into text).
        batch_size (`int`): decode slots: the most requests generating at once.
        max_length (`int`, *optional*): positions of each slot (prompt plus new tokens); default:
            the model's context length, capped at 2048.
        prompt_buckets (`tuple[int, ...]`, *optional*): prompt lengths of the prefill graphs; a
            prompt is padded to the smallest that holds it, or prefilled in chunks of the largest.
            Default: 16, 64, 256, ... (x4) up to half of `max_length`.
        prefill_budget (`int`, *optional*): the most prompt tokens prefilled in one turn of the loop,
            between two decode steps (a piece larger than it still runs, alone): the most a new
            request delays the others' next token. Default: the largest prompt bucket.
        queue_size (`int`, *optional*): requests that may wait for a slot; beyond it `submit` raises
            `ServerBusyError`. Default: 4 per slot.
        broadcast (`StepBroadcast`, *optional*): for a model split between ranks: rank 0's engine sends
            each device call to the other ranks' engines, which run them (`follow`).

    Example:

    ```python
    >>> engine = ServingEngine(model, tokenizer, batch_size=8)
    >>> engine.start()  # compiles (or loads) every graph, on a thread of its own
    >>> engine.wait_ready()
    >>> engine.submit(Request(tokenizer("Hello").input_ids, 16, SamplingSettings(), [], print))
    ```
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None,
                 prompt_buckets: tuple[int, ...] | None = None, prefill_budget: int | None = None,
                 queue_size: int | None = None, broadcast: StepBroadcast | None = None) -> None:
        default = Buckets.default(model.config, max_length)
        powers_of_two = tuple(2**power for power in range(batch_size.bit_length()) if 2**power < batch_size)
        self.buckets = dataclasses.replace(default, batch_sizes=(*powers_of_two, batch_size),
                                           prompt_buckets=prompt_buckets or default.prompt_buckets)
        self.model, self.tokenizer = model, tokenizer
        self.cache = SlotCache(model, batch_size, self.buckets.max_length)
        self.queue_size = queue_size if queue_size is not None else DEFAULT_QUEUE_SIZE_PER_SLOT * batch_size
        self.prefill_budget = prefill_budget or self.chunk
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_token_id = pad_token_id(model.generation_config, model.get_input_embeddings().num_embeddings)
        self._step = regions.compile_by_layer(slot_step, whole_because=whole_graphs_reason(model),
                                              **COMPILE_CONFIG.to_dict())
        self._broadcast = broadcast
        self._slots: list[Request | None] = [None] * batch_size
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: collections.deque[Request] = collections.deque()  # in slots, oldest first
        self._condition = threading.Condition()
        self._running = False  # `run` is serving (on some thread)
        self._finished = threading.Event()  # `run` returned
        self._stopping = False
        self.ready = threading.Event()  # set once every graph is compiled
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did
        self.steps = 0  # decode steps run (tests count them)

    @property
    def batch_size(self) -> int:
        return len(self._slots)

    @property
    def chunk(self) -> int:
        """The length of each piece of a prompt longer than every prompt bucket (the largest bucket)."""
        return self.buckets.prompt_buckets[-1]

    @property
    def max_prompt_length(self) -> int:
        """The longest prompt: one position is left for the token it answers."""
        return self.buckets.max_length - 1

    @property
    def chunk_contexts(self) -> tuple[int, ...]:
        """The context buckets the chunks after a long prompt's first attend over (a graph each): a
        chunk ends at a multiple of `chunk` after the first, or at `max_length`."""
        if self.max_prompt_length <= self.chunk:
            return ()
        first = self.buckets.context_bucket_for(min(2 * self.chunk, self.buckets.max_length))
        return tuple(context for context in self.buckets.context_buckets if context >= first)

    @property
    def busy_slots(self) -> int:
        return sum(request is not None for request in self._slots)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def device_memory(self) -> int:
        """The device memory allocated now, in bytes (the device module's `memory_allocated()`)."""
        return getattr(torch, self.model.device.type).memory_allocated(self.model.device)

    @property
    def alive(self) -> bool:
        return self._running

    # Requests ----------------------------------------------------------------------------------
    def _check(self, prompt: list[int], max_tokens: int | None, prompt_field: str) -> int:
        """Checks a prompt and its `max_tokens` against the cache; returns `max_tokens` (default: the
        room the cache leaves after the prompt).

        Raises:
            InvalidRequestError: an empty prompt, a prompt above the largest prompt bucket, or
                `max_tokens` beyond what the cache holds after the prompt (names the field).
        """
        if not prompt:
            raise InvalidRequestError("the prompt has no tokens", prompt_field)
        if len(prompt) > self.max_prompt_length:
            raise InvalidRequestError(f"the prompt has {len(prompt)} tokens, above the {self.max_prompt_length} this "
                                      f"server takes (its {self.buckets.max_length} positions, --max-length, less one "
                                      "for the answer); shorten it, or start the server with a larger --max-length",
                                      prompt_field)
        room = self.buckets.max_length - len(prompt)
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > room:
            raise InvalidRequestError(f"max_tokens is {max_tokens}, but the prompt's {len(prompt)} tokens leave "
                                      f"room for {room} in this server's {self.buckets.max_length} positions "
                                      "(--max-length)", "max_tokens")
        return max_tokens

    def submit(self, request: Request, prompt_field: str = "prompt") -> None:
        """Queues `request`; its events start once it has a slot.

        Args:
            request (`Request`): the request.
            prompt_field (`str`): what the errors about its prompt name as the field at fault.

        Raises:
            InvalidRequestError: an empty prompt, a prompt above the largest prompt bucket, or
                `max_tokens` beyond what the cache holds after the prompt (names the field).
            ServerBusyError: the queue is full, or the engine is not serving (starting, stopping,
                or failed).
        """
        request.max_tokens = self._check(request.prompt, request.max_tokens, prompt_field)
        with self._condition:
            if self._stopping or not self.ready.is_set() or not self.alive:
                raise ServerBusyError("the server is not taking requests now (starting, stopping or failed)")
            if len(self._waiting) >= self.queue_size:
                raise ServerBusyError(f"{len(self._waiting)} requests are waiting for one of {self.batch_size} slots, "
                                      "the most this server queues; retry shortly", retry_after=1)
            self._waiting.append(request)
            self._condition.notify()

    def cancel(self, request: Request) -> None:
        """Ends `request` (its client is gone): it leaves its slot before the next decode step, or the
        queue; no more events."""
        with self._condition:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
            self._condition.notify()

    # The engine's thread -----------------------------------------------------------------------
    def start(self, show_progress: bool = True) -> None:
        """Runs the engine (`run`) on a thread of its own."""
        self._running = True
        threading.Thread(target=self.run, args=(show_progress,), name="neuron-serving", daemon=True).start()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until the engine serves.

        Raises:
            RuntimeError: the engine's thread failed (its error is the cause), or `timeout` passed.
        """
        while not self.ready.wait(0.1 if timeout is None else min(timeout, 0.1)):
            if not self.alive:
                raise RuntimeError("the serving engine failed while starting") from self.failure
            if timeout is not None:
                timeout -= 0.1
                if timeout <= 0:
                    raise RuntimeError("the serving engine is not ready yet (compiling its graphs)")

    def stop(self, timeout: float | None = None) -> None:
        """Takes no more requests, lets those queued or running finish, and waits (`timeout` seconds
        at most) for `run` to return."""
        with self._condition:
            self._stopping = True
            self._condition.notify()
        if self._running:
            self._finished.wait(timeout)

    def run(self, show_progress: bool = True) -> None:
        """Runs the engine on this thread until `stop()`: compiles (or loads) every graph (`warm_up`),
        sets `ready`, then serves the requests submitted (see the module's docstring).

        The server runs it on the main thread: on the reference device, the compiled graphs' CPU
        kernels run up to 1.7x slower on another thread (OpenMP's threads of a second team; see
        benchmarks/RESULTS.md, "Serving")."""
        self._running = True
        self._finished.clear()
        try:
            with self._compiling():
                self.warm_up(show_progress)
                self.ready.set()
                while self._turn():
                    pass
        except BaseException as error:
            self.failure = error
            logger.exception("the serving engine failed")
            self._fail_all()
        finally:
            self._running = False
            self._finished.set()
            if self._broadcast is not None:
                self._broadcast.send(None)

    def follow(self) -> None:
        """On a rank other than 0 of a split model: runs the device calls rank 0's engine sends, until
        it stops."""
        with self._compiling():
            while (call := self._broadcast.receive()) is not None:
                try:
                    self._run_step(*call)
                except DEVICE_OR_JOB_FAILURES:
                    raise
                except Exception:  # (rank 0 met it too: the step's requests fail, the engine goes on)
                    logger.exception("a step failed on this rank; the next one runs")

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        """Around the engine's device calls: no autograd (grad mode is per thread), Dynamo may keep a
        graph per bucket, and a split embedding has no padding index (see
        `embeddings_without_padding_index`)."""
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=self.graph_count + 8), \
                embeddings_without_padding_index(self.model):
            yield

    @property
    def graph_count(self) -> int:
        """The graphs the engine runs: a prefill per prompt bucket, a chunk per `chunk_contexts`, two
        decode steps (greedy, sampled) per batch and context bucket."""
        return (len(self.buckets.prompt_buckets) + len(self.chunk_contexts)
                + 2 * len(self.buckets.batch_sizes) * len(self.buckets.context_buckets))

    def warm_up(self, show_progress: bool = True) -> None:
        """Runs every graph once, on a free slot and dummy tokens: each is compiled, or loaded from
        the compile cache, before the first request."""
        runs = [("prefill", length, length) for length in self.buckets.prompt_buckets]
        runs += [("prefill", self.chunk, context) for context in self.chunk_contexts]
        runs += [("decode", batch, context, sampled) for batch in self.buckets.batch_sizes
                 for context in self.buckets.context_buckets for sampled in (False, True)]
        sampling = SamplingSettings(temperature=1.0).row(taken=False)
        for run in tqdm(runs, desc="Compiling neuron graphs for serving", disable=not show_progress):
            if run[0] == "prefill":
                _, length, context = run
                self._forward([[self.pad_token_id] * length], [list(range(context - length, context))], 0, context,
                              [0.5], [sampling], slot=0)
            else:
                _, batch, context, sampled = run
                self._forward([[self.pad_token_id]] * batch, [[context - 1]] * batch, 0, context, [0.5] * batch,
                              [sampling if sampled else SamplingSettings().row(taken=False)] * batch)

    def _turn(self) -> bool:
        """One turn of the loop (see the module's docstring); False when stopped and drained."""
        with self._condition:
            while not self._stopping and not self._waiting and not any(self._slots):
                self._condition.wait()
            if self._stopping and not self._waiting and not any(self._slots):
                return False
            while self._waiting and None in self._slots:
                slot = self._slots.index(None)
                request = self._waiting.popleft()
                request._slot, self._slots[slot] = slot, request
                self._prefilling.append(request)
        self._prefill()
        self._release_finished()
        rows = self._decoding_rows()
        if rows:
            try:
                self._decode(rows)
            except DEVICE_OR_JOB_FAILURES:
                raise
            except Exception as error:  # (the requests of this step fail; the engine takes the next ones)
                self._fail([request for request in rows if request], error, "running a decode step")
            self._release_finished()
        return True

    def _fail(self, requests: list[Request], error: Exception, during: str) -> None:
        """Ends `requests` with an error event naming `error`; they leave their slots."""
        # (the traceback as text: a log record holding the error would hold its frames' device tensors)
        logger.error("%d request(s) failed while %s:\n%s", len(requests), during,
                     "".join(traceback.format_exception(error)).rstrip())
        for request in requests:
            if not request.cancelled:
                self._emit(request, Event("", len(request.tokens), "error",
                                          f"{type(error).__name__} while {during}: {error}"))
            request.cancelled = True

    def _prefill(self) -> None:
        """Runs prefill pieces, oldest request first, while the turn's prompt tokens stay within
        `prefill_budget` (one piece at least). A request that fails here fails alone."""
        spent = 0
        while self._prefilling:
            request = self._prefilling[0]
            if request.cancelled or not request.prefilling:
                self._prefilling.popleft()
                continue
            start, length, context = self._next_piece(request)
            if spent and spent + length > self.prefill_budget:
                return
            spent += length
            try:
                self._run_piece(request, start, length, context)
            except DEVICE_OR_JOB_FAILURES:
                raise
            except Exception as error:  # (this request's own: it fails alone, the others go on)
                self._fail([request], error, "preparing the request")

    def _next_piece(self, request: Request) -> tuple[int, int, int]:
        """The next piece of `request`'s prompt: (first position, length, context). A prompt that fits
        a prompt bucket is one piece, padded to it, attending over the bucket (its prefill graph); a
        longer one is cut in chunks of `chunk` positions, the first over `chunk` (the largest
        prefill's graph), the others over the smallest context bucket that holds them. The last one
        is moved back if it would pass `max_length`: it writes again some positions the one before
        wrote (the same tokens at the same positions), rather than padding beyond the cache."""
        done, length = request._prefilled, len(request.prompt)
        if done == 0 and length <= self.chunk:
            bucket, _ = self.buckets.prompt_shape_for(length)
            return 0, bucket, bucket
        start = min(done, self.buckets.max_length - self.chunk)
        end = start + self.chunk
        return start, self.chunk, self.chunk if end == self.chunk else self.buckets.context_bucket_for(end)

    def _run_piece(self, request: Request, start: int, length: int, context: int) -> None:
        """Writes one piece of `request`'s prompt into its slot; the last piece gives its first token."""
        if request._prefilled == 0:
            request._text = TextStream(self.tokenizer, request.stop)
            seed = request.sampling.seed
            request._generator = torch.Generator().manual_seed(
                seed if seed is not None else int(torch.randint(2**62, ())))
        end = min(start + length, len(request.prompt))
        ids = request.prompt[start:end] + [self.pad_token_id] * (start + length - end)
        final = end == len(request.prompt)  # (only its token is taken: only it draws a random number)
        token = self._forward([ids], [list(range(start, start + length))], end - 1 - start, context,
                              [self._uniform(request) if final else 0.0], [request.sampling.row(taken=final)],
                              slot=request._slot)
        request._prefilled = end
        if final:
            self._take(request, int(token[0]))

    def _decoding_rows(self) -> list[Request | None]:
        """The rows of the next decode step: the first slots, up to the smallest batch bucket that holds
        every decoding request, None where a slot is free or prefilling."""
        decoding = [request if request is not None and not request.prefilling and not request.cancelled else None
                    for request in self._slots]
        last = max((slot for slot, request in enumerate(decoding) if request is not None), default=None)
        return [] if last is None else decoding[:self.buckets.batch_size_for(last + 1)]

    def _decode(self, rows: list[Request | None]) -> None:
        context = self.buckets.context_bucket_for(max(request.position + 1 for request in rows if request))
        # (a row without a decoding request writes where its slot's next prefill piece writes anyway)
        idle = [request._prefilled if request is not None else 0 for request in self._slots[:len(rows)]]
        tokens = self._forward(
            [[request.tokens[-1] if request else self.pad_token_id] for request in rows],
            [[request.position if request else position] for request, position in zip(rows, idle, strict=True)],
            0, context, [self._uniform(request) if request else 0.0 for request in rows],
            [request.sampling.row() if request else SamplingSettings().row(taken=False) for request in rows])
        self.steps += 1
        for request, token in zip(rows, tokens.tolist(), strict=True):
            if request is not None and not request.cancelled:
                self._take(request, token)

    def _forward(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
                 uniform: list[float], sampling: list[list[float]], slot: int | None = None) -> torch.Tensor:
        """One call of the compiled step (a prefill into `slot`, or a decode step); the chosen tokens,
        on the host. A prefill always runs the graph that can sample (one row: it costs little)."""
        if self._broadcast is not None:
            self._broadcast.send((ids, positions, last, context, uniform, sampling, slot))
        return self._run_step(ids, positions, last, context, uniform, sampling, slot)

    def _run_step(self, ids: list[list[int]], positions: list[list[int]], last: int, context: int,
                  uniform: list[float], sampling: list[list[float]], slot: int | None) -> torch.Tensor:
        device = self.model.device
        positions_tensor = torch.tensor(positions, device=device)
        self.cache.writes.positions = positions_tensor
        self.cache.writes.slot = None if slot is None else torch.tensor([slot], device=device)
        self.cache.writes.context = context
        sampled = slot is not None or any(row[0] > 0 or row[PENALTIES] != NO_PENALTIES for row in sampling)
        try:
            return self._step(self.model, self.cache, torch.tensor(ids, device=device), positions_tensor,
                              torch.tensor([last], device=device), torch.tensor(sampling, device=device),
                              torch.tensor(uniform, dtype=torch.float32, device=device), sampled).cpu()
        finally:  # (between steps the device holds the cache only)
            self.cache.writes.positions = self.cache.writes.slot = None

    @staticmethod
    def _uniform(request: Request) -> float:
        """The request's next uniform number (its own generator: the same tokens whatever runs beside it)."""
        if request.sampling.temperature == 0:
            return 0.0
        return float(torch.rand((), generator=request._generator))

    def _take(self, request: Request, token: int) -> None:
        """Gives `request` its next token; sends its event."""
        if request.cancelled:
            return
        request.tokens.append(token)
        text = request._text.add(token)
        finish = None
        if request._text.stopped or token in self.eos_token_ids:
            finish = "stop"
        elif len(request.tokens) >= request.max_tokens:
            finish = "length"
        if finish is not None:
            text += request._text.finish()
        self._emit(request, Event(text, len(request.tokens), finish))
        if finish is not None:
            request.cancelled = True  # (done: it leaves its slot)

    def _emit(self, request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # (a sink that failed: that request ends, the others go on)
            logger.exception("a request's event callback failed; the request ends")
            request.cancelled = True

    def _release_finished(self) -> None:
        with self._condition:
            for slot, request in enumerate(self._slots):
                if request is not None and request.cancelled:
                    self._slots[slot] = None

    def _fail_all(self) -> None:
        """After the engine's thread failed: every request still there ends (with an error event)."""
        with self._condition:
            requests = [request for request in self._slots if request] + list(self._waiting)
            self._slots = [None] * len(self._slots)
            self._waiting.clear()
            self._prefilling.clear()
        for request in requests:
            if not request.cancelled:
                self._emit(request, Event("", len(request.tokens), "error", f"the engine stopped: {self.failure!r}"))
