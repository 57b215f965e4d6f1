// Running ATen ops on the device: every op without an explicit kernel reaches the boxed
// fallback below, which runs the CPU kernel on host views of the device memory (no copy) and
// maps the results back. The support profile decides which ops count as native; the others
// take the *fallback path*, which is counted, warned about once, or refused (strict mode), and
// can copy its inputs and outputs like TorchNeuron's CPU fallback does.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace neuron {
namespace {

// ---------------------------------------------------------------------------------------------
// Support profile and op tracking
// ---------------------------------------------------------------------------------------------

struct OpEntry {
  std::string name; // "aten::add.out"
  bool native = true; // per the active profile
  std::vector<int> written_args; // arguments the op writes (in-place and out= ops)
  bool contiguous_results = false; // see `lays_out_by_strides`
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> nanoseconds{0};
  std::atomic<bool> executed{false};
  std::atomic<bool> warned{false};
};

std::mutex g_ops_mutex;
std::unordered_map<std::string, std::unique_ptr<OpEntry>> g_ops_by_name;
std::unordered_map<const c10::FunctionSchema*, OpEntry*> g_ops_by_schema;
bool g_all_native = true;
std::unordered_set<std::string> g_native_ops;
std::atomic<int> g_mode{static_cast<int>(FallbackMode::Warn)};
std::atomic<bool> g_copies{false};

std::string qualified_name(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

bool is_native(const std::string& name) {
  return g_all_native || g_native_ops.count(name) > 0;
}

// Ops whose CPU kernel lays its result out by its arguments' strides where the op's meta function
// (which compiled graphs are planned by) gives a contiguous result: a CPU convolution goes
// channels-last when its input or weight looks channels-last, as a weight of 1 x 1 kernels over one
// input channel does, and a compiled FastSpeech2 failed Inductor's check of the result's strides.
// Their results are made contiguous, as a device kernel that allocates by the meta function gives them.
bool lays_out_by_strides(const std::string& name) {
  return name == "aten::convolution" || name == "aten::_convolution";
}

// Caller holds g_ops_mutex.
OpEntry& entry_named_locked(const std::string& name) {
  auto& slot = g_ops_by_name[name];
  if (!slot) {
    slot = std::make_unique<OpEntry>();
    slot->name = name;
    slot->native = is_native(name);
    slot->contiguous_results = lays_out_by_strides(name);
  }
  return *slot;
}

OpEntry& entry_for(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* schema = &op.schema();
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  auto found = g_ops_by_schema.find(schema);
  if (found != g_ops_by_schema.end()) {
    return *found->second;
  }
  OpEntry& entry = entry_named_locked(qualified_name(schema->operator_name()));
  const auto& arguments = schema->arguments();
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite()) {
      entry.written_args.push_back(static_cast<int>(i));
    }
  }
  g_ops_by_schema.emplace(schema, &entry);
  return entry;
}

// Records one call of `entry` and applies the fallback policy. Returns true when the call takes
// the fallback path.
bool admit(OpEntry& entry) {
  if (entry.native) {
    entry.executed.store(true, std::memory_order_relaxed);
    return false;
  }
  const auto mode = static_cast<FallbackMode>(g_mode.load(std::memory_order_relaxed));
  TORCH_CHECK_NOT_IMPLEMENTED(
      mode != FallbackMode::Error, "Operator '", entry.name,
      "' fell back to CPU, and the fallback policy 'error' (OPTIMUM_NEURON_TORCH_FALLBACK=error or "
      "optimum_neuron_torch.fallback_policy('error')) forbids fallbacks: TorchNeuron has no native kernel "
      "for it (support profile 'torchneuron'). Rewrite the call with native ops, or use the policy 'warn' "
      "to let it run on the CPU.");
  entry.calls.fetch_add(1, std::memory_order_relaxed);
  if (mode == FallbackMode::Warn && !entry.warned.exchange(true)) {
    TORCH_WARN("Operator '", entry.name, "' fell back to CPU (TorchNeuron has no native kernel for it; "
               "see optimum_neuron_torch.device.fallback_ops()).");
  }
  return true;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------------------------
// Host views of device tensors, and device tensors from host results
// ---------------------------------------------------------------------------------------------

c10::Storage host_storage_over(const c10::Storage& device, bool copy) {
  const std::size_t nbytes = device.nbytes();
  c10::Allocator* cpu_allocator = c10::GetCPUAllocator();
  c10::DataPtr data;
  if (copy) {
    data = cpu_allocator->allocate(nbytes);
    if (nbytes > 0) {
      std::memcpy(data.get(), device.data(), nbytes);
    }
  } else {
    data = c10::DataPtr(const_cast<void*>(device.data()), c10::Device(c10::kCPU)); // not owned
  }
  // Resizable through the CPU allocator, so that CPU kernels can resize `out=` arguments; the
  // new memory is moved back onto the device afterwards.
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(data), cpu_allocator, /*resizable=*/true));
}

at::Tensor tensor_over(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) {
    t._set_conj(true);
  }
  if (like.is_neg()) {
    t._set_neg(true);
  }
  return t;
}

c10::Storage device_storage_from(c10::Storage& host, c10::DeviceIndex device, bool adopt_memory) {
  const std::size_t nbytes = host.nbytes();
  c10::DataPtr data;
  if (adopt_memory) {
    data = adopt(host.unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr()), nbytes, device);
  } else {
    const c10::DeviceGuard guard(c10::Device(kNeuron, device));
    data = device_allocator()->allocate(nbytes);
    if (nbytes > 0) {
      std::memcpy(data.get(), host.data(), nbytes);
    }
  }
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(data), device_allocator(), /*resizable=*/true));
}

// The host side of one fallback call: host views of every device tensor among the arguments
// (one host storage per device storage, so aliasing is preserved), and the way back.
class HostCall {
 public:
  HostCall(bool copies, c10::DeviceIndex device) : copies_(copies), device_(device) {}

  at::Tensor to_host(const at::Tensor& t) {
    Slot& slot = slot_for(t.storage());
    at::Tensor host = tensor_over(slot.host, c10::DispatchKey::CPU, t);
    tensors_.emplace_back(host, t);
    return host;
  }

  // After the CPU kernel ran: moves memory that it reallocated (resized `out=` arguments) onto
  // the device and, when arguments were copies, copies every argument's memory back (some ops
  // write arguments their schema does not mark as written, like batch norm's running stats).
  void sync_storages() {
    for (Slot& slot : slots_) {
      c10::StorageImpl* dst = slot.device.unsafeGetStorageImpl();
      const bool reallocated = slot.host.data() != slot.host_data || slot.host.nbytes() != dst->nbytes();
      if (reallocated) {
        c10::Storage fresh = device_storage_from(slot.host, device_, /*adopt_memory=*/!copies_);
        dst->set_data_ptr_noswap(fresh.unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr()));
        dst->set_nbytes(fresh.nbytes());
      } else if (copies_ && dst->nbytes() > 0) {
        std::memcpy(dst->mutable_data(), slot.host.data(), dst->nbytes());
      }
    }
  }

  // Gives a written device argument the metadata the CPU kernel gave its host view (resizes).
  static void sync_metadata(const at::Tensor& device, const at::Tensor& host) {
    c10::TensorImpl* impl = device.unsafeGetTensorImpl();
    if (impl->sizes() != host.sizes() || impl->strides() != host.strides() ||
        impl->storage_offset() != host.storage_offset()) {
      impl->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
    }
  }

  // The device tensor for a host result: the argument itself, a view of an argument's storage,
  // or fresh memory moved onto the device.
  at::Tensor to_device(const at::Tensor& host) {
    if (!host.defined()) {
      return host;
    }
    for (const auto& [argument, device] : tensors_) {
      if (argument.unsafeGetTensorImpl() == host.unsafeGetTensorImpl()) {
        return device;
      }
    }
    TORCH_CHECK_NOT_IMPLEMENTED(
        host.layout() == c10::kStrided, "neuron: an op produced a ", host.layout(),
        " tensor; the neuron device (like TorchNeuron) has no sparse tensors. Keep sparse work on the CPU.");
    const c10::StorageImpl* storage = host.storage().unsafeGetStorageImpl();
    for (Slot& slot : slots_) {
      if (slot.host.unsafeGetStorageImpl() == storage) {
        return tensor_over(slot.device, c10::DispatchKey::PrivateUse1, host);
      }
    }
    for (auto& [host_storage, device_storage] : results_) {
      if (host_storage.unsafeGetStorageImpl() == storage) {
        return tensor_over(device_storage, c10::DispatchKey::PrivateUse1, host);
      }
    }
    c10::Storage host_storage = host.storage();
    // Adopt the memory when only this result holds it (the local copy above accounts for one).
    const bool sole_owner = host_storage.use_count() <= 2 && !copies_;
    c10::Storage device_storage = device_storage_from(host_storage, device_, sole_owner);
    results_.emplace_back(host_storage, device_storage);
    return tensor_over(device_storage, c10::DispatchKey::PrivateUse1, host);
  }

 private:
  struct Slot {
    c10::Storage device;
    c10::Storage host;
    const void* host_data;
  };

  Slot& slot_for(const c10::Storage& device) {
    for (Slot& slot : slots_) {
      if (slot.device.unsafeGetStorageImpl() == device.unsafeGetStorageImpl()) {
        return slot;
      }
    }
    c10::Storage host = host_storage_over(device, copies_);
    const void* data = host.data();
    slots_.push_back(Slot{device, std::move(host), data});
    return slots_.back();
  }

  bool copies_;
  c10::DeviceIndex device_;
  c10::SmallVector<Slot, 4> slots_;
  // (host, device) pairs, the host side held: a result made after the arguments were released (see
  // `lays_out_by_strides`) could otherwise take a released host view's address and pass for it.
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 8> tensors_;
  c10::SmallVector<std::pair<c10::Storage, c10::Storage>, 2> results_;
};

bool is_device_tensor(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kNeuron;
}

c10::DeviceIndex device_of_arguments(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (is_device_tensor(v)) {
      return v.toTensor().device().index();
    }
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (t.defined() && t.device().type() == kNeuron) {
          return t.device().index();
        }
      }
    }
    if (v.isDevice() && v.toDevice().type() == kNeuron) {
      return v.toDevice().has_index() ? v.toDevice().index() : current_device();
    }
  }
  return current_device();
}

// Runs `op` on the CPU over host views of its arguments and puts device results on the stack.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, const OpEntry& entry, bool copies) {
  const auto& schema = op.schema();
  const size_t num_arguments = schema.arguments().size();
  const size_t first = stack->size() - num_arguments;
  const c10::DeviceIndex device = device_of_arguments(*stack, first);
  HostCall call(copies, device);

  // (device, host) pairs of the tensors the op writes, to bring their changes back.
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 4> written;
  auto to_host = [&](const at::Tensor& t, bool writes) {
    if (!t.defined() || t.device().type() != kNeuron) {
      return t;
    }
    at::Tensor host = call.to_host(t);
    if (writes) {
      written.emplace_back(t, host);
    }
    return host;
  };
  for (size_t i = 0; i < num_arguments; ++i) {
    c10::IValue& v = (*stack)[first + i];
    const bool writes = std::find(entry.written_args.begin(), entry.written_args.end(), static_cast<int>(i)) !=
        entry.written_args.end();
    if (v.isTensor()) {
      v = to_host(v.toTensor(), writes);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> hosts;
      hosts.reserve(v.toTensorList().size());
      for (const at::Tensor& t : v.toTensorList()) {
        hosts.push_back(to_host(t, writes));
      }
      v = std::move(hosts);
    } else if (v.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> hosts;
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        hosts.push_back(t.has_value() ? std::optional<at::Tensor>(to_host(*t, writes)) : std::nullopt);
      }
      v = std::move(hosts);
    } else if (v.isDevice() && v.toDevice().type() == kNeuron) {
      v = c10::Device(c10::kCPU);
    }
    // Generators pass through as in PyTorch's `cpu_fallback`, which TorchNeuron's fallback calls
    // (`csrc/core/NeuronBindings.cpp`, `neuron_cpu_fallback`): a random op without one draws from the
    // CPU default generator, and the CPU kernel refuses a `neuron` generator, as on Trn.
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  // Arguments first: results may view their storage.
  call.sync_storages();
  for (const auto& [device_tensor, host] : written) {
    HostCall::sync_metadata(device_tensor, host);
  }
  const size_t num_returns = schema.returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor() && entry.contiguous_results) {
      v = call.to_device(v.toTensor().contiguous());
    } else if (v.isTensor()) {
      v = call.to_device(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> results;
      results.reserve(v.toTensorList().size());
      for (const at::Tensor& t : v.toTensorList()) {
        results.push_back(call.to_device(t));
      }
      v = std::move(results);
    }
  }
}

} // namespace

at::Tensor host_view(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNeuron) {
    return t;
  }
  return tensor_over(host_storage_over(t.storage(), /*copy=*/false), c10::DispatchKey::CPU, t);
}

at::Tensor to_device(const at::Tensor& cpu, c10::DeviceIndex device) {
  if (!cpu.defined()) {
    return cpu;
  }
  c10::Storage storage = cpu.storage();
  const bool sole_owner = storage.use_count() <= 2; // the tensor's reference and ours
  return tensor_over(device_storage_from(storage, device, sole_owner), c10::DispatchKey::PrivateUse1, cpu);
}

void boxed_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  OpEntry& entry = entry_for(op);
  if (!admit(entry)) {
    run_on_host(op, stack, entry, /*copies=*/false);
    return;
  }
  const int64_t start = now_ns();
  run_on_host(op, stack, entry, g_copies.load(std::memory_order_relaxed));
  entry.nanoseconds.fetch_add(now_ns() - start, std::memory_order_relaxed);
}

void route_through_device(const std::vector<std::string>& names) {
  static std::vector<std::unique_ptr<torch::Library>> libraries; // registrations live as long as these
  auto library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const std::string& name : names) {
    const auto separator = name.find('.');
    const std::string base = name.substr(0, separator);
    const std::string overload = separator == std::string::npos ? "" : name.substr(separator + 1);
    const auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(base, overload));
    if (!handle.has_value() || handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !(handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
      continue;
    }
    // Factories and copies decide the device of their result: their composite kernels handle it.
    bool takes_device = base == "aten::copy_" || base == "aten::_to_copy";
    for (const auto& argument : handle->schema().arguments()) {
      const auto& type = argument.real_type();
      const auto& element = type->kind() == c10::TypeKind::OptionalType
          ? type->castRaw<c10::OptionalType>()->getElementType()
          : type;
      takes_device = takes_device || element->kind() == c10::TypeKind::DeviceObjType ||
          element->kind() == c10::TypeKind::StreamObjType;
    }
    if (!takes_device) {
      library->impl(name.substr(name.find("::") + 2).c_str(),
                    torch::CppFunction::makeFromBoxedFunction<&boxed_fallback>());
    }
  }
  libraries.push_back(std::move(library));
}

void track_explicit(const char* name) {
  OpEntry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    entry = &entry_named_locked(name);
  }
  admit(*entry);
}

void set_profile(bool all_native, const std::vector<std::string>& native_ops) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  g_all_native = all_native;
  g_native_ops = std::unordered_set<std::string>(native_ops.begin(), native_ops.end());
  for (auto& [name, entry] : g_ops_by_name) {
    entry->native = is_native(name);
  }
}

void set_fallback_mode(FallbackMode mode) {
  g_mode.store(static_cast<int>(mode));
}

FallbackMode fallback_mode() {
  return static_cast<FallbackMode>(g_mode.load());
}

void set_fallback_copies(bool copies) {
  g_copies.store(copies);
}

std::vector<FallbackStat> fallback_stats() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  std::vector<FallbackStat> stats;
  for (const auto& [name, entry] : g_ops_by_name) {
    if (entry->calls.load() > 0) {
      stats.push_back({name, entry->calls.load(), entry->nanoseconds.load()});
    }
  }
  return stats;
}

std::vector<std::string> executed_ops() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  std::vector<std::string> names;
  for (const auto& [name, entry] : g_ops_by_name) {
    if (entry->executed.load()) {
      names.push_back(name);
    }
  }
  return names;
}

void clear_op_tracking() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  for (auto& [name, entry] : g_ops_by_name) {
    entry->calls = 0;
    entry->nanoseconds = 0;
    entry->executed = false;
    entry->warned = false;
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&boxed_fallback>());
}

} // namespace neuron
