"""The generation of one model on the device (`model.neuron_generation`): its buckets, and which
path each `generate()` call takes.

- the generation engine (`engine.GenerationEngine`, through `engine_calls`), for every call it
  serves: slots of one KV cache, continuous batching of the calls of every thread, the same
  graphs as `serve`;
- the static graphs (`static_graphs.StaticGraphs`) for the models the engine's slots do not hold
  yet (see `NeuronGeneration.engine_gap`), and a model whose engine failed;
- Transformers' eager `generate()` for what neither serves, with a warning that says why: for a
  model the engine serves, every call it refuses (see `engine_calls.plan`), so that one model
  compiles one graph set, whatever its calls ask.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, StaticCache

from ..compiler import regions
from ..errors import DEVICE_OR_JOB_FAILURES, first_line
from . import engine_calls
from .buckets import Buckets, PlannedGraph, compile_bill, engine_plan
from .engine import GenerationEngine
from .slots import unsupported_by_slots
from .speech_graphs import SpeechGraphs
from .split_model import share_random_state, tensor_parallel_mesh, whole_graphs_reason
from .static_graphs import StaticGraphs
from .static_plans import image_placeholder, speech_window, why_not_compiled
from .vision_graphs import VisionLanguageGraphs

logger = logging.getLogger(__name__)


class NeuronGeneration:
    """The generation state of one model: its buckets, its engine (made at first use) and its
    static graphs, and the tokens its calls chose on the host.

    Args:
        model (`PreTrainedModel`): the model on the device (held weakly: the model holds this object).
        buckets (`Buckets`): the shapes its graphs are compiled for.
    """

    def __init__(self, model: PreTrainedModel, buckets: Buckets) -> None:
        self._model = weakref.ref(model)
        graphs = (SpeechGraphs if speech_window(model) is not None
                  else VisionLanguageGraphs if image_placeholder(model) is not None else StaticGraphs)
        self.static = graphs(model, buckets)
        self._engine: GenerationEngine | None = None
        self._engine_keys: set[str] = set()  # compile-cache entries of the engines' graphs, this one's and before
        # Tokens the engine chose on the host, by logits processor that made it (see `engine_calls`).
        self.host_choices: collections.Counter[str] = collections.Counter()
        self._counting = threading.Lock()  # (calls from several threads count at once)
        # A split model's ranks must run the same steps: its calls run one at a time, each with all its rows.
        self._split_call = threading.RLock()

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    @property
    def buckets(self) -> Buckets:
        return self.static.buckets

    @property
    def cache_keys(self) -> set[str]:
        """The compile-cache entries of the graphs this model's generation ran or compiled."""
        engine = self._engine.cache_keys if self._engine is not None else set()
        return self._engine_keys | engine | self.static.cache_keys

    @functools.cached_property
    def engine_gap(self) -> str | None:
        """Why the generation engine does not run this model's generate() calls, which run on the
        static graphs instead, or None: a model whose cache the engine's slots do not hold (see
        `slots.unsupported_by_slots`)."""
        if self.static.unservable is not None:
            return self.static.unservable[0]
        if self.static.encoder_decoder:
            return "an encoder-decoder model"
        try:
            cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=1)
        except Exception as error:  # (a config the static cache cannot read)
            return f"a config Transformers' static cache cannot read ({first_line(error)})"
        return unsupported_by_slots(self.model, cache)

    @property
    def engine(self) -> GenerationEngine:
        """The model's generation engine, on its buckets (made at first use)."""
        if self._engine is None:
            self._engine = GenerationEngine(self.model, self.buckets)
        return self._engine

    def set_buckets(self, buckets: Buckets) -> None:
        if buckets != self.buckets:
            self._drop_engine()
        self.static.set_buckets(buckets)

    def _drop_engine(self) -> None:
        """Lets the engine go (its slots' device memory), keeping the cache keys of its graphs."""
        if self._engine is not None:
            self._engine_keys |= self._engine.cache_keys
            self._engine = None

    # generate() --------------------------------------------------------------------------------
    def generate(self, transformers_generate: Callable[..., Any], inputs: torch.Tensor | None = None,
                 generation_config: GenerationConfig | None = None, **kwargs: Any) -> Any:
        """Transformers' `generate()` (`transformers_generate`) on the generation engine, else on the
        static graphs, or unchanged (eager) for what those cannot serve. Calls from several threads
        share the engine's steps; on the static graphs, they run one after the other."""
        mesh = tensor_parallel_mesh(self.model)
        with self._split_call if mesh is not None else contextlib.nullcontext():
            if mesh is not None and self.engine_gap is None:  # (every rank draws the rows' seeds, and runs
                share_random_state(mesh)                       # the same steps with them)
            call = self._engine_call(inputs, generation_config, kwargs)
            if not isinstance(call, engine_calls.EngineCall):  # (why the engine refused it, if it did)
                return self.static.generate(transformers_generate, inputs, generation_config, eager_because=call,
                                            **kwargs)
            try:
                return call.run(self.engine, inputs.device if inputs is not None else kwargs["input_ids"].device)
            except DEVICE_OR_JOB_FAILURES:
                raise
            except Exception as error:
                if error in call.failures:
                    raise  # (a stopping criterion's or the streamer's: the caller's)
                # (the static graphs raise the call's own error if it has one: a bad input)
                output = self.static.generate(transformers_generate, inputs, generation_config, **kwargs)
                self._leave_engine(error)
                return output
            finally:
                self._count(call)

    def _engine_call(self, inputs: torch.Tensor | None, generation_config: GenerationConfig | None,
                     kwargs: dict[str, Any]) -> engine_calls.EngineCall | str | None:
        """The call as requests of the engine, why the engine refuses it, or None for a model it does
        not serve."""
        if self.engine_gap is not None:
            return None
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        return engine_calls.plan(self.model, self.buckets, input_ids,
                                 generation_config, {k: v for k, v in kwargs.items() if k != "input_ids"})

    def _count(self, call: engine_calls.EngineCall) -> None:
        """Counts the tokens `call` chose on the host, under each processor that made it."""
        names = {type(p).__name__ for p in call.host_processors[0]} if call.host_processors else set()
        with self._counting:
            self.host_choices.update(dict.fromkeys(names, call.host_tokens))

    def _leave_engine(self, error: Exception) -> None:
        """After the engine failed a call of this model with `error` (not the device's nor the
        caller's failure): its calls run on the static graphs from now on, with a log that says why."""
        self.engine_gap = why_not_compiled(error, self.model)[0]
        self._drop_engine()
        logger.warning("generate() of %s runs on its static graphs without the generation engine, which "
                       "failed: %s", type(self.model).__name__, self.engine_gap)

    # precompile() ------------------------------------------------------------------------------
    def graph_plan(self, buckets: Buckets | None = None, sampling: bool | None = None) -> list[PlannedGraph]:
        """The graphs `precompile(sampling=sampling)` compiles for `buckets` (default: the model's);
        see `buckets.engine_plan` and `buckets.graph_plan`."""
        if self.engine_gap is not None:
            return self.static.graph_plan(buckets, sampling)
        sampling = self.model.generation_config.do_sample if sampling is None else sampling
        buckets = buckets or self.buckets
        images = self.static.images.graph_plan(buckets.batch_sizes) if isinstance(self.static, VisionLanguageGraphs) \
            else []  # (the engine's image encoder, see `images`)
        return [*engine_plan(buckets, sampling=sampling), *images]

    def compile_bill(self, buckets: Buckets | None = None, sampling: bool | None = None) -> list[str]:
        """`graph_plan`, in lines for a person (see `buckets.compile_bill`)."""
        layers = getattr(self.model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        decoder = self.model.get_decoder() if self.static.encoder_decoder else self.model
        kinds = len({type(layer) for layer in regions.repeated_layers(decoder)})
        return compile_bill(buckets or self.buckets, self.graph_plan(buckets, sampling), layers, max(kinds, 1),
                            layer_reuse=kinds > 0
                            and regions.reuse_off_reason(whole_graphs_reason(self.model)) is None,
                            engine=self.engine_gap is None)

    def precompile(self, show_progress: bool = True, sampling: bool | None = None) -> None:
        """Compiles (or loads from the compile cache) every graph of `graph_plan(sampling=sampling)`:
        the engine's warm-up (see `GenerationEngine.warm_up`), or the static graphs' runs (see
        `StaticGraphs.precompile`)."""
        if self.engine_gap is not None:
            self.static.precompile(show_progress, sampling)
            return
        sampling = self.model.generation_config.do_sample if sampling is None else sampling
        self.engine.warm_up(show_progress, sampling=sampling)
