// Python bindings of the reference device (`optimum_neuron_torch.device.reference._C`).
#include "neuron.h"

#include <torch/csrc/Generator.h>
#include <torch/extension.h>

namespace {

py::object default_generator(c10::DeviceIndex index) {
  return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(neuron::default_generator(index)));
}

// Unlike neuron::host_view (used inside one kernel call), the view holds the device storage: it may
// outlive the caller's reference (a collective in flight).
at::Tensor host_view(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == neuron::kNeuron, "host_view: expected a neuron tensor, got one on ", t.device());
  c10::Storage storage = t.storage();
  return at::from_blob(
      t.data_ptr(), t.sizes(), t.strides(), [storage](void* /*unused*/) {},
      at::TensorOptions().dtype(t.dtype()).device(c10::kCPU));
}

py::list fallback_counts() {
  py::list stats;
  for (const auto& stat : neuron::fallback_stats()) {
    stats.append(py::make_tuple(stat.op, stat.calls, stat.nanoseconds));
  }
  return stats;
}

py::dict transfer_counts() {
  const neuron::TransferCounts counts = neuron::transfer_counts();
  py::dict result;
  result["host_to_device_bytes"] = counts.host_to_device_bytes;
  result["device_to_host_bytes"] = counts.device_to_host_bytes;
  result["host_to_device_copies"] = counts.host_to_device_copies;
  result["synchronizations"] = counts.synchronizations;
  return result;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The reference neuron device: a PrivateUse1 backend in host memory.";
  m.def("register_hooks", &neuron::register_hooks, "Make neuron the process's PrivateUse1 accelerator.");
  m.def("device_count", &neuron::device_count);
  m.def("set_device_count", &neuron::set_device_count);
  m.def("current_device", &neuron::current_device);
  m.def("set_current_device", &neuron::set_current_device);
  m.def("set_default_device", &neuron::set_default_device);
  m.def("capacity", &neuron::capacity, "Device memory capacity in bytes, per device.");
  m.def("set_capacity", &neuron::set_capacity);
  m.def("default_generator", &default_generator);
  m.def("host_view", &host_view, "A CPU tensor over the memory of a neuron tensor (no copy), keeping it alive.");
  m.def("set_profile", &neuron::set_profile, py::arg("all_native"), py::arg("native_ops"));
  m.def("route_through_device", &neuron::route_through_device);
  // The modes cross into Python by name: optimum_neuron_torch.settings.FALLBACK_MODES holds the same names.
  py::enum_<neuron::FallbackMode>(m, "FallbackMode")
      .value("warn", neuron::FallbackMode::Warn)
      .value("error", neuron::FallbackMode::Error)
      .value("silent", neuron::FallbackMode::Silent);
  m.def("set_fallback_mode", &neuron::set_fallback_mode);
  m.def("fallback_mode", &neuron::fallback_mode);
  m.def("set_fallback_copies", &neuron::set_fallback_copies);
  m.def("fallback_counts", &fallback_counts, "(op, calls, nanoseconds) of every op that fell back.");
  m.def("executed_ops", &neuron::executed_ops);
  m.def("clear_op_tracking", &neuron::clear_op_tracking);
  m.def("transfer_counts", &transfer_counts, "Bytes and copies between host and device, and synchronizations.");
  m.def("clear_transfer_counts", &neuron::clear_transfer_counts);
}
