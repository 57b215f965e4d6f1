"""Teaching Inductor that the reference `neuron` device is host memory: its C++ code generation
runs on `neuron` tensors as it does on CPU ones (the kernels work on the host pointers).

Registration uses Inductor's own extension points (device interface, codegen backend, device op
overrides). One internal check, `BaseSchedulerNode.is_cpu`, decides host-only fusion rules by the
device name; it is patched only while a graph is compiled (`host_memory_codegen()`), and the
backend lookup for an unknown device is pointed at `cpp` through Inductor's own config patch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._dynamo.device_interface import CpuInterface, register_interface_for_device
from torch._inductor import config as inductor_config
from torch._inductor import scheduler
from torch._inductor.codegen.common import register_backend_for_device, register_device_op_overrides
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
from torch._inductor.codegen.wrapper import PythonWrapperCodegen
from torch._inductor.virtualized import V

DEVICE = "neuron"


class NeuronInterface(CpuInterface):
    """Dynamo's view of the device: host memory, synchronous, no Triton."""

    @staticmethod
    def current_device() -> int:
        return torch.neuron.current_device()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        torch.neuron.set_device(device)

    @staticmethod
    def device_count() -> int:
        return torch.neuron.device_count()

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return False


class NeuronWrapperCodegen(PythonWrapperCodegen):
    """Python wrapper code that calls the generated C++ kernels directly, as for CPU."""

    @staticmethod
    def create(is_subgraph: bool, subgraph_name: str | None, parent_wrapper: Any,
               partition_signatures: Any = None) -> Any:
        if is_subgraph:
            return PythonWrapperCodegen.create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures)
        return NeuronWrapperCodegen()

    def _generate_kernel_call_helper(self, kernel_name: str, call_args: Any, *, device: Any = None,
                                     triton: bool = True, **kwargs: Any) -> None:
        device = device or V.graph.get_current_device_or_throw()
        if not triton and device.type == DEVICE:
            self.writeline(self.wrap_kernel_call(kernel_name, call_args))
            return
        super()._generate_kernel_call_helper(kernel_name, call_args, device=device, triton=triton, **kwargs)


_registered = False


def register() -> None:
    """Registers the device with Dynamo and Inductor (once)."""
    global _registered
    if not _registered:
        register_interface_for_device(DEVICE, NeuronInterface)
        register_backend_for_device(DEVICE, CppScheduling, NeuronWrapperCodegen, CppWrapperCpu)
        register_device_op_overrides(DEVICE, CpuDeviceOpOverrides())
        _registered = True


def _is_host(node: scheduler.BaseSchedulerNode) -> bool:
    device = node.get_device()
    return device is not None and device.type in ("cpu", DEVICE)


@contextlib.contextmanager
def host_memory_codegen() -> Iterator[None]:
    """While compiling: `neuron` nodes follow the host fusion rules and the `cpp` backend, and keep
    the layouts their ops give. (Inductor's layout optimization, which it decides by device type,
    would turn a convolution's tensors channels-last for a device it does not know as the CPU, and
    expect outputs of a layout the host's convolution kernel does not give: a compiled vision
    encoder then failed its own stride checks.)"""
    original = scheduler.BaseSchedulerNode.is_cpu
    scheduler.BaseSchedulerNode.is_cpu = _is_host
    try:
        with inductor_config.patch({"cuda_backend": "cpp", "layout_optimization": False}):
            yield
    finally:
        scheduler.BaseSchedulerNode.is_cpu = original
