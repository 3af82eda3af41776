// SwapPool and the dispatcher op cbcore::copy_blocks (CPU kernel and device-generic fallback). See swap.h.
#include "swap/swap.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace cbcore {
namespace {

// ---- cbcore::copy_blocks ---------------------------------------------------------------------------------------

void check_copy_args(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  TORCH_CHECK(src.size() == dst.size(), "copy_blocks: ", src.size(), " source tensors but ", dst.size(),
              " destination tensors");
  TORCH_CHECK(src_ids.dim() == 1 && dst_ids.dim() == 1 && src_ids.size(0) == dst_ids.size(0),
              "copy_blocks: src_block_ids and dst_block_ids must be 1-D of one length, got shapes ", src_ids.sizes(),
              " and ", dst_ids.sizes());
  TORCH_CHECK(src_ids.scalar_type() == at::kLong && dst_ids.scalar_type() == at::kLong,
              "copy_blocks: block ids must be int64");
  for (size_t t = 0; t < src.size(); ++t) {
    TORCH_CHECK(src[t].is_contiguous() && dst[t].is_contiguous(), "copy_blocks: tensor pair ", t,
                " is not contiguous");
    TORCH_CHECK(src[t].dim() >= 1 && dst[t].dim() >= 1 && src[t].sizes().slice(1) == dst[t].sizes().slice(1) &&
                    src[t].scalar_type() == dst[t].scalar_type(),
                "copy_blocks: tensor pair ", t, " has different block shapes or dtypes: ", src[t].sizes(), " ",
                src[t].scalar_type(), " and ", dst[t].sizes(), " ", dst[t].scalar_type());
  }
}

// CPU: every (tensor, block pair) is one memcpy, spread over the intra-op threads.
void copy_blocks_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  check_copy_args(src, dst, src_ids, dst_ids);
  const int64_t pairs = src_ids.size(0);
  const int64_t tensors = static_cast<int64_t>(src.size());
  if (pairs == 0 || tensors == 0) return;
  const at::Tensor s_ids = src_ids.contiguous();
  const at::Tensor d_ids = dst_ids.contiguous();
  const int64_t* s = s_ids.data_ptr<int64_t>();
  const int64_t* d = d_ids.data_ptr<int64_t>();
  std::vector<const char*> src_ptrs(tensors);
  std::vector<char*> dst_ptrs(tensors);
  std::vector<int64_t> block_bytes(tensors);
  for (int64_t t = 0; t < tensors; ++t) {
    TORCH_CHECK(src[t].is_cpu() && dst[t].is_cpu(), "copy_blocks (CPU kernel): tensor pair ", t, " is not on the CPU");
    src_ptrs[t] = static_cast<const char*>(src[t].data_ptr());
    dst_ptrs[t] = static_cast<char*>(dst[t].data_ptr());
    block_bytes[t] = src[t].size(0) == 0 ? 0 : src[t].nbytes() / src[t].size(0);
  }
  const int64_t items = tensors * pairs;
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(1, block_bytes[0]));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / pairs;
      const int64_t i = item % pairs;
      std::memcpy(dst_ptrs[t] + d[i] * block_bytes[t], src_ptrs[t] + s[i] * block_bytes[t], block_bytes[t]);
    }
  });
}

// Any device, with ATen ops only: per tensor, gather the source blocks, move them to the destination's device, and
// scatter them. Correct everywhere, but several launches per layer; the CUDA kernel in cbcore._cuda replaces it.
void copy_blocks_generic(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids,
                         const at::Tensor& dst_ids) {
  check_copy_args(src, dst, src_ids, dst_ids);
  if (src_ids.size(0) == 0) return;
  for (size_t t = 0; t < src.size(); ++t) {
    const at::Tensor blocks = src[t].index_select(0, src_ids.to(src[t].device()));
    at::Tensor target = dst[t];
    target.index_copy_(0, dst_ids.to(dst[t].device()), blocks.to(dst[t].device(), /*non_blocking=*/false));
  }
}

void call_copy_blocks(at::TensorList src, at::TensorList dst, const at::Tensor& src_ids, const at::Tensor& dst_ids) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cbcore::copy_blocks", "")
                             .typed<void(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&)>();
  op.call(src, dst, src_ids, dst_ids);
}

// ---- SwapPool ------------------------------------------------------------------------------------------------------

// Block ids as a contiguous int64 CPU tensor, from a tensor or a Python list of ints.
at::Tensor ids_tensor(const py::object& ids, const char* what, const char* name) {
  at::Tensor t;
  if (THPVariable_Check(ids.ptr())) {
    t = THPVariable_Unpack(ids.ptr());
  } else {
    std::vector<int64_t> values;
    try {
      values = ids.cast<std::vector<int64_t>>();
    } catch (const py::cast_error&) {
      throw py::type_error(std::string(what) + ": " + name +
                           " must be a 1-D integer tensor or a list of ints, got " +
                           py::str(py::type::of(ids)).cast<std::string>());
    }
    t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
    std::copy(values.begin(), values.end(), t.data_ptr<int64_t>());
  }
  TORCH_CHECK_TYPE(!t.is_floating_point() && !t.is_complex() && t.scalar_type() != at::kBool, what, ": ", name,
                   " must hold integers, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, what, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_cpu(), what, ": ", name, " must be on the CPU (they are checked before any copy), got ",
                    t.device());
  return t.to(at::kLong).contiguous();
}

class SwapPool {
 public:
  SwapPool(int64_t num_layers, int64_t num_host_blocks, int64_t page_size, int64_t num_kv_heads, int64_t head_dim,
           at::ScalarType dtype, std::optional<bool> pin)
      : num_layers_(num_layers), num_host_blocks_(num_host_blocks) {
    TORCH_CHECK_VALUE(num_layers >= 1, "SwapPool: num_layers must be >= 1, got ", num_layers);
    TORCH_CHECK_VALUE(num_host_blocks >= 1, "SwapPool: num_host_blocks must be >= 1, got ", num_host_blocks);
    TORCH_CHECK_VALUE(page_size >= 1 && num_kv_heads >= 1 && head_dim >= 1,
                      "SwapPool: page_size, num_kv_heads and head_dim must be >= 1, got ", page_size, ", ",
                      num_kv_heads, ", ", head_dim);
    block_shape_ = {page_size, num_kv_heads, head_dim};
    // Pinned memory needs a CUDA runtime with a device; without one the pool is plain memory (pin=None), or the
    // caller asked for something impossible (pin=True).
    const bool can_pin = at::globalContext().hasCUDA();
    TORCH_CHECK_VALUE(!(pin.has_value() && *pin && !can_pin),
                      "SwapPool: pin=True needs a CUDA device, and none is available; pass pin=None or False");
    pinned_ = pin.value_or(can_pin) && can_pin;
    // One allocation: K of every layer, then V of every layer.
    storage_ = at::zeros({2 * num_layers, num_host_blocks, page_size, num_kv_heads, head_dim},
                         at::TensorOptions().dtype(dtype).pinned_memory(pinned_));
  }

  int64_t num_layers() const { return num_layers_; }
  int64_t num_host_blocks() const { return num_host_blocks_; }
  std::vector<int64_t> block_shape() const { return block_shape_; }
  at::ScalarType dtype() const { return storage_.scalar_type(); }
  bool pinned() const { return pinned_; }
  int64_t nbytes() const { return storage_.nbytes(); }
  at::Tensor key(int64_t layer) const { return storage_[check_layer(layer)]; }
  at::Tensor value(int64_t layer) const { return storage_[num_layers_ + check_layer(layer)]; }

  void swap_out(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
                const py::object& device_block_ids, const py::object& host_block_ids) {
    const at::Tensor device_ids = ids_tensor(device_block_ids, "swap_out", "device_block_ids");
    const at::Tensor host_ids = ids_tensor(host_block_ids, "swap_out", "host_block_ids");
    py::gil_scoped_release no_gil;
    const int64_t device_blocks = check_caches(key_caches, value_caches, "swap_out");
    check_ids(device_ids, host_ids, "device_block_ids", "host_block_ids", device_blocks, num_host_blocks_, "swap_out");
    copy(device_caches(key_caches, value_caches), host_tensors(), device_ids, host_ids, key_caches[0].device());
  }

  void swap_in(const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
               const py::object& host_block_ids, const py::object& device_block_ids) {
    const at::Tensor host_ids = ids_tensor(host_block_ids, "swap_in", "host_block_ids");
    const at::Tensor device_ids = ids_tensor(device_block_ids, "swap_in", "device_block_ids");
    py::gil_scoped_release no_gil;
    const int64_t device_blocks = check_caches(key_caches, value_caches, "swap_in");
    check_ids(host_ids, device_ids, "host_block_ids", "device_block_ids", num_host_blocks_, device_blocks, "swap_in");
    copy(host_tensors(), device_caches(key_caches, value_caches), host_ids, device_ids, key_caches[0].device());
  }

  // The current stream of the copies' device waits for every copy issued so far (the host does not wait).
  void wait_on_current_stream() {
    if (!last_copy_) return;
    const c10::impl::VirtualGuardImpl impl(last_copy_->device_type());
    last_copy_->block(impl.getStream(last_copy_->device()));
  }

  // The host waits for every copy issued so far.
  void synchronize() {
    if (last_copy_) last_copy_->synchronize();
  }

  // Whether every copy issued so far has finished.
  bool query() const { return !last_copy_ || last_copy_->query(); }

  std::string repr() const {
    return "SwapPool(num_layers=" + std::to_string(num_layers_) + ", num_host_blocks=" +
           std::to_string(num_host_blocks_) + ", block_shape=(" + std::to_string(block_shape_[0]) + ", " +
           std::to_string(block_shape_[1]) + ", " + std::to_string(block_shape_[2]) + "), dtype=" +
           std::string(c10::toString(dtype())) + ", pinned=" + (pinned_ ? "True" : "False") + ")";
  }

 private:
  int64_t check_layer(int64_t layer) const {
    TORCH_CHECK_INDEX(layer >= 0 && layer < num_layers_, "SwapPool: layer ", layer, " out of range for ",
                      num_layers_, " layers");
    return layer;
  }

  std::vector<at::Tensor> host_tensors() const {
    std::vector<at::Tensor> out;
    out.reserve(2 * num_layers_);
    for (int64_t i = 0; i < 2 * num_layers_; ++i) out.push_back(storage_[i]);
    return out;
  }

  static std::vector<at::Tensor> device_caches(const std::vector<at::Tensor>& keys,
                                               const std::vector<at::Tensor>& values) {
    std::vector<at::Tensor> out(keys);
    out.insert(out.end(), values.begin(), values.end());
    return out;
  }

  // Every cache must look like the pool's blocks; returns the smallest block count among them.
  int64_t check_caches(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       const char* what) const {
    TORCH_CHECK_VALUE(static_cast<int64_t>(keys.size()) == num_layers_ &&
                          static_cast<int64_t>(values.size()) == num_layers_,
                      what, ": the pool has ", num_layers_, " layers but got ", keys.size(), " key caches and ",
                      values.size(), " value caches");
    const at::Device device = keys[0].device();
    int64_t blocks = keys[0].dim() > 0 ? keys[0].size(0) : 0;
    for (int64_t l = 0; l < num_layers_; ++l) {
      for (const auto* kv : {&keys[l], &values[l]}) {
        const char* kind = kv == &keys[l] ? "key" : "value";
        const at::Tensor& t = *kv;
        TORCH_CHECK_VALUE(t.dim() == 4 && t.sizes().slice(1) == c10::IntArrayRef(block_shape_), what, ": ", kind,
                          " cache of layer ", l, " has shape ", t.sizes(),
                          " but the pool's blocks are [num_blocks, ", block_shape_[0], ", ", block_shape_[1], ", ",
                          block_shape_[2], "]");
        TORCH_CHECK_TYPE(t.scalar_type() == dtype(), what, ": ", kind, " cache of layer ", l, " is ",
                         t.scalar_type(), " but the pool holds ", dtype());
        TORCH_CHECK_VALUE(t.is_contiguous(), what, ": ", kind, " cache of layer ", l, " is not contiguous");
        TORCH_CHECK_VALUE(t.device() == device, what, ": ", kind, " cache of layer ", l, " is on ", t.device(),
                          " but layer 0's key cache is on ", device, "; all caches must share one device");
        blocks = std::min(blocks, t.size(0));
      }
    }
    return blocks;
  }

  static void check_ids(const at::Tensor& src_ids, const at::Tensor& dst_ids, const char* src_name,
                        const char* dst_name, int64_t src_limit, int64_t dst_limit, const char* what) {
    TORCH_CHECK_VALUE(src_ids.size(0) == dst_ids.size(0), what, ": ", src_name, " has ", src_ids.size(0), " ids but ",
                      dst_name, " has ", dst_ids.size(0), "; they pair up one to one");
    const int64_t* s = src_ids.data_ptr<int64_t>();
    const int64_t* d = dst_ids.data_ptr<int64_t>();
    std::unordered_map<int64_t, int64_t> seen;
    for (int64_t i = 0; i < src_ids.size(0); ++i) {
      TORCH_CHECK_INDEX(s[i] >= 0 && s[i] < src_limit, what, ": ", src_name, "[", i, "] = ", s[i],
                        " is out of range [0, ", src_limit, ")");
      TORCH_CHECK_INDEX(d[i] >= 0 && d[i] < dst_limit, what, ": ", dst_name, "[", i, "] = ", d[i],
                        " is out of range [0, ", dst_limit, ")");
      const auto [it, fresh] = seen.emplace(d[i], i);
      TORCH_CHECK_VALUE(fresh, what, ": block ", d[i], " appears twice in ", dst_name, " (positions ", it->second,
                        " and ", i, "); a destination block can be written once per call");
    }
  }

  void copy(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, const at::Tensor& src_ids,
            const at::Tensor& dst_ids, const at::Device& device) {
    if (src_ids.size(0) == 0) return;
    if (device.is_cpu()) {
      call_copy_blocks(src, dst, src_ids, dst_ids);
      return;
    }
    // Device caches: after the work already queued on the current stream (it may still be writing these blocks),
    // on a side stream, without blocking the host.
    const c10::impl::VirtualGuardImpl impl(device.type());
    const c10::DeviceGuard device_guard(device);
    if (!side_stream_ || side_stream_->device() != device) side_stream_ = impl.getStreamFromGlobalPool(device);
    c10::Event ready(device.type());
    ready.record(impl.getStream(device));
    ready.block(*side_stream_);
    {
      const c10::StreamGuard stream_guard(*side_stream_);
      // Allocated while the side stream is current: the caching allocator keeps them until that stream is done.
      const bool pin = device.is_cuda();
      const at::Tensor s = (pin ? src_ids.pin_memory() : src_ids).to(device, /*non_blocking=*/pin);
      const at::Tensor d = (pin ? dst_ids.pin_memory() : dst_ids).to(device, /*non_blocking=*/pin);
      call_copy_blocks(src, dst, s, d);
    }
    c10::Event done(device.type());
    done.record(*side_stream_);
    last_copy_.emplace(std::move(done));
  }

  int64_t num_layers_;
  int64_t num_host_blocks_;
  std::vector<int64_t> block_shape_;
  bool pinned_ = false;
  at::Tensor storage_;  // [2 * num_layers, num_host_blocks, page_size, num_kv_heads, head_dim]
  std::optional<c10::Stream> side_stream_;
  std::optional<c10::Event> last_copy_;
};

}  // namespace

void register_swap_bindings(py::module_& m) {
  py::class_<SwapPool>(m, "SwapPool", R"doc(
A pool of host KV blocks for swapping preempted requests out of the device cache (see csrc/swap/swap.h).

Holds K and V of every layer as [num_host_blocks, page_size, num_kv_heads, head_dim] host tensors (pinned when a
CUDA device is available and pin is not False). swap_out/swap_in copy many blocks of every layer in one call. On CPU
the copy is done when the call returns; on CUDA it runs on a side stream after the work already queued, and the
caller orders later work with wait_on_current_stream() or synchronize(). Block ids are CPU integer tensors or lists;
out-of-range ids, mismatched lengths and a destination block named twice raise before anything is copied.
Not thread-safe: use it from one thread (the engine's loop).
)doc")
      .def(py::init([](int64_t num_layers, int64_t num_host_blocks, int64_t page_size, int64_t num_kv_heads,
                       int64_t head_dim, at::ScalarType dtype, std::optional<bool> pin) {
             // The CUDA kernel of copy_blocks registers itself when cbcore._cuda loads; load it now (when it was
             // built) so that a pool never falls back to the generic copies just because no CUDA op ran yet.
             if (at::globalContext().hasCUDA()) {
               try {
                 py::module_::import("cbcore._cuda");
               } catch (const py::error_already_set&) {
               }
             }
             return std::make_unique<SwapPool>(num_layers, num_host_blocks, page_size, num_kv_heads, head_dim, dtype,
                                               pin);
           }),
           py::arg("num_layers"), py::arg("num_host_blocks"), py::arg("page_size"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("dtype"), py::arg("pin") = py::none(),
           "A zeroed pool. pin=None pins when a CUDA device is available; pin=True requires one.")
      .def("swap_out", &SwapPool::swap_out, py::arg("key_caches"), py::arg("value_caches"),
           py::arg("device_block_ids"), py::arg("host_block_ids"),
           "Copies device block device_block_ids[i] of every layer's K and V to host block host_block_ids[i].")
      .def("swap_in", &SwapPool::swap_in, py::arg("key_caches"), py::arg("value_caches"), py::arg("host_block_ids"),
           py::arg("device_block_ids"),
           "Copies host block host_block_ids[i] of every layer's K and V to device block device_block_ids[i].")
      .def("wait_on_current_stream", &SwapPool::wait_on_current_stream, py::call_guard<py::gil_scoped_release>(),
           "Makes the current stream wait for every copy issued so far (no-op for CPU caches).")
      .def("synchronize", &SwapPool::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Blocks until every copy issued so far has finished (no-op for CPU caches).")
      .def("query", &SwapPool::query, "True when every copy issued so far has finished.")
      .def("key", &SwapPool::key, py::arg("layer"), "The host K blocks of a layer (a view of the pool).")
      .def("value", &SwapPool::value, py::arg("layer"), "The host V blocks of a layer (a view of the pool).")
      .def_property_readonly("num_layers", &SwapPool::num_layers)
      .def_property_readonly("num_host_blocks", &SwapPool::num_host_blocks)
      .def_property_readonly("block_shape", &SwapPool::block_shape, "(page_size, num_kv_heads, head_dim)")
      .def_property_readonly("dtype", &SwapPool::dtype)
      .def_property_readonly("pinned", &SwapPool::pinned, "Whether the host blocks are in pinned memory.")
      .def_property_readonly("nbytes", &SwapPool::nbytes, "Bytes held by the pool (K and V of every layer).")
      .def("__repr__", &SwapPool::repr);
}

}  // namespace cbcore

// The op is defined here, in the module every install has; cbcore._cuda adds its CUDA kernel when it is loaded.
TORCH_LIBRARY_FRAGMENT(cbcore, m) {
  m.def("copy_blocks(Tensor[] src, Tensor(a!)[] dst, Tensor src_block_ids, Tensor dst_block_ids) -> ()");
}

TORCH_LIBRARY_IMPL(cbcore, CPU, m) { m.impl("copy_blocks", &cbcore::copy_blocks_cpu); }

TORCH_LIBRARY_IMPL(cbcore, CompositeExplicitAutograd, m) { m.impl("copy_blocks", &cbcore::copy_blocks_generic); }
