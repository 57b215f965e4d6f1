"""LoRA adapters served side by side: each row of a step runs the base model plus its own adapter, or none.

Every linear layer an adapter may target (every `nn.Linear` of the model but its output head) gets,
while an `AdapterSlots` is attached, the `A` matrices of `max_loras` adapters stacked
(`lora_a`, `[max_loras * max_rank, in]`) and their `B` matrices times the adapter's scale side by side
(`lora_b`, `[out, max_loras * max_rank]`), zeros where no adapter is loaded, each adapter's padded
with zeros to `max_rank`; and a forward hook that adds, for a step's rows `x` (`[rows, tokens, in]`),

    ((x @ lora_a.T) * mask) @ lora_b.T

where `mask` keeps, in each row, the columns of that row's adapter (`AdapterRows.mask`, set by
the engine's step from each request's `adapter`: 0 is none, and keeps no column, so a row without
an adapter gets the base model's output exactly). So rows of different adapters share every step,
and the adapters' weights are inputs of the graphs, of fixed shapes: loading an adapter copies its
weights into a free slot, unloading one frees its slot, and nothing compiles. A step reads every slot's
weights once, whatever its rows (SmolLM2-135M, 4 slots of rank 16: 19.5M parameters, 14% of the model's),
and runs two more products per layer (`benchmarks/lora.py`: 0.54-0.63x the decode speed without, on the
reference device).

Adapters are read as PEFT saves them (`adapter_config.json`, `adapter_model.safetensors`): LoRA, without
DoRA, biases, modules to save, or per-module ranks; the scale is `lora_alpha / r` (`/ sqrt(r)` with
`use_rslora`), as PEFT applies it.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import ConfigurationError, InvalidRequestError, ModelNotFoundError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # (what PEFT's saved tensor names start with, before the model's module path)
UNSUPPORTED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
               "fan_in_fan_out": False}  # (a field given otherwise is refused)


class AdapterRows:
    """Which slots' columns each row of the step about to run keeps (`mask`, `[rows, max_loras * max_rank]`
    in the model's dtype: ones in its adapter's columns, none for a row without), set on the host before
    each call (`set`), as `slots.SlotWrites` is (the hooks of every layer share it)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.slot_of_column = torch.arange(max_loras * max_rank) // max_rank + 1
        self.mask: torch.Tensor | None = None

    def set(self, adapters: list[int] | None, dtype: torch.dtype, device: torch.device) -> None:
        """Sets the mask of rows of these adapters' slots (0: none), or none (None: between steps)."""
        self.mask = None if adapters is None else (
            self.slot_of_column[None, :] == torch.tensor(adapters)[:, None]).to(device=device, dtype=dtype)


class AdapterSlots:
    """The LoRA adapters an engine serves: `max_loras` slots of rank up to `max_rank` in every linear layer
    of its model but the output head (see the module's docstring), attached while it lives (`detach()`
    takes them off).

    Args:
        engine (`GenerationEngine`): the engine (not split between ranks, without prefix caching).
        max_loras (`int`): the adapters loaded at once.
        max_rank (`int`): the largest rank an adapter may have.

    Raises:
        ConfigurationError: an engine split between ranks, or with prefix caching (a prompt's cached keys
            and values would be the base model's), or sizes below 1.

    Example:

    ```python
    >>> adapters = AdapterSlots(engine, max_loras=4, max_rank=16)
    >>> adapters.load("sql", "path/to/peft-adapter")  # doctest: +SKIP
    >>> request = Request(prompt, 32, SamplingSettings(), [], print)
    >>> adapters.use("sql", request)  # doctest: +SKIP
    >>> engine.submit(request)
    ```
    """

    def __init__(self, engine: Any, max_loras: int, max_rank: int) -> None:
        if engine.device.broadcast is not None or engine.prefixes is not None:
            raise ConfigurationError("LoRA adapters are not served yet with a model split between ranks, nor with "
                                     "prefix caching: leave out --tensor-parallel-size / --enable-prefix-caching")
        if max_loras < 1 or max_rank < 1:
            raise ConfigurationError(f"max_loras and max_rank must be at least 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.names: dict[str, int] = {}  # adapter name -> slot (1 to max_loras)
        self.paths: dict[str, str] = {}
        self._users = {slot: weakref.WeakSet() for slot in range(1, max_loras + 1)}  # (requests on each slot)
        self._lock = threading.Lock()
        self._device = engine.device
        self.rows = AdapterRows(max_loras, max_rank)
        model = engine.model
        head = model.get_output_embeddings()
        self.modules = {name: module for name, module in model.named_modules()
                        if isinstance(module, torch.nn.Linear) and module is not head}
        width = max_loras * max_rank
        self._hooks = []
        for module in self.modules.values():
            module.register_buffer("lora_a", module.weight.new_zeros(width, module.in_features), persistent=False)
            module.register_buffer("lora_b", module.weight.new_zeros(module.out_features, width), persistent=False)
            module.lora_rows = self.rows
            self._hooks.append(module.register_forward_hook(_add_adapters))
        engine.device.adapters = self

    def detach(self) -> None:
        """Takes the adapters off the model: its layers as they were."""
        for hook in self._hooks:
            hook.remove()
        for module in self.modules.values():
            del module.lora_a, module.lora_b, module.lora_rows
        self._device.adapters = None

    def use(self, name: str, request: Any) -> int:
        """Gives `request` the adapter `name` (its `adapter`, the slot): the slot is not reused while it
        runs, even if the adapter is unloaded meanwhile.

        Raises:
            ModelNotFoundError: no adapter of that name is loaded.
        """
        with self._lock:
            if name not in self.names:
                raise ModelNotFoundError(f"no LoRA adapter {name!r} is loaded here (GET /v1/models lists them)")
            request.adapter = self.names[name]
            self._users[request.adapter].add(request)
            return request.adapter

    def load(self, name: str, path: str | Path) -> int:
        """Loads the PEFT LoRA adapter saved in the folder `path` as `name`, into a free slot: its slot.
        Nothing is written unless the whole adapter is valid.

        Raises:
            InvalidRequestError: a name already loaded (`lora_name`), no free slot, a folder without the
                files, an adapter config this server cannot apply (names the field), or a tensor of a
                module it does not serve or of the wrong shape (names the tensor) (`lora_path`).
        """
        with self._lock:
            if name in self.names:
                raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already; unload it first",
                                          "lora_name")
            free = [slot for slot, users in self._users.items()
                    if slot not in self.names.values() and all(request.cancelled for request in users)]
            if not free:
                raise InvalidRequestError(f"every one of the {self.max_loras} adapter slots is in use (--max-loras): "
                                          "unload an adapter first", "lora_name")
            a, b = self._read(Path(path))
            slot = free[0]
            columns = slice((slot - 1) * self.max_rank, slot * self.max_rank)
            with torch.no_grad(), self._device.lock:  # (between two steps of the engine)
                for module_name, module in self.modules.items():
                    module.lora_a[columns] = 0.0
                    module.lora_b[:, columns] = 0.0
                    if module_name in a:
                        rank = a[module_name].shape[0]
                        module.lora_a[columns][:rank] = a[module_name].to(module.lora_a.dtype)
                        module.lora_b[:, columns][:, :rank] = b[module_name].to(module.lora_b.dtype)
            self.names[name], self.paths[name] = slot, str(path)
            return slot

    def unload(self, name: str) -> None:
        """Unloads the adapter `name`: new requests cannot name it; its slot is free once the requests
        running with it end.

        Raises:
            ModelNotFoundError: no adapter of that name is loaded (names `lora_name`).
        """
        with self._lock:
            if name not in self.names:
                raise ModelNotFoundError(f"no LoRA adapter {name!r} is loaded here", "lora_name")
            del self.names[name], self.paths[name]

    def _read(self, folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The adapter's `A` and `B` (times its scale) per module name, on the host, checked."""
        config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
        if not config_file.is_file():
            raise InvalidRequestError(f"{config_file} does not exist: lora_path must be the folder of a PEFT "
                                      "adapter (save_pretrained's)", "lora_path")
        if not weights_file.is_file():
            pickled = " (only a pickled adapter_model.bin: this server loads no pickle)" if (
                folder / "adapter_model.bin").is_file() else ""
            raise InvalidRequestError(f"{weights_file} does not exist{pickled}", "lora_path")
        config = json.loads(config_file.read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise InvalidRequestError(f"{config_file}: peft_type {config['peft_type']!r} is not LORA", "lora_path")
        for field, served in UNSUPPORTED.items():
            if config.get(field, served) not in (served, None, {}, False):
                raise InvalidRequestError(f"{config_file}: {field}={config[field]!r} is not served (only "
                                          f"{field}={served!r})", "lora_path")
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        if rank > self.max_rank:
            raise InvalidRequestError(f"{config_file}: r={rank} is above this server's largest rank, {self.max_rank} "
                                      "(--max-lora-rank)", "lora_path")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        a, b = {}, {}
        for key, tensor in load_file(weights_file).items():
            module_name, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            module = self.modules.get(module_name)
            if module is None:
                raise InvalidRequestError(f"{weights_file}: {key} is for {module_name!r}, which is not a linear layer "
                                          "this server's adapters reach (every one but the output head)", "lora_path")
            expected = {"A.weight": (rank, module.in_features), "B.weight": (module.out_features, rank)}.get(kind)
            if expected is None or tuple(tensor.shape) != expected:
                raise InvalidRequestError(f"{weights_file}: {key} has the shape {tuple(tensor.shape)}, not {expected} "
                                          f"(r={rank} and the layer's)", "lora_path")
            (a if kind == "A.weight" else b)[module_name] = tensor if kind == "A.weight" else tensor * scale
        if set(a) != set(b) or not a:
            raise InvalidRequestError(f"{weights_file}: every module needs its lora_A and lora_B (found A for "
                                      f"{sorted(a)}, B for {sorted(b)})", "lora_path")
        return a, b


def _add_adapters(module: torch.nn.Linear, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    """The forward hook of a layer: its output plus each row's adapter's (see the module's docstring);
    as it is outside the engine's steps (no rows set)."""
    mask = module.lora_rows.mask  # (built once a step on the host: not per layer in the graph)
    if mask is None:
        return output
    return output + ((args[0] @ module.lora_a.T) * mask[:, None, :]) @ module.lora_b.T
