// torch.ops.cbcore.packed_linear(x, handle): x @ W.T + b for a weight packed once, looked up by an integer handle:
// into the skinny matmul's panels where the CPU runs it for the dtype (csrc/linear/skinny_gemm.cpp: AMX, AVX-512 or
// AVX2), into oneDNN's blocked layout, or both, with calls of more rows than `skinny_max_rows` on oneDNN's copy.
// Which of them a weight gets is the Python side's choice per CPU and dtype (cbcore/linear.py, linear_backends; the
// figures are in bench/results/linear_cpu*.md): on a decode step's few rows the skinny matmul is 1.1-1.7x oneDNN's
// on a Zen 4; on a CPU with AMX, the skinny matmul's AMX tiles run bf16 at 1.2-1.8x oneDNN's up to 32 rows, oneDNN
// past that, and fp32 past a few dozen rows at up to 1.3x.
// A handle rather than the packed tensor (cbcore/linear.py says why: inductor takes no packed oneDNN weight as a
// graph input, so the compiled step passes a handle). A C++ kernel rather than a Python custom op: the dispatcher
// calls it directly, where a Python custom op cost ~35 us a call (a third of a small decode matmul's time).
//
// Each handle holds its source weights (one, or a merge group's siblings, concatenated in order) and biases with the
// version counters they had when packed: a source changed in place (an optimizer step inside pause()) is seen here,
// on the call, and the packed copy is rebuilt. A source replaced by another tensor is not visible from here; the
// Python side registers the handle again when it notices (PackedLinears.refresh).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "linear/packed_linear.h"
#include "linear/skinny_gemm.h"

namespace cbcore {
namespace {

struct PackedLinear {
  std::vector<at::Tensor> weights;  // the sources, [out_i, in] each
  std::vector<at::Tensor> biases;   // [out_i] each, or empty
  std::vector<int64_t> versions;    // of weights then biases, when packed
  bool skinny = false;              // packed for the skinny matmul (csrc/linear/skinny_gemm.cpp)
  int64_t skinny_max_rows = -1;     // with skinny: more rows run oneDNN's copy, packed too (-1: none, all skinny)
  at::Tensor panels;                // cat(weights) in the skinny matmul's panels, when skinny
  at::Tensor packed_weight;         // cat(weights) in oneDNN's layout: unless skinny, or skinny_max_rows >= 0
  std::optional<at::Tensor> packed_bias;
  int64_t in_features = 0;
  int64_t out_features = 0;

  std::vector<int64_t> current_versions() const {
    std::vector<int64_t> now;
    now.reserve(weights.size() + biases.size());
    for (const auto& w : weights) now.push_back(static_cast<int64_t>(w._version()));
    for (const auto& b : biases) now.push_back(static_cast<int64_t>(b._version()));
    return now;
  }

  // Whether a source changed in place since it was packed; checked on every call, so it allocates nothing.
  bool stale() const {
    size_t i = 0;
    for (const auto& w : weights)
      if (static_cast<int64_t>(w._version()) != versions[i++]) return true;
    for (const auto& b : biases)
      if (static_cast<int64_t>(b._version()) != versions[i++]) return true;
    return false;
  }

  void pack() {
    static auto reorder = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                              .typed<at::Tensor(const at::Tensor&, std::optional<c10::SymInt>)>();
    at::NoGradGuard no_grad;
    const at::Tensor weight = weights.size() == 1 ? weights[0].detach() : at::cat(weights).detach();
    panels = skinny ? skinny::pack(weight) : at::Tensor();
    packed_weight = at::Tensor();
    if (!skinny) {
      packed_weight = reorder.call(weight, std::nullopt);  // a dtype oneDNN cannot pack here raises (Python falls back)
    } else if (skinny_max_rows >= 0) {
      // The second copy, for calls of many rows. A dtype oneDNN cannot pack on this CPU (bf16 without AVX-512 or
      // AVX-NE-CONVERT) leaves every call on the skinny matmul.
      try {
        packed_weight = reorder.call(weight, std::nullopt);
      } catch (const c10::Error&) {
      }
    }
    packed_bias = biases.empty() ? std::nullopt
                                 : std::optional<at::Tensor>(biases.size() == 1 ? biases[0].detach()
                                                                                : at::cat(biases).detach());
    versions = current_versions();
  }
};

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<PackedLinear>> registry;

std::shared_ptr<PackedLinear> find(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry.find(handle);
  TORCH_CHECK_VALUE(it != registry.end(), "cbcore.packed_linear: no packed weight has handle ", handle,
                    " (the model's linear layers are not attached to a cbcore engine)");
  return it->second;
}

at::Tensor packed_linear(const at::Tensor& x, int64_t handle) {
  static auto linear = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                             c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                             std::optional<c10::string_view>)>();
  const std::shared_ptr<PackedLinear> entry = find(handle);
  TORCH_CHECK_VALUE(x.size(-1) == entry->in_features, "cbcore.packed_linear: input has ", x.size(-1),
                    " features, the packed weight ", handle, " takes ", entry->in_features);
  if (entry->stale()) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (entry->stale()) entry->pack();
  }
  at::Tensor rows = x.reshape({-1, entry->in_features});
  static const c10::List<std::optional<c10::Scalar>> no_scalars;
  at::Tensor out;
  if (entry->skinny && (rows.size(0) <= entry->skinny_max_rows || !entry->packed_weight.defined())) {
    if (rows.stride(-1) != 1) rows = rows.contiguous();
    out = skinny::matmul(rows, entry->panels, entry->out_features, entry->packed_bias);  // checks x's dtype
  } else {
    out = linear.call(rows, entry->packed_weight, entry->packed_bias, "none", no_scalars, std::nullopt);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = entry->out_features;
  return out.view(shape);
}

void register_packed_linear(int64_t handle, std::vector<at::Tensor> weights, std::vector<at::Tensor> biases,
                            bool skinny, int64_t skinny_max_rows) {
  TORCH_CHECK_VALUE(!weights.empty(), "register_packed_linear: no weight");
  TORCH_CHECK_VALUE(biases.empty() || biases.size() == weights.size(),
                    "register_packed_linear: give a bias for every weight or for none");
  auto entry = std::make_shared<PackedLinear>();
  entry->in_features = weights[0].size(1);
  for (const auto& w : weights) {
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == entry->in_features && w.scalar_type() == weights[0].scalar_type(),
                      "register_packed_linear: the weights must be [out, in] with one in and one dtype");
    entry->out_features += w.size(0);
  }
  entry->skinny = skinny && skinny::available(weights[0].scalar_type());
  entry->skinny_max_rows = skinny_max_rows;
  entry->weights = std::move(weights);
  entry->biases = std::move(biases);
  entry->pack();
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry[handle] = std::move(entry);
}

void drop_packed_linear(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
}

}  // namespace

void register_packed_linear_bindings(pybind11::module_& m) {
  m.def("register_packed_linear", &register_packed_linear, pybind11::arg("handle"), pybind11::arg("weights"),
        pybind11::arg("biases"), pybind11::arg("skinny") = true, pybind11::arg("skinny_max_rows") = -1,
        "Pack cat(weights) (and cat(biases), or no bias) for torch.ops.cbcore.packed_linear under `handle`, "
        "replacing what the handle held: for the skinny matmul where `skinny` and the CPU runs it for the dtype, "
        "else for oneDNN. With the skinny matmul and skinny_max_rows >= 0, oneDNN's copy too (where oneDNN packs "
        "the dtype), for calls of more rows than that. The sources are kept: one changed in place is repacked on "
        "the next call.");
  m.def("packed_linear_is_skinny", [](int64_t handle) { return find(handle)->skinny; }, pybind11::arg("handle"),
        "Whether the packed weight of `handle` runs the skinny matmul (else oneDNN's) for calls of few rows.");
  m.def(
      "packed_linear_onednn_above",
      [](int64_t handle) {
        const auto entry = find(handle);
        if (!entry->packed_weight.defined()) return int64_t{-1};
        return entry->skinny ? entry->skinny_max_rows : int64_t{0};
      },
      pybind11::arg("handle"),
      "Calls of more rows than this run oneDNN's copy of `handle` (0: every call; -1: none, there is no copy).");
  m.def("drop_packed_linear", &drop_packed_linear, pybind11::arg("handle"),
        "Forget the packed weight of `handle` (and release its sources); unknown handles are ignored.");
  m.def("skinny_available", [](at::ScalarType dtype) { return skinny::available(dtype); }, pybind11::arg("dtype"),
        "Whether this CPU runs the skinny matmul (csrc/linear/skinny_gemm.cpp) for weights of `dtype`.");
  m.def("cpu_full_width_avx512", &skinny::full_width_avx512,
        "Whether this CPU runs AVX-512 on two full 512-bit FMA units a core (a Xeon with AMX, AMD's desktop and "
        "server Zen 5), so that oneDNN's matmul beats the skinny matmul on many fp32 rows.");
  m.def("skinny_isa", [](at::ScalarType dtype) { return skinny::isa(dtype); }, pybind11::arg("dtype"),
        "The instruction set the skinny matmul runs for `dtype` now: 'amx' (bf16: AMX's tiles where K is a multiple "
        "of 32, AVX-512's otherwise), 'avx512', 'avx2' or 'none'.");
  m.def("_set_skinny_isa", &skinny::set_isa, pybind11::arg("name"),
        "'avx512': the skinny matmul's AVX-512 tiles even where AMX's would run; 'avx2': AVX2's tiles even where "
        "AVX-512's would; 'auto': the best the CPU has.");
  m.def("skinny_pack", &skinny::pack, pybind11::arg("weight"),
        "The skinny matmul's panels of a [N, K] float32 or bfloat16 weight.");
  m.def("skinny_matmul", &skinny::matmul, pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("out_features"),
        pybind11::arg("bias") = std::nullopt,
        "x [M, K] @ W.T (+ bias) with panels = skinny_pack(W), W [out_features, K].");
}

}  // namespace cbcore

TORCH_LIBRARY_FRAGMENT(cbcore, m) {
  m.def("packed_linear(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(cbcore, CPU, m) {
  m.impl("packed_linear", &cbcore::packed_linear);
}
