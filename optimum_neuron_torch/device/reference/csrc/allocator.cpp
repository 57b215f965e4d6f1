// Device memory: host memory with a fixed capacity per device and CUDA-style statistics,
// plus the pinned host allocator that `Tensor.pin_memory()` uses.
#include "neuron.h"

#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace neuron {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
constexpr std::size_t kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
constexpr c10::DeviceIndex kMaxDevices = 64;

std::atomic<std::size_t> g_capacity{24ull << 30};

// The context of every device allocation: its size and device for the statistics, and the
// host memory itself (allocated here, or adopted from a CPU kernel's output), freed with it.
struct Block {
  std::size_t nbytes;
  c10::DeviceIndex device;
  c10::DataPtr host;
};

class NeuronAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    reserve(nbytes, device);
    void* data = nullptr;
    if (nbytes > 0) {
      try {
        data = c10::alloc_cpu(nbytes);
      } catch (...) {
        release(nbytes, device);
        throw;
      }
    }
    c10::DataPtr host(data, data, &c10::free_cpu, c10::Device(c10::kCPU));
    return {data, new Block{nbytes, device, std::move(host)}, &delete_block, c10::Device(kNeuron, device)};
  }

  c10::DataPtr adopt(c10::DataPtr&& host, std::size_t nbytes, c10::DeviceIndex device) {
    reserve(nbytes, device);
    void* data = host.get();
    return {data, new Block{nbytes, device, std::move(host)}, &delete_block, c10::Device(kNeuron, device)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t /*unused*/) override {} // nothing is cached
  void recordStream(const c10::DataPtr& /*unused*/, c10::Stream /*unused*/) override {} // streams are synchronous

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : stat_arrays(stats_[device])) {
      (*array)[kAggregate].allocated = 0;
      (*array)[kAggregate].freed = 0;
    }
    stats_[device].num_ooms = 0;
    stats_[device].num_device_alloc = 0;
    stats_[device].num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* array : stat_arrays(stats_[device])) {
      (*array)[kAggregate].peak = (*array)[kAggregate].current;
    }
  }

  std::pair<std::size_t, std::size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t total = g_capacity.load();
    const auto used = static_cast<std::size_t>(stats_[device].allocated_bytes[kAggregate].current);
    return {used >= total ? 0 : total - used, total};
  }

 private:
  static std::vector<c10::CachingAllocator::StatArray*> stat_arrays(DeviceStats& s) {
    return {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
            &s.active_bytes, &s.requested_bytes};
  }

  // Accounts for `nbytes` on `device`, or raises OutOfMemoryError when it does not fit.
  void reserve(std::size_t nbytes, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceStats& s = stats_[device];
    const std::size_t used = static_cast<std::size_t>(s.allocated_bytes[kAggregate].current);
    const std::size_t total = g_capacity.load();
    if (nbytes > total || used > total - nbytes) {
      s.num_ooms += 1;
      TORCH_CHECK_WITH(
          OutOfMemoryError, false,
          "neuron:", static_cast<int>(device), " out of memory: tried to allocate ", nbytes,
          " bytes with ", used, " bytes allocated of a capacity of ", total, " bytes (",
          (total > used ? total - used : 0), " bytes free). Free tensors you no longer need, use a "
          "smaller dtype or batch, or raise the capacity with OPTIMUM_NEURON_TORCH_DEVICE_MEMORY.");
    }
    for (auto* array : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      (*array)[kAggregate].increase(nbytes);
    }
    for (auto* array : {&s.allocation, &s.segment, &s.active}) {
      (*array)[kAggregate].increase(1);
    }
    s.num_device_alloc += 1;
  }

  void release(std::size_t nbytes, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceStats& s = stats_[device];
    for (auto* array : {&s.allocated_bytes, &s.reserved_bytes, &s.active_bytes, &s.requested_bytes}) {
      (*array)[kAggregate].decrease(nbytes);
    }
    for (auto* array : {&s.allocation, &s.segment, &s.active}) {
      (*array)[kAggregate].decrease(1);
    }
    s.num_device_free += 1;
  }

  static void delete_block(void* ctx);

  std::mutex mutex_;
  DeviceStats stats_[kMaxDevices];
};

NeuronAllocator g_allocator;

void NeuronAllocator::delete_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_allocator.release(block->nbytes, block->device);
  delete block;
}

// Pinned host memory: ordinary host memory, remembered so that `is_pinned()` can answer.
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    void* data = nbytes > 0 ? c10::alloc_cpu(nbytes) : nullptr;
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      pointers_.insert(data);
    }
    return {data, data, &delete_pinned, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool contains(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pointers_.count(data) > 0;
  }

 private:
  static void delete_pinned(void* data);
  std::mutex mutex_;
  std::unordered_set<const void*> pointers_;
};

PinnedAllocator g_pinned;

void PinnedAllocator::delete_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(g_pinned.mutex_);
    g_pinned.pointers_.erase(data);
  }
  c10::free_cpu(data);
}

} // namespace

c10::DeviceAllocator* device_allocator() {
  return &g_allocator;
}

void set_capacity(std::size_t bytes) {
  g_capacity.store(bytes);
}

std::size_t capacity() {
  return g_capacity.load();
}

c10::DataPtr adopt(c10::DataPtr&& host, std::size_t nbytes, c10::DeviceIndex device) {
  return g_allocator.adopt(std::move(host), nbytes, device);
}

c10::Allocator* pinned_allocator() {
  return &g_pinned;
}

bool is_pinned(const void* ptr) {
  return g_pinned.contains(ptr);
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

} // namespace neuron
