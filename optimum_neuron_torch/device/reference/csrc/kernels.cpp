// Explicit kernels: memory and metadata ops that cannot go through the generic fallback, plus
// the entry points PyTorch routes only to accelerators (fused attention, RNN cells).
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/copy_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace neuron {
namespace {

// ---- memory, views and copies ----

at::Tensor empty_memory_format(
    c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
    std::optional<c10::Device> device, std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron: only strided tensors are supported (TorchNeuron has no sparse tensors)");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "neuron: only CPU memory can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout, std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron: only strided tensors are supported (TorchNeuron has no sparse tensors)");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "neuron: only CPU memory can be pinned");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, c10::SymInt offset,
                               c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::cpu::set__symint(self, std::move(source), std::move(offset), size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return at::cpu::set_(self, std::move(empty), 0, {0}, {});
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool source_on_device = self.device().type() == kNeuron;
  if (source_on_device != (dst.device().type() == kNeuron)) {
    const std::size_t bytes = static_cast<std::size_t>(dst.numel()) * dst.element_size();
    source_on_device ? count_device_to_host(bytes) : count_host_to_device(bytes);
  }
  at::Tensor host_dst = host_view(dst);
  at::native::copy_(host_dst, host_view(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  count_device_to_host(self.element_size());
  return at::native::_local_scalar_dense_cpu(host_view(self));
}

// ---- dropout ----
// As TorchNeuron's (`python_ops/torch_mlir/ops/dropout.py`, `python_ops/jax/ops/native_dropout.py`): the mask
// is drawn on the host from the CPU default generator, `bernoulli` of a bool tensor with the keep
// probability, and the output is input * mask * (1 / keep). So the same seed gives the same masks on
// Trn, and `torch.manual_seed` (not `torch.neuron.manual_seed`) is what makes dropout repeat.

std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  track_explicit("aten::native_dropout");
  const c10::DeviceIndex device = input.device().index();
  at::Tensor host = host_view(input);
  const bool training = train.value_or(true);
  TORCH_CHECK(!training || (p >= 0.0 && p <= 1.0), "dropout probability has to be between 0 and 1, but got ", p);
  at::Tensor mask;
  double scale = 1.0;
  if (!training || p == 0.0) {
    mask = at::ones(host.sizes(), host.options().dtype(at::kBool));
  } else if (p == 1.0) {
    mask = at::zeros(host.sizes(), host.options().dtype(at::kBool));
    scale = 0.0;
  } else {
    const double keep = 1.0 - p;
    mask = at::bernoulli(at::empty(host.sizes(), host.options().dtype(at::kBool)), keep);
    scale = 1.0 / keep;
  }
  at::Tensor output = host.mul(mask.to(host.scalar_type())).mul_(scale);
  return {to_device(output, device), to_device(mask, device)};
}

// ---- fused attention ----
// The overrideable SDPA backend is the one TorchNeuron implements; it runs the CPU flash kernel.

// Metadata only (it also runs under fake tensors while torch.compile traces): the conditions of
// the CPU flash kernel that the overrideable backend runs; anything else takes the math path.
int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p, bool /*is_causal*/,
                         std::optional<double> /*scale*/, bool /*enable_gqa*/) {
  const auto dtype = query.scalar_type();
  const bool supported_dtype = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf;
  bool flash = dropout_p == 0.0 && supported_dtype && query.dim() == 4 && key.dim() == 4 && value.dim() == 4 &&
      key.scalar_type() == dtype && value.scalar_type() == dtype && !query.is_nested() &&
      query.sym_size(-1) == key.sym_size(-1) && query.sym_size(-1) == value.sym_size(-1) &&
      key.sym_size(1) == value.sym_size(1) && query.sym_size(1) % key.sym_size(1) == 0 &&
      query.sym_stride(-1) == 1 && key.sym_stride(-1) == 1 && value.sym_stride(-1) == 1;
  if (attn_mask.has_value() && attn_mask->defined()) {
    flash = flash && (attn_mask->scalar_type() == at::kBool || attn_mask->scalar_type() == dtype);
  }
  return static_cast<int64_t>(flash ? at::SDPBackend::overrideable : at::SDPBackend::math);
}

// The layout the meta function gives the attention output: that of the query (`empty_like`).
// Compiled graphs assert it, so the kernel's output is relaid out when the CPU kernel's differs.
at::Tensor laid_out_like(const at::Tensor& output, const at::Tensor& query) {
  const bool same = query.is_non_overlapping_and_dense() ? output.strides() == query.strides() : output.is_contiguous();
  return same ? output : at::empty_like(query).copy_(output);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt, c10::SymInt, at::Tensor, at::Tensor, at::Tensor>
fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                const std::optional<at::Tensor>& attn_bias, double dropout_p, bool is_causal,
                bool /*return_debug_mask*/, std::optional<double> scale) {
  track_explicit("aten::_scaled_dot_product_fused_attention_overrideable");
  // As the meta function: no cumulative sequence lengths or debug mask, 0-dim seed and offset.
  const auto scalar = [&] { return at::zeros({}, query.options().dtype(at::kLong)); };
  if (is_decode_attention(query, key, value, attn_bias, dropout_p, is_causal)) {
    auto [output, logsumexp] = decode_attention(query, key, value, attn_bias, scale);
    return {output, logsumexp, at::Tensor(), at::Tensor(), query.sym_size(2), key.sym_size(2), scalar(), scalar(),
            at::Tensor()};
  }
  const c10::DeviceIndex device = query.device().index();
  std::optional<at::Tensor> bias;
  if (attn_bias.has_value()) {
    bias = host_view(*attn_bias);
  }
  const at::Tensor host_query = host_view(query);
  auto [output, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
      host_query, host_view(key), host_view(value), dropout_p, is_causal, bias, scale);
  return {to_device(laid_out_like(output, host_query), device), to_device(logsumexp.contiguous(), device), at::Tensor(),
          at::Tensor(), query.sym_size(2), key.sym_size(2), scalar(), scalar(), at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& attn_bias, std::array<bool, 4> grad_input_mask, const at::Tensor& out,
    const at::Tensor& logsumexp, const at::Tensor& /*cum_seq_q*/, const at::Tensor& /*cum_seq_k*/,
    c10::SymInt /*max_q*/, c10::SymInt /*max_k*/, double dropout_p, bool is_causal,
    const at::Tensor& /*philox_seed*/, const at::Tensor& /*philox_offset*/, std::optional<double> scale) {
  track_explicit("aten::_scaled_dot_product_fused_attention_overrideable_backward");
  const c10::DeviceIndex device = query.device().index();
  std::optional<at::Tensor> mask;
  if (attn_bias.defined()) {
    mask = host_view(attn_bias);
  }
  auto [grad_q, grad_k, grad_v] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      host_view(grad_out), host_view(query), host_view(key), host_view(value), host_view(out),
      host_view(logsumexp), dropout_p, is_causal, mask, scale);
  at::Tensor grad_bias;
  TORCH_CHECK(!(grad_input_mask[3] && attn_bias.defined() && attn_bias.requires_grad()),
              "neuron: the gradient of an attention bias is not supported by the fused attention kernel");
  // Laid out as the meta function gives them (`empty_like` of query, key and value): compiled
  // backward graphs assert these strides.
  return {to_device(laid_out_like(grad_q, host_view(query)), device),
          to_device(laid_out_like(grad_k, host_view(key)), device),
          to_device(laid_out_like(grad_v, host_view(value)), device), grad_bias};
}

// ---- fused RNN cells (PyTorch routes accelerator tensors to them; CPU has no kernel) ----
// Gate order and workspaces follow PyTorch's CUDA kernels.

at::Tensor gates_with_bias(const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                           const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  at::Tensor gates = input_gates + hidden_gates;
  if (input_bias.has_value() && input_bias->defined()) {
    gates = gates + host_view(*input_bias) + host_view(*hidden_bias);
  }
  return gates;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  track_explicit("aten::_thnn_fused_lstm_cell");
  const c10::DeviceIndex device = input_gates.device().index();
  auto chunks = gates_with_bias(host_view(input_gates), host_view(hidden_gates), input_bias, hidden_bias).chunk(4, 1);
  at::Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid(), g = chunks[2].tanh(), o = chunks[3].sigmoid();
  at::Tensor cy = f * host_view(cx) + i * g;
  at::Tensor hy = o * cy.tanh();
  at::Tensor workspace = at::cat({i, f, g, o}, 1);
  return {to_device(hy, device), to_device(cy, device), to_device(workspace, device)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy, const at::Tensor& cx,
    const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  track_explicit("aten::_thnn_fused_lstm_cell_backward_impl");
  const c10::DeviceIndex device = cx.device().index();
  auto gates = host_view(workspace).chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  at::Tensor tanh_cy = host_view(cy).tanh();
  at::Tensor d_cy = at::zeros_like(tanh_cy);
  at::Tensor d_o = at::zeros_like(tanh_cy);
  if (grad_cy.has_value() && grad_cy->defined()) {
    d_cy = d_cy + host_view(*grad_cy);
  }
  if (grad_hy.has_value() && grad_hy->defined()) {
    at::Tensor ghy = host_view(*grad_hy);
    d_o = ghy * tanh_cy;
    d_cy = d_cy + ghy * o * (1 - tanh_cy * tanh_cy);
  }
  at::Tensor grad_gates = at::cat({d_cy * g * i * (1 - i), d_cy * host_view(cx) * f * (1 - f),
                                   d_cy * i * (1 - g * g), d_o * o * (1 - o)}, 1);
  at::Tensor grad_cx = d_cy * f;
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return {to_device(grad_gates, device), to_device(grad_cx, device), to_device(grad_bias, device)};
}

std::tuple<at::Tensor, at::Tensor> gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  track_explicit("aten::_thnn_fused_gru_cell");
  const c10::DeviceIndex device = input_gates.device().index();
  at::Tensor ig = host_view(input_gates), hg = host_view(hidden_gates), h = host_view(hx);
  if (input_bias.has_value() && input_bias->defined()) {
    ig = ig + host_view(*input_bias);
    hg = hg + host_view(*hidden_bias);
  }
  auto i = ig.chunk(3, 1);
  auto hc = hg.chunk(3, 1);
  at::Tensor r = (i[0] + hc[0]).sigmoid();
  at::Tensor z = (i[1] + hc[1]).sigmoid();
  at::Tensor n = (i[2] + r * hc[2]).tanh();
  at::Tensor hy = n + z * (h - n);
  at::Tensor workspace = at::cat({r, z, n, h, hc[2]}, 1);
  return {to_device(hy, device), to_device(workspace, device)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  track_explicit("aten::_thnn_fused_gru_cell_backward");
  const c10::DeviceIndex device = grad_hy.device().index();
  auto w = host_view(workspace).chunk(5, 1);
  const at::Tensor &r = w[0], &z = w[1], &n = w[2], &h = w[3], &hn = w[4];
  at::Tensor ghy = host_view(grad_hy);
  at::Tensor d_n = ghy * (1 - z) * (1 - n * n);
  at::Tensor d_z = ghy * (h - n) * z * (1 - z);
  at::Tensor d_r = d_n * hn * r * (1 - r);
  at::Tensor grad_input_gates = at::cat({d_r, d_z, d_n}, 1);
  at::Tensor grad_hidden_gates = at::cat({d_r, d_z, d_n * r}, 1);
  at::Tensor grad_hx = ghy * z;
  at::Tensor grad_input_bias = has_bias ? grad_input_gates.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden_gates.sum(0) : at::Tensor();
  return {to_device(grad_input_gates, device), to_device(grad_hidden_gates, device), to_device(grad_hx, device),
          to_device(grad_input_bias, device), to_device(grad_hidden_bias, device)};
}

} // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("resize_", resize_);
  m.impl("set_", set_empty);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_scaled_dot_product_fused_attention_overrideable", fused_attention);
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward", fused_attention_backward);
  m.impl("native_dropout", native_dropout);
  m.impl("_thnn_fused_lstm_cell", lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", gru_cell_backward);
}

// A conjugated or negated source must reach `_copy_from` as it is: copy_ resolves the bits.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
}

} // namespace neuron

// SDPA asks this stub which backend runs attention on the device.
namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &neuron::fused_sdp_choice)
} // namespace at::native
