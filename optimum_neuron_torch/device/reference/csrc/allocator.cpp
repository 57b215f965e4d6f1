// Device memory: host memory with a fixed capacity per device and CUDA-style statistics, cached
// for reuse as CUDA's and TorchNeuron's caching allocators do; plus the pinned host allocator that
// `Tensor.pin_memory()` uses.
//
// Why a cache: fresh host memory page-faults on its first touch (the kernel zeroes each page), which
// real device memory does not; a decode loop that frees and allocates the same shapes every step
// would pay those faults every step. A freed block is kept and handed to the next allocation of
// (about) its size; `empty_cache()` returns the kept blocks to the host, and so does an allocation
// that would not fit the capacity otherwise. (Transparent huge pages were measured and not kept:
// with the kernel's default `defrag=madvise`, faulting in advised memory compacts first, and a fresh
// 2.3 GiB of device memory took 3-5 s to write instead of 0.6-1.6 s; benchmarks/RESULTS.md.)
#include "neuron.h"

#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_set>

namespace neuron {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
constexpr std::size_t kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
constexpr c10::DeviceIndex kMaxDevices = 64;
// A cached block serves a request it exceeds by at most 1/kMaxSlack of the request.
constexpr std::size_t kMaxSlack = 8;

std::atomic<std::size_t> g_capacity{24ull << 30};

// The context of every device allocation: the bytes asked for and the bytes held (the block's),
// its device, and its memory: a block of this allocator's (kept for reuse when freed), or memory
// adopted from a CPU kernel's output (returned to its owner when freed).
struct Block {
  std::size_t nbytes;
  std::size_t size;
  c10::DeviceIndex device;
  void* data;
  bool adopted;
  c10::DataPtr owner; // (adopted memory: its owner's pointer, which frees it)
};

class NeuronAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(std::size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    check_device_index(device);
    void* data = nullptr;
    std::size_t size = 0;
    if (nbytes > 0) {
      std::tie(data, size) = take_block(nbytes, device);
    } else {
      count_allocation(0, device);
    }
    return {data, new Block{nbytes, size, device, data, false, c10::DataPtr()}, &delete_block,
            c10::Device(kNeuron, device)};
  }

  c10::DataPtr adopt(c10::DataPtr&& host, std::size_t nbytes, c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      make_room(nbytes, nbytes, device);
      count_segment(nbytes, device);
    }
    count_allocation(nbytes, device);
    void* data = host.get();
    return {data, new Block{nbytes, nbytes, device, data, true, std::move(host)}, &delete_block,
            c10::Device(kNeuron, device)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  bool initialized() override {
    return true;
  }

  void emptyCache(c10::MempoolId_t /*unused*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (c10::DeviceIndex device = 0; device < kMaxDevices; ++device) {
      release_cached(device);
    }
  }

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

  // (free, total): free is the capacity less what is reserved, cached blocks included.
  std::pair<std::size_t, std::size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t total = g_capacity.load();
    const std::size_t reserved = reserved_bytes(device);
    return {reserved >= total ? 0 : total - reserved, total};
  }

 private:
  static std::vector<c10::CachingAllocator::StatArray*> stat_arrays(DeviceStats& s) {
    return {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
            &s.active_bytes, &s.requested_bytes};
  }

  std::size_t reserved_bytes(c10::DeviceIndex device) {
    return static_cast<std::size_t>(stats_[device].reserved_bytes[kAggregate].current);
  }

  // A block of at least `nbytes` for `device`: a cached one that fits closely, else a new one.
  std::pair<void*, std::size_t> take_block(std::size_t nbytes, c10::DeviceIndex device) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& cached = cached_[device];
      auto it = cached.lower_bound(nbytes);
      if (it != cached.end() && it->first - nbytes <= nbytes / kMaxSlack) {
        const std::pair<void*, std::size_t> block{it->second, it->first};
        cached.erase(it);
        count_allocation_locked(nbytes, device);
        return block;
      }
      make_room(nbytes, nbytes, device);
      count_segment(nbytes, device); // (reserved now, so that no other thread takes the room)
    }
    void* data = nullptr;
    try {
      data = c10::alloc_cpu(nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      uncount_segment(nbytes, device);
      throw;
    }
    count_allocation(nbytes, device);
    return {data, nbytes};
  }

  // Makes room for a new block of `size` bytes on `device` (asked for `nbytes`): returns the cached
  // blocks to the host if that is what it takes, or raises OutOfMemoryError. Holds `mutex_`.
  void make_room(std::size_t nbytes, std::size_t size, c10::DeviceIndex device) {
    const std::size_t total = g_capacity.load();
    if (size <= total && reserved_bytes(device) <= total - size) {
      return;
    }
    release_cached(device);
    const std::size_t reserved = reserved_bytes(device);
    if (size <= total && reserved <= total - size) {
      return;
    }
    DeviceStats& s = stats_[device];
    s.num_ooms += 1;
    const auto allocated = static_cast<std::size_t>(s.allocated_bytes[kAggregate].current);
    TORCH_CHECK_WITH(
        OutOfMemoryError, false,
        "neuron:", static_cast<int>(device), " out of memory: tried to allocate ", nbytes,
        " bytes with ", allocated, " bytes allocated (", reserved, " reserved) of a capacity of ", total,
        " bytes (", (total > reserved ? total - reserved : 0), " bytes free). Free tensors you no longer need, "
        "use a smaller dtype or batch, or raise the capacity with OPTIMUM_NEURON_TORCH_DEVICE_MEMORY.");
  }

  // Returns the device's cached blocks to the host. Holds `mutex_`.
  void release_cached(c10::DeviceIndex device) {
    for (const auto& [size, data] : cached_[device]) {
      c10::free_cpu(data);
      uncount_segment(size, device);
    }
    cached_[device].clear();
  }

  void count_segment(std::size_t size, c10::DeviceIndex device) {
    DeviceStats& s = stats_[device];
    s.reserved_bytes[kAggregate].increase(size);
    s.segment[kAggregate].increase(1);
    s.num_device_alloc += 1;
  }

  void uncount_segment(std::size_t size, c10::DeviceIndex device) {
    DeviceStats& s = stats_[device];
    s.reserved_bytes[kAggregate].decrease(size);
    s.segment[kAggregate].decrease(1);
    s.num_device_free += 1;
  }

  void count_allocation(std::size_t nbytes, c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex_);
    count_allocation_locked(nbytes, device);
  }

  void count_allocation_locked(std::size_t nbytes, c10::DeviceIndex device) {
    DeviceStats& s = stats_[device];
    for (auto* array : {&s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) {
      (*array)[kAggregate].increase(nbytes);
    }
    for (auto* array : {&s.allocation, &s.active}) {
      (*array)[kAggregate].increase(1);
    }
  }

  // A freed block: kept for reuse (its own), or its memory returned to its owner (adopted).
  void free_block(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    DeviceStats& s = stats_[block->device];
    for (auto* array : {&s.allocated_bytes, &s.active_bytes, &s.requested_bytes}) {
      (*array)[kAggregate].decrease(block->nbytes);
    }
    for (auto* array : {&s.allocation, &s.active}) {
      (*array)[kAggregate].decrease(1);
    }
    if (block->adopted) {
      uncount_segment(block->size, block->device);
      block->owner.clear(); // (the owner's deleter, under the lock: it does not call back here)
    } else if (block->data != nullptr) {
      cached_[block->device].emplace(block->size, block->data);
    }
  }

  static void delete_block(void* ctx);

  std::mutex mutex_;
  DeviceStats stats_[kMaxDevices];
  std::multimap<std::size_t, void*> cached_[kMaxDevices]; // free blocks by size
};

NeuronAllocator g_allocator;

void NeuronAllocator::delete_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  g_allocator.free_block(block);
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
