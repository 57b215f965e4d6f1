// Counts of what crosses between host and device: bytes each way, and synchronizations (reads of
// device memory the host waits for: copies to the host and `.item()`). On a Trainium device these
// are DMA transfers and waits; benchmarks report them per generated token.
#include "neuron.h"

#include <atomic>

namespace neuron {
namespace {

std::atomic<int64_t> g_host_to_device_bytes{0};
std::atomic<int64_t> g_device_to_host_bytes{0};
std::atomic<int64_t> g_host_to_device_copies{0};
std::atomic<int64_t> g_synchronizations{0};

} // namespace

void count_host_to_device(std::size_t bytes) {
  g_host_to_device_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  g_host_to_device_copies.fetch_add(1, std::memory_order_relaxed);
}

void count_device_to_host(std::size_t bytes) {
  g_device_to_host_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  g_synchronizations.fetch_add(1, std::memory_order_relaxed);
}

TransferCounts transfer_counts() {
  return {g_host_to_device_bytes.load(), g_device_to_host_bytes.load(), g_host_to_device_copies.load(),
          g_synchronizations.load()};
}

void clear_transfer_counts() {
  g_host_to_device_bytes = 0;
  g_device_to_host_bytes = 0;
  g_host_to_device_copies = 0;
  g_synchronizations = 0;
}

} // namespace neuron
