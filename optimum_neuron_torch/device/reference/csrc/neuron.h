// The reference `neuron` device: a PrivateUse1 backend whose memory is host memory.
// Declarations shared by the translation units of this extension.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- devices (runtime.cpp) ----
c10::DeviceIndex device_count();
void set_device_count(c10::DeviceIndex count);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
// The device every thread starts on (the local rank under a launcher).
void set_default_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);

void register_hooks();

// ---- memory (allocator.cpp) ----
c10::DeviceAllocator* device_allocator();
void set_capacity(std::size_t bytes);
std::size_t capacity();
// Take ownership of host memory allocated elsewhere (a CPU kernel's output) as device memory
// of `device`, accounting for it like an allocation (and raising OutOfMemoryError past capacity).
c10::DataPtr adopt(c10::DataPtr&& host, std::size_t nbytes, c10::DeviceIndex device);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);

// ---- random numbers (runtime.cpp) ----
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

// ---- host views (fallback.cpp) ----
// A CPU tensor over the same memory as a `neuron` tensor (no copy).
at::Tensor host_view(const at::Tensor& t);
// A `neuron` tensor owning the memory of a CPU tensor: adopted when nothing else holds it, else copied.
at::Tensor to_device(const at::Tensor& cpu, c10::DeviceIndex device);

// ---- support profile and op tracking (fallback.cpp) ----
enum class FallbackMode : int { Warn = 0, Error = 1, Silent = 2 };
void set_profile(bool all_native, const std::vector<std::string>& native_ops);
void set_fallback_mode(FallbackMode mode);
FallbackMode fallback_mode();
void set_fallback_copies(bool copies);
// Counts one call of an op implemented by an explicit kernel of this extension, as the
// profile says (executed natively, or a fallback).
void track_explicit(const char* name);

struct FallbackStat {
  std::string op;
  int64_t calls;
  int64_t nanoseconds;
};
std::vector<FallbackStat> fallback_stats();
std::vector<std::string> executed_ops();
void clear_op_tracking();

void boxed_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Registers the boxed fallback as the device kernel of these ops where PyTorch would otherwise
// decompose them with a composite kernel: ops a backend implements run as themselves, as on
// TorchNeuron (and composites that reject unknown devices run at all).
void route_through_device(const std::vector<std::string>& names);

// ---- host<->device transfers (transfers.cpp) ----
// Called by the copies between host and device memory (a copy to the host, or `.item()`, is a
// synchronization: the host waits for the device's value).
void count_host_to_device(std::size_t bytes);
void count_device_to_host(std::size_t bytes);
struct TransferCounts {
  int64_t host_to_device_bytes;
  int64_t device_to_host_bytes;
  int64_t host_to_device_copies;
  int64_t synchronizations;
};
TransferCounts transfer_counts();
void clear_transfer_counts();

// ---- decode attention (decode_attention.cpp) ----
// Whether fused attention of these arguments runs the decode kernel: a few query rows (a decode
// step) over a long cache, float32 or bfloat16, no dropout, not causal.
bool is_decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal);
// (output laid out like the query, logsumexp [batch, heads, rows] float32), on the query's device.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value, const std::optional<at::Tensor>& attn_mask,
                                                    std::optional<double> scale);

} // namespace neuron
