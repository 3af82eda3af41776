// One layer's step attention on the CPU in C++: the CPU kernel of torch.ops.cbcore.step_attention.
//
// Why: the compiled step calls the op once per layer per step, and its Python body (the op's dispatch into Python,
// the step lookup, the views, the checks and conversions of cbcore.ops, two kernel calls through pybind11) cost tens
// of microseconds a layer, a visible share of a small decode step (docs/performance_log.md, 2026-12-05, "the step
// attention in C++"). Here the op runs the same two kernels (cache_write, then the planned decode and prefill) from
// C++, reading the step's batch layout from a thread-local context that cbcore.attention.paged_step sets once per
// step (`enter_cpu_step`) instead of from Python.
//
// What it does not take it hands to the op's Python implementation (cbcore/attention.py), which gives the same
// results and the errors users see: no context on this thread (a step of another kernel mode, or outside a step),
// dtypes or head dims the kernels do not take, a soft-cap that is not a positive finite number, sinks that are not
// one floating-point logit per query head. While the step is compiled ahead (`enter_warmup_step`) each layer answers
// zeros, as cbcore.attention.WarmupStep does.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "attention/cpu_attention.h"
#include "attention/cpu_attention_bindings.h"

namespace py = pybind11;

namespace cbcore {
namespace {

// One step's batch layout, as cbcore.attention.StepMetadata holds it, and the kernels' plans made by its first
// layer (one per window and head shape, as cbcore.ops.StepKernelPlans keeps them).
struct CpuStep {
  bool active = false;
  bool warmup = false;
  std::vector<at::Tensor> key_caches, value_caches;
  at::Tensor slot_mapping;
  int64_t num_decode_tokens = 0;
  at::Tensor decode_block_table, decode_seq_lens;
  int64_t num_prefill_requests = 0;
  at::Tensor prefill_block_table, prefill_cu_seqlens_q, prefill_seq_lens_k;
  bool cascade = true;  // the decode plans group requests that share leading blocks (cpu::plan_decode)
  std::vector<std::tuple<int64_t, int64_t, int64_t, cpu::DecodePlan>> decode_plans;  // window, heads, kv heads
  std::vector<std::tuple<int64_t, int64_t, int64_t, cpu::PrefillPlan>> prefill_plans;

  const cpu::DecodePlan& decode_plan(int64_t window, int64_t heads, const at::Tensor& k_cache) {
    const int64_t kv_heads = k_cache.size(2);
    for (const auto& [w, h, kv, plan] : decode_plans)
      if (w == window && h == heads && kv == kv_heads) return plan;
    decode_plans.emplace_back(window, heads, kv_heads,
                              cpu::plan_decode(decode_block_table, decode_seq_lens, k_cache.size(0), k_cache.size(1),
                                               kv_heads, heads, window, cascade));
    return std::get<3>(decode_plans.back());
  }

  const cpu::PrefillPlan& prefill_plan(int64_t window, int64_t heads, const at::Tensor& k_cache) {
    const int64_t kv_heads = k_cache.size(2);
    for (const auto& [w, h, kv, plan] : prefill_plans)
      if (w == window && h == heads && kv == kv_heads) return plan;
    prefill_plans.emplace_back(window, heads, kv_heads,
                               cpu::plan_prefill(prefill_block_table, prefill_cu_seqlens_q, prefill_seq_lens_k,
                                                 k_cache.size(0), k_cache.size(1), kv_heads, heads, window));
    return std::get<3>(prefill_plans.back());
  }
};

// Per thread: the manager's loop thread steps one engine; a test's thread may step another meanwhile.
thread_local CpuStep current_step;

// The op's Python implementation, handed over by cbcore/attention.py; never freed (it lives as long as the
// process's interpreter, and a destructor at exit would run after the interpreter is gone).
py::object* python_step_attention = nullptr;

// Layers this kernel ran itself, over the process's life (tests check that a compiled step's layers come here).
std::atomic<int64_t> layers_run{0};

bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

at::Tensor rows(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

at::Tensor python_fallback(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t layer,
                           double scale, std::optional<int64_t> window, std::optional<double> softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(python_step_attention != nullptr,
              "cbcore::step_attention: its Python implementation is not registered (import cbcore.attention first)");
  py::gil_scoped_acquire gil;
  py::object result = (*python_step_attention)(query, key, value, layer, scale, window, softcap, sinks);
  return result.cast<at::Tensor>();
}

at::Tensor step_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              int64_t layer, double scale, std::optional<int64_t> sliding_window,
                              std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  CpuStep& step = current_step;
  if (step.warmup) return at::zeros({1, query.size(2), query.size(1), value.size(-1)}, query.options());
  const int64_t heads = query.size(1);
  const bool takes_cap = !softcap.has_value() || (*softcap > 0.0 && std::isfinite(*softcap));
  const bool takes_sinks =
      !sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == heads && sinks->is_floating_point());
  if (!step.active || layer < 0 || layer >= static_cast<int64_t>(step.key_caches.size()) || !takes_cap ||
      !takes_sinks || query.dim() != 4 || key.dim() != 4 || value.dim() != 4) {
    return python_fallback(query, key, value, layer, scale, sliding_window, softcap, sinks);
  }
  const at::Tensor& k_cache = step.key_caches[layer];
  const at::Tensor& v_cache = step.value_caches[layer];
  // What cbcore.ops checks before it takes the C++ kernels (_why_not_cpu, _why_not_cpu_cache_write); the caches'
  // contiguity and device were checked when the step was entered.
  const auto dtype = k_cache.scalar_type();
  if (!kernel_dtype(dtype) || v_cache.scalar_type() != dtype || query.scalar_type() != dtype ||
      !kernel_dtype(key.scalar_type()) || !kernel_dtype(value.scalar_type()) || k_cache.size(-1) % 8 != 0 ||
      v_cache.size(-1) % 8 != 0 || !query.device().is_cpu()) {
    return python_fallback(query, key, value, layer, scale, sliding_window, softcap, sinks);
  }
  const at::Tensor q = query.select(0, 0).transpose(0, 1);  // [T, heads, d]
  const at::Tensor k = key.select(0, 0).transpose(0, 1);
  const at::Tensor v = value.select(0, 0).transpose(0, 1);
  // The parts are named for torch.profiler (bench/profile_step.py --top-ops): a step's cache writes, with their
  // first touches of the lazily mapped cache, cost W2 fp32 ~0.85 ms of its ~29 ms decode step on a Zen 4. Without a
  // profiler a RECORD_FUNCTION is one flag test.
  {
    RECORD_FUNCTION("cbcore::cpu_cache_write", std::vector<c10::IValue>());
    cpu::cache_write(k, v, k_cache, v_cache, step.slot_mapping);
  }

  const int64_t window = sliding_window.has_value() ? *sliding_window : -1;
  const double cap = softcap.has_value() ? *softcap : 0.0;
  std::optional<at::Tensor> sink_logits;
  if (sinks.has_value()) sink_logits = sinks->detach().to(at::kFloat).contiguous();
  // The kernels write their rows of the output in place.
  at::Tensor out = at::empty({q.size(0), heads, v_cache.size(-1)}, q.options());
  const int64_t num_decode = step.num_decode_tokens;
  if (num_decode > 0) {
    const cpu::DecodePlan* plan = nullptr;  // the step's first layer makes it
    {
      RECORD_FUNCTION("cbcore::cpu_decode_plan", std::vector<c10::IValue>());
      plan = &step.decode_plan(window, heads, k_cache);
    }
    RECORD_FUNCTION("cbcore::cpu_decode", std::vector<c10::IValue>());
    cpu::decode_attention_planned(*plan, rows(q.narrow(0, 0, num_decode)), k_cache, v_cache, scale, cap, sink_logits,
                                  out.narrow(0, 0, num_decode));
  }
  if (step.num_prefill_requests > 0) {
    RECORD_FUNCTION("cbcore::cpu_prefill", std::vector<c10::IValue>());
    const int64_t num_prefill = q.size(0) - num_decode;
    cpu::prefill_attention_planned(step.prefill_plan(window, heads, k_cache),
                                   rows(q.narrow(0, num_decode, num_prefill)), k_cache, v_cache, scale, cap,
                                   sink_logits, out.narrow(0, num_decode, num_prefill));
  }
  layers_run.fetch_add(1, std::memory_order_relaxed);
  return out.unsqueeze(0);
}

void enter_cpu_step(std::vector<at::Tensor> key_caches, std::vector<at::Tensor> value_caches, at::Tensor slot_mapping,
                    int64_t num_decode_tokens, at::Tensor decode_block_table, at::Tensor decode_seq_lens,
                    int64_t num_prefill_requests, at::Tensor prefill_block_table, at::Tensor prefill_cu_seqlens_q,
                    at::Tensor prefill_seq_lens_k, bool cascade) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "enter_cpu_step: ", key_caches.size(),
                    " key caches but ", value_caches.size(), " value caches");
  for (size_t i = 0; i < key_caches.size(); ++i) {
    TORCH_CHECK_VALUE(key_caches[i].device().is_cpu() && value_caches[i].device().is_cpu() &&
                          key_caches[i].is_contiguous() && value_caches[i].is_contiguous() &&
                          key_caches[i].dim() == 4 && value_caches[i].dim() == 4,
                      "enter_cpu_step: layer ", i, "'s caches are not contiguous 4-D CPU tensors");
  }
  CpuStep step;
  step.active = true;
  step.key_caches = std::move(key_caches);
  step.value_caches = std::move(value_caches);
  step.slot_mapping = std::move(slot_mapping);
  step.num_decode_tokens = num_decode_tokens;
  step.decode_block_table = std::move(decode_block_table);
  step.decode_seq_lens = std::move(decode_seq_lens);
  step.num_prefill_requests = num_prefill_requests;
  step.prefill_block_table = std::move(prefill_block_table);
  step.prefill_cu_seqlens_q = std::move(prefill_cu_seqlens_q);
  step.prefill_seq_lens_k = std::move(prefill_seq_lens_k);
  step.cascade = cascade;
  current_step = std::move(step);
}

}  // namespace

void register_cpu_step_attention_bindings(py::module_& m) {
  m.def("enter_cpu_step", &enter_cpu_step, py::arg("key_caches"), py::arg("value_caches"), py::arg("slot_mapping"),
        py::arg("num_decode_tokens"), py::arg("decode_block_table"), py::arg("decode_seq_lens"),
        py::arg("num_prefill_requests"), py::arg("prefill_block_table"), py::arg("prefill_cu_seqlens_q"),
        py::arg("prefill_seq_lens_k"), py::arg("cascade") = true,
        "On this thread, until exit_cpu_step: cbcore::step_attention runs its C++ CPU kernel over this step (the "
        "fields of cbcore.attention.StepMetadata), making the kernels' plans once, at the first layer; cascade: the "
        "decode plans attend block-table prefixes several requests share once (cbcore.ops.cascade_enabled).");
  m.def("enter_warmup_step", [] {
    current_step = CpuStep();
    current_step.warmup = true;
  }, "On this thread, until exit_cpu_step: cbcore::step_attention answers zeros (the step is compiled ahead).");
  m.def("exit_cpu_step", [] { current_step = CpuStep(); },
        "Forget this thread's step: cbcore::step_attention hands CPU calls to its Python implementation again.");
  m.def("cpu_step_attention_layers", [] { return layers_run.load(); },
        "Layer calls the C++ CPU kernel of cbcore::step_attention ran itself since the process started.");
  m.def("set_python_step_attention", [](py::object fn) {
    if (python_step_attention == nullptr) python_step_attention = new py::object();
    *python_step_attention = std::move(fn);
  }, py::arg("fn"), "The Python implementation cbcore::step_attention's CPU kernel hands what it does not take to.");
}

}  // namespace cbcore

TORCH_LIBRARY_IMPL(cbcore, CPU, m) {
  m.impl("step_attention", &cbcore::step_attention_cpu);
}
