"""In-flight batching on compiled graphs of fixed shapes: the engine behind `generate()` and the server.

One thread at a time runs the device: the server's main thread (`run`), or a thread whose
`generate()` waits for its requests (`complete`). The engine holds a decode slot per row of its
largest batch bucket, over one `SlotCache`. Each turn of its loop:

1. requests waiting get free slots (the lowest first; with prefix caching, the one holding the most
   of the prompt's first tokens, else the least recently used: see `prefix_cache`);
2. prompts are prefilled, one piece at a time, oldest request first, up to `prefill_budget` prompt
   tokens in the turn (at least one piece): a prompt that fits a prompt bucket is one piece, padded
   to the bucket; a longer one is cut into chunks of the largest bucket, each attending over the
   smallest context bucket that holds it (`buckets.next_piece`). A request whose last piece ran has
   its first token. So a long prompt never stalls the decoding requests for more than one chunk a turn;
3. one decode step runs for the first `b` slots (`b` the smallest batch bucket that holds every
   decoding slot; the rows of a `generate()` call start together, see `Request.held`), over the
   smallest context bucket that holds their longest sequence; the others among them compute a token
   thrown away, written where their next piece writes (prefilling, held) or at the step's last position
   (with `speculation`, a request decoding alone may verify drafted tokens instead, see `speculation`);
4. each request takes its token; one that is done (end-of-sequence token, stop string,
   `max_tokens`, or its client gone) leaves, and its slot is free for the next turn.

So the graphs are those of `buckets.engine_plan` (a prefill per prompt bucket, chunks of long prompts,
greedy and sampling decode steps per batch and context bucket; a vision-language model's prefills
read the prompt's embeddings, its images' features in place, and it adds an image encoder per batch
bucket, see `images`). The server compiles all of them before its first request (`warm_up()`), so
no mix of requests compiles anything; those a previous run left whole in the compile cache it loads
when idle, or at the first step that needs one;
`generate()` compiles each the first time it meets it, unless `precompile()` did. Every row of a
step is computed as if alone (its positions, mask and random numbers): a request's tokens do not
depend on the others.

Requests come from any thread: the HTTP server's event loop through `submit()`, `generate()` calls
through `complete()`, which share the steps. What each one produces goes to the `on_event` callback
it carries, called on the thread running the device.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import traceback
import weakref
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..errors import DEVICE_OR_JOB_FAILURES, ConfigurationError, ServerBusyError
from .buckets import Buckets, engine_plan, next_piece
from .padding import pad_token_id
from .prefix_cache import PrefixCache
from .requests import Event, Request, SamplingSettings
from .slots import SlotCache, SlotSteps, dummy_step
from .speculation import Speculation
from .split_model import StepBroadcast
from .static_plans import image_placeholder

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE_PER_SLOT = 4  # requests that may wait, per decode slot, before the server answers 429


class GenerationEngine:
    """Runs generation requests of one causal language model on its compiled graphs.

    Args:
        model (`PreTrainedModel`): a decoder-only model on the device (from `NeuronAutoModelForCausalLM`).
        buckets (`Buckets`): the shapes of the graphs: a decode slot per row of the largest batch
            bucket, each of `max_length` positions (prompt plus new tokens); a prompt is padded to the
            smallest prompt bucket that holds it, or prefilled in chunks of the largest; a decode step
            attends over the smallest context bucket that holds its longest row. A server's:
            `Buckets.for_slots`.
        tokenizer (`PreTrainedTokenizerBase`, *optional*): turns the tokens into the text of the
            events and finds stop strings; without it, events carry no text.
        prefill_budget (`int`, *optional*): the most prompt tokens prefilled in one turn of the loop,
            between two decode steps (a piece larger than it still runs, alone): the most a new
            request delays the others' next token. Default: the largest prompt bucket.
        queue_size (`int`, *optional*): requests that may wait for a slot; beyond it `submit` raises
            `ServerBusyError`. Default: 4 per slot.
        broadcast (`StepBroadcast`, *optional*): for a model split between ranks: rank 0's engine sends
            each device call to the other ranks' engines, which run them (`follow`).
        scoring (`bool`): whether requests may score their prompt (`Request.prompt_logprobs`): the
            engine also compiles a scoring prefill of each prefill's shape (see `buckets.engine_plan`).
        prefix_caching (`bool`): whether a request reuses the keys and values of its prompt's first
            tokens that a slot holds (see `prefix_cache`): the engine also compiles the pieces that
            follow a prefix (`suffix` graphs, see `buckets.engine_plan`).
        speculation (`Speculation`, *optional*): speculative decoding of a request decoding alone (see
            `speculation`): the engine also compiles its `verify` graphs (and a draft model's).

    Example:

    ```python
    >>> engine = GenerationEngine(model, Buckets.for_slots(model.config, 8), tokenizer)
    >>> engine.start()  # compiles (or loads) every graph, on a thread of its own
    >>> engine.wait_ready()
    >>> engine.submit(Request(tokenizer("Hello").input_ids, 16, SamplingSettings(), [], print))
    ```
    """

    def __init__(self, model: PreTrainedModel, buckets: Buckets, tokenizer: PreTrainedTokenizerBase | None = None,
                 *, prefill_budget: int | None = None, queue_size: int | None = None,
                 broadcast: StepBroadcast | None = None, scoring: bool = False, prefix_caching: bool = False,
                 speculation: Speculation | None = None) -> None:
        self.image_token = image_placeholder(model)  # (a vision-language model's, see `images`)
        if (prefix_caching or speculation) and (broadcast is not None or self.image_token is not None):
            raise ConfigurationError("prefix caching and speculative decoding are not available for a model split "
                                     "between ranks or a vision-language model yet")
        self.buckets, self.scoring = buckets, scoring
        self._model, self.tokenizer = weakref.ref(model), tokenizer  # (a weak reference: the model holds its engine)
        slots = buckets.batch_sizes[-1]
        self.device = SlotSteps(model, buckets, broadcast)  # (the slots' cache and the compiled step)
        self.queue_size = queue_size if queue_size is not None else DEFAULT_QUEUE_SIZE_PER_SLOT * slots
        self.prefill_budget = prefill_budget or buckets.prompt_buckets[-1]  # (a chunk of a long prompt)
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_token_id = pad_token_id(model.generation_config, model.get_input_embeddings().num_embeddings)
        self._slots: list[Request | None] = [None] * slots
        self.prefixes = PrefixCache(slots) if prefix_caching else None  # (what the free slots hold for new prompts)
        self.speculation = speculation
        if speculation is not None:  # (Dynamo's recompile limit counts its graphs too)
            self.device.graphs += speculation.bind(model, buckets, self.pad_token_id)
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: collections.deque[Request] = collections.deque()  # in slots, oldest first
        self._condition, self._running = threading.Condition(), False  # (`_running`: `run` serves, on some thread)
        self._driver: threading.Thread | None = None  # the thread of a `complete()` running the turns
        self._finished, self._stopping = threading.Event(), False  # (`run` returned; `stop()` was called)
        self.ready = threading.Event()  # set once every graph is compiled
        self._unloaded: collections.deque[tuple] = collections.deque()  # steps of graphs compiled, not yet loaded
        self.failure: BaseException | None = None  # what stopped the engine's thread, if anything did
        self.steps = 0  # decode steps run (tests count them)

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    @property
    def cache(self) -> SlotCache:
        return self.device.cache

    @property
    def cache_keys(self) -> set[str]:
        """The compile-cache entries of the graphs run (saved with the model)."""
        return self.device.cache_keys

    @property
    def batch_size(self) -> int:
        return len(self._slots)

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
    def graphs_unloaded(self) -> int:  # (compiled, in the compile cache, but not loaded yet: see `warm_up`)
        return len(self._unloaded)

    @property
    def alive(self) -> bool:
        return self._running

    # Requests ----------------------------------------------------------------------------------
    def submit(self, request: Request, prompt_field: str = "prompt") -> None:
        """Queues `request`; its events start once it has a slot.

        Args:
            request (`Request`): the request.
            prompt_field (`str`): what the errors about its prompt name as the field at fault.

        Raises:
            InvalidRequestError: what `Request.check` refuses (names the field).
            ServerBusyError: the queue is full, or the engine is not serving (starting, stopping, or failed).
        """
        request.check(self.buckets.max_length, prompt_field, self.scoring, self.device.images)
        with self._condition:
            if not (self._stopping or self.ready.is_set() or self.failure):  # (GET /health says when it is ready)
                raise ServerBusyError("the server is starting", starting=True)
            if self._stopping or not self.ready.is_set() or not self.alive:
                raise ServerBusyError("the server is not taking requests now (stopping or failed)")
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

    def complete(self, requests: list[Request]) -> None:
        """Runs `requests` to their end, from the calling thread (`generate()`): their events come
        before it returns. Threads may call it at once: their requests share the decode steps, run by
        one of them at a time (the others wait for theirs), or by the server's thread if it runs.

        Args:
            requests (`list[Request]`): the requests; they may outnumber the slots (they wait).

        Raises:
            InvalidRequestError: as `submit` (no request runs).
            Exception: what a device call raised, the device's or the job's failure (the requests
                running then end with an error event); other failures end their requests only.
        """
        for request in requests:
            request.check(self.buckets.max_length, "input_ids", self.scoring, self.device.images)
            request._call = requests
        with self._condition:
            self._waiting.extend(requests)
            self._condition.notify_all()
        try:
            while not self._drive_until(requests):
                pass
        except BaseException:  # (interrupted, or the device failed: nothing of this call stays)
            for request in requests:
                self.cancel(request)
            raise

    def _drive_until(self, requests: list[Request]) -> bool:
        """Runs turns until `requests` are done, if no other thread runs them; else waits for a
        change (a turn ended, a driver left). Whether they are done."""
        with self._condition:
            if all(request.cancelled for request in requests):
                return True
            if self._running or self._driver is not None:
                self._condition.wait(1.0)
                return False
        try:
            with self._driving():
                while not all(request.cancelled for request in requests):
                    self._turn(wait=False)
        except DEVICE_OR_JOB_FAILURES as error:
            self._fail_all(error)
            raise
        return True

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """Makes the calling thread the one running the device, once no other thread does."""
        with self._condition:
            while self._driver is not None:
                self._condition.wait()
            self._driver = threading.current_thread()
        try:
            with self.device.compiling():
                yield
        finally:
            with self._condition:
                self._driver = None
                self._condition.notify_all()

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
            timeout = None if timeout is None else timeout - 0.1
            if timeout is not None and timeout <= 0:
                raise RuntimeError("the serving engine is not ready yet (compiling its graphs)")

    def stop(self, timeout: float | None = None) -> None:
        """Takes no more requests, lets those queued or running finish, waits (`timeout` s at most) for `run`."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
        if self._running:
            self._finished.wait(timeout)

    def run(self, show_progress: bool = True) -> None:
        """Runs the engine on this thread until `stop()`: compiles (or loads) every graph (`warm_up`),
        sets `ready`, then serves the requests submitted (see the module's docstring).

        The server runs it on the main thread: on the reference device, compiled CPU kernels run up to 1.7x
        slower on another thread (OpenMP's threads of a second team; benchmarks/RESULTS.md, "Serving")."""
        self._running = True
        self._finished.clear()
        try:
            with self.device.compiling():
                self.warm_up(show_progress, load=False)
                self.ready.set()
                while self._turn():
                    pass
        except BaseException as error:
            self.failure = error
            logger.exception("the serving engine failed")
            self._fail_all(error)
        finally:
            self._running = False
            self._finished.set()
            if self.device.broadcast is not None:
                self.device.broadcast.send(None)

    def warm_up(self, show_progress: bool = True, sampling: bool = True, load: bool = True) -> None:
        """Runs every graph of `buckets.engine_plan` (`sampling`; the engine's scoring, prefix caching,
        speculation, and a draft model's) once (a progress bar if `show_progress`), on pad tokens: each
        is compiled, or loaded, before the first request. With `load=False` (the server), a graph the compile
        cache holds whole (its traced function and every program it runs, `PrecompiledFunction.saved`)
        is left for an idle turn of the engine, or the first step that needs it: nothing is left to
        compile, and a warm start does not wait for every graph to load."""
        self._unloaded.clear()
        with contextlib.nullcontext() if self._running else self._driving():  # (the server's thread drives)
            plan = engine_plan(self.buckets, sampling=sampling, scoring=self.scoring,
                               prefix_caching=self.prefixes is not None,
                               speculative_tokens=self.speculation.tokens if self.speculation else 0)
            for graph in tqdm(plan, desc="Compiling neuron graphs", disable=not show_progress):
                step = dummy_step(graph, self.pad_token_id)
                keys = None if load else self.device.saved(*step)
                if keys is None:
                    self.device.forward(*step)
                else:
                    self.device.cache_keys |= keys
                    self._unloaded.append(step)
            if self.speculation is not None:
                self.speculation.drafter.warm_up()
            if self.device.images is not None:
                self.device.images.precompile(self.buckets.batch_sizes, show_progress)

    def _turn(self, wait: bool = True) -> bool:
        """One turn of the loop (see the module's docstring), after waiting for work if `wait`; False
        when stopped and drained."""
        with self._condition:
            while wait and not self._stopping and not self._waiting and not any(self._slots) and not self._unloaded:
                self._condition.wait()
            if self._stopping and not self._waiting and not any(self._slots):
                return False
            placed = []
            while self._waiting and None in self._slots:
                request, free = self._waiting.popleft(), [slot for slot, busy in enumerate(self._slots) if not busy]
                slot = free[0]
                if self.prefixes is not None:  # (its prompt's first positions may be in a slot already)
                    slot, donor, request._prefilled = self.prefixes.place(request.prompt, free,
                                                                          request.prompt_logprobs is None)
                    placed.append((slot, donor, request))
                request._slot, self._slots[slot] = slot, request
                self._prefilling.append(request)
            idle = not any(self._slots)
        for slot, donor, request in placed:  # (before any step writes into the slots it copies)
            self.device.reuse(slot, donor, request.prompt[:request._prefilled])
        if idle and self._unloaded:  # (every slot free: a graph `warm_up` left in the compile cache loads now)
            ids, positions, *_, slot, _, _ = step = self._unloaded[0]
            self.device.forward(*step)
            self._unloaded.popleft()  # (once loaded: `graphs_unloaded` counts it until then)
            if self.prefixes is not None:  # (it wrote pad tokens in the first slots, or slot 0, from this position)
                self.prefixes.overwritten(range(len(ids)) if slot is None else [slot], positions[0][0])
            return True
        self._prefill()
        self._release_finished()
        rows = self._decoding_rows()
        if rows:
            try:
                if self.speculation is None or not self.speculation.step(self, rows):
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
                request.error = error.with_traceback(None)  # (its frames hold device tensors)
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
            start, length, context = next_piece(self.buckets, request._prefilled, len(request.prompt),
                                                self.prefixes is not None and request.prompt_logprobs is None)
            if spent and spent + length > self.prefill_budget:
                return
            spent += length
            try:
                self._run_piece(request, start, length, context)
            except DEVICE_OR_JOB_FAILURES:
                raise
            except Exception as error:  # (this request's own: it fails alone, the others go on)
                self._fail([request], error, "preparing the request")

    def _run_piece(self, request: Request, start: int, length: int, context: int) -> None:
        """Writes one piece of `request`'s prompt into its slot; the last piece gives its first token."""
        if request._generator is None:  # (its first piece)
            request.begin(self.tokenizer, self.device.images, self.buckets.batch_sizes)
        end = min(start + length, len(request.prompt))
        ids = request.prompt[start:end] + [self.pad_token_id] * (start + length - end)
        final = end == len(request.prompt)  # (only its token is taken: only it draws a random number)
        tokens, logits, scores = self.device.forward(
            [ids], [list(range(start, start + length))], end - 1 - start, context,
            [request.next_uniform() if final else 0.0], [request.row(taken=final and request.choose is None)],
            request._slot, request.targets(start, length, self.pad_token_id), False,
            request.image_features(start, end, self.image_token))
        if scores:
            request.score(start, scores)
        request._prefilled = end
        if self.prefixes is not None:
            self.prefixes.written(request._slot, request.prompt[:end])
        if final:
            self._take(request, request.chosen(int(tokens[0]), logits[0]))

    def _decoding_rows(self) -> list[Request | None]:
        """The rows of the next decode step: the first slots, up to the smallest batch bucket holding
        every decoding request (None: a slot free, prefilling, or `held`)."""
        decoding = [request if request is not None and not (request.prefilling or request.cancelled or request.held)
                    else None for request in self._slots]
        last = max((slot for slot, request in enumerate(decoding) if request is not None), default=None)
        return [] if last is None else decoding[:self.buckets.batch_size_for(last + 1)]

    def _decode(self, rows: list[Request | None]) -> None:
        context = self.buckets.context_bucket_for(max(request.position + 1 for request in rows if request))
        # (a row without a decoding request writes where its slot's next prefill piece writes anyway, or, free, at
        # the step's last position, which every mask lets it attend; the prefix cache forgets the slot's from there)
        idle = [request._prefilled if request is not None else context - 1 for request in self._slots[:len(rows)]]
        if self.prefixes is not None:
            self.prefixes.overwritten([slot for slot, request in enumerate(self._slots[:len(rows)]) if not request],
                                      context - 1)
        tokens, logits, _ = self.device.forward(
            [[request.tokens[-1] if request else self.pad_token_id] for request in rows],
            [[request.position if request else position] for request, position in zip(rows, idle, strict=True)],
            0, context, [request.next_uniform() if request else 0.0 for request in rows],
            [request.row(taken=request.choose is None) if request else SamplingSettings().row(taken=False)
             for request in rows])
        self.steps += 1
        for row, (request, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            if request is None or request.cancelled:
                continue
            try:
                self._take(request, request.chosen(token, logits[row]))
            except Exception as error:  # (its own processors': it fails alone, the others take their tokens)
                self._fail([request], error, "taking its token")

    def _take(self, request: Request, token: int) -> None:
        """Gives `request` its next token and sends its event; done, it leaves its slot."""
        if not request.cancelled:
            event = request.take(token, self.eos_token_ids)
            self._emit(request, event)
            request.cancelled |= event.finish_reason is not None

    def _emit(self, request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # (a sink that failed: that request ends, the others go on)
            logger.exception("a request's event callback failed; the request ends")
            request.cancelled = True

    def _release_finished(self) -> None:
        with self._condition:
            self._slots = [None if request is not None and request.cancelled else request for request in self._slots]
            self._condition.notify_all()  # (`complete()` callers wait for their requests)

    def _fail_all(self, error: BaseException) -> None:
        """After a device call failed with `error`: every request still there ends (with an error event)."""
        with self._condition:
            requests = [request for request in self._slots if request] + list(self._waiting)
            self._slots = [None] * len(self._slots)
            self._waiting.clear()
            self._prefilling.clear()
        for request in requests:
            if not request.cancelled:
                request.error = error
                self._emit(request, Event("", len(request.tokens), "error", f"the engine stopped: {error!r}"))
            request.cancelled = True
