// Runtime of the reference device: device selection, the device guard (streams and events are
// synchronous), random number generators, and the PrivateUse1 hooks that tie them to PyTorch.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <c10/core/DeviceGuard.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>

namespace neuron {
namespace {

std::atomic<c10::DeviceIndex> g_device_count{1};
// The device a thread starts on: 0, or the process's local rank under a launcher (one device per rank).
std::atomic<c10::DeviceIndex> g_default_device{0};
thread_local c10::DeviceIndex t_current_device = g_default_device.load();

} // namespace

c10::DeviceIndex device_count() {
  return g_device_count.load();
}

void set_device_count(c10::DeviceIndex count) {
  TORCH_CHECK(count >= 1 && count <= 64, "neuron: the device count must be between 1 and 64, got ", count);
  g_device_count.store(count);
}

void set_default_device(c10::DeviceIndex index) {
  check_device_index(index);
  g_default_device.store(index);
  t_current_device = index;
}

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < device_count(), "neuron: invalid device index ", static_cast<int>(index),
      ": there are ", static_cast<int>(device_count()),
      " neuron devices (set OPTIMUM_NEURON_TORCH_DEVICE_COUNT for more)");
}

c10::DeviceIndex current_device() {
  return t_current_device;
}

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  t_current_device = index;
}

namespace {

// ---- streams and events ----
// Work runs synchronously, so a stream is only an id and an event only a timestamp.
thread_local std::vector<c10::StreamId> t_current_stream(64, 0);
std::atomic<c10::StreamId> g_next_stream{1};

struct EventRecord {
  std::chrono::steady_clock::time_point time;
};

class NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override {
    return kNeuron;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    if (d.index() != old.index()) {
      set_current_device(d.index());
    }
    return old;
  }
  c10::Device getDevice() const override {
    return {kNeuron, current_device()};
  }
  void setDevice(c10::Device d) const override {
    set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    t_current_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, t_current_stream[d.index()]);
  }
  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, g_next_stream.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::Stream old = getStream(s.device());
    t_current_stream[s.device_index()] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return device_count();
  }
  void record(void** event, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) {
      *event = new EventRecord();
    }
    static_cast<EventRecord*>(*event)->time = std::chrono::steady_clock::now();
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device*/) const noexcept override {
    delete static_cast<EventRecord*>(event);
  }
  void synchronizeEvent(void* /*event*/) const override {}
  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeDevice(const c10::DeviceIndex /*device*/) const override {}
  void recordDataPtrOnStream(const c10::DataPtr& /*data*/, const c10::Stream& /*stream*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "neuron: both events must be recorded before elapsed_time()");
    const auto delta = static_cast<EventRecord*>(end)->time - static_cast<EventRecord*>(start)->time;
    return std::chrono::duration<double, std::milli>(delta).count();
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

// ---- random numbers ----
// TorchNeuron's generator (`csrc/core/NeuronHooksInterface.cpp`): a seed and a Philox offset, 16 bytes
// (seed in bytes 0-8, offset in 8-16), the format DTensor's random ops rewrite. As on TorchNeuron, no
// op draws from it: random ops take the CPU fallback (CPU default generator) and dropout draws its
// mask on the host (see `native_dropout`). It holds what `torch.neuron` seeds and reports.

class NeuronGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(c10::default_rng_seed_val) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override {
    offset_ = offset;
  }
  uint64_t get_offset() const override {
    return offset_;
  }
  uint64_t current_seed() const override {
    return seed_;
  }
  uint64_t seed() override {
    const uint64_t random = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(random);
    return random;
  }
  void set_state(const c10::TensorImpl& state) override {
    const auto size = state.numel();
    TORCH_CHECK(state.dtype() == at::kByte && (size == 16 || size == 8),
                "neuron: an RNG state is a uint8 tensor of 16 bytes (seed, offset), got ", size, " elements of ",
                state.dtype().name());
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    std::memcpy(&seed_, bytes, sizeof(seed_));
    offset_ = 0;
    if (size == 16) {
      std::memcpy(&offset_, bytes + sizeof(seed_), sizeof(offset_));
    }
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    auto* bytes = state.data_ptr<uint8_t>();
    std::memcpy(bytes, &seed_, sizeof(seed_));
    std::memcpy(bytes + sizeof(seed_), &offset_, sizeof(offset_));
    return state.getIntrusivePtr();
  }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    auto* copy = new NeuronGeneratorImpl(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
  uint64_t seed_;
  uint64_t offset_ = 0;
};

std::mutex g_generators_mutex;
std::deque<at::Generator> g_default_generators; // a deque: references stay valid as it grows

} // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  if (index < 0) {
    index = current_device();
  }
  check_device_index(index);
  std::lock_guard<std::mutex> lock(g_generators_mutex);
  while (static_cast<c10::DeviceIndex>(g_default_generators.size()) <= index) {
    const auto next = static_cast<c10::DeviceIndex>(g_default_generators.size());
    g_default_generators.push_back(at::make_generator<NeuronGeneratorImpl>(next));
    g_default_generators.back().set_current_seed(c10::default_rng_seed_val);
  }
  return g_default_generators[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<NeuronGeneratorImpl>(index < 0 ? current_device() : index);
}

namespace {

// ---- hooks ----
struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return device_count() > 0;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device*/) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_current_device(device);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex old = current_device();
    set_current_device(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    return default_generator(device);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device) const override {
    return new_generator(device);
  }
  at::Device getDeviceFromPtr(void* /*data*/) const override {
    return {kNeuron, current_device()};
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "neuron: trying to resize a storage that is not resizable");
    const c10::DeviceGuard guard(impl->device());
    c10::DataPtr fresh = device_allocator()->allocate(nbytes);
    const std::size_t keep = std::min(nbytes, impl->nbytes());
    if (keep > 0) {
      std::memcpy(fresh.get(), impl->data(), keep);
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  }
};

} // namespace

void register_hooks() {
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

} // namespace neuron
