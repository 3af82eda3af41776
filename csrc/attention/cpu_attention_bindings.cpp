// Python bindings of the CPU attention kernels (cbcore._C). Tensors cross as at::Tensor through torch's
// pybind11 type casters (torch/csrc/utils/pybind.h: the part of <torch/extension.h> needed here, at a
// fifth of its compile time). The GIL is released while a kernel runs, so the manager's other threads keep
// going. Argument errors are c10::ValueError and reach Python as ValueError.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "attention/cpu_attention.h"
#include "attention/cpu_attention_bindings.h"

namespace py = pybind11;

namespace cbcore {

void register_cpu_attention_bindings(py::module_& m) {
  m.def("cache_write", &cpu::cache_write, py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>(),
        "Writes k, v [num_tokens, kv_heads, head_dim] into the page slots slot_mapping (int64, block * page_size + "
        "offset) of k_cache / v_cache [num_blocks, page_size, kv_heads, head_dim] (CPU, converting to the cache "
        "dtype). Same result as cbcore.ops.cache_write_reference.");
  m.def("decode_attention", &cpu::decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("cascade") = true,
        py::call_guard<py::gil_scoped_release>(),
        "Paged decode attention on the CPU: q [batch, heads, head_dim] against each request's seq_lens[b] keys, "
        "read in place through block_table. sliding_window: -1 for none; softcap: 0 for none; sinks: None or "
        "[heads] float32 sink logits; cascade: attend to block-table prefixes several requests share once (see "
        "plan_decode). Returns [batch, heads, v_head_dim]. Same semantics as cbcore.ops.decode_attention_reference.");
  m.def("prefill_attention", &cpu::prefill_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("cu_seqlens_q"), py::arg("seq_lens_k"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Packed causal prefill attention on the CPU (bottom-right aligned, optional sliding window; -1 for none), "
        "reading the pages in place; softcap (0: none) and sinks (None or [heads] float32) as in decode_attention. "
        "Returns [num_tokens, heads, v_head_dim]. Same semantics as cbcore.ops.prefill_attention_reference.");
  py::class_<cpu::DecodePlan>(m, "DecodePlan",
                              "A step's decode work split, its block table validated: built once per step (and "
                              "per window and head shape), reused by every layer (decode_attention_planned).")
      .def_property_readonly("batch", &cpu::DecodePlan::batch)
      .def_property_readonly("cascade_groups", &cpu::DecodePlan::cascade_groups,
                             "The cascade groups: (member requests, shared prefix length in keys) each.");
  py::class_<cpu::PrefillPlan>(m, "PrefillPlan",
                               "A step's prefill work split, its block table validated: built once per step (and "
                               "per window and head shape), reused by every layer (prefill_attention_planned).")
      .def_property_readonly("num_tokens", &cpu::PrefillPlan::num_tokens);
  m.def("plan_decode", &cpu::plan_decode, py::arg("block_table"), py::arg("seq_lens"), py::arg("num_blocks"),
        py::arg("page_size"), py::arg("kv_heads"), py::arg("heads"), py::arg("sliding_window"),
        py::arg("cascade") = true, py::call_guard<py::gil_scoped_release>(),
        "Validates a decode step's block_table / seq_lens against num_blocks x page_size and splits its work for "
        "kv_heads x heads attention with this sliding window (-1: none). With cascade, requests whose block tables "
        "start with the same blocks attend to that shared prefix together (read once), when it pays (enough "
        "query rows and shared keys; never across a sliding window that starts after key 0). Returns a DecodePlan.");
  m.def("decode_attention_planned", &cpu::decode_attention_planned, py::arg("plan"), py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("scale"), py::arg("softcap"), py::arg("sinks"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>(),
        "decode_attention over a plan, writing into out [batch, heads, v_head_dim] (contiguous, q's dtype).");
  m.def("plan_prefill", &cpu::plan_prefill, py::arg("block_table"), py::arg("cu_seqlens_q"), py::arg("seq_lens_k"),
        py::arg("num_blocks"), py::arg("page_size"), py::arg("kv_heads"), py::arg("heads"),
        py::arg("sliding_window"), py::call_guard<py::gil_scoped_release>(),
        "Validates a prefill step's block_table / cu_seqlens_q / seq_lens_k and splits its work (see plan_decode). "
        "Returns a PrefillPlan.");
  m.def("prefill_attention_planned", &cpu::prefill_attention_planned, py::arg("plan"), py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("scale"), py::arg("softcap"), py::arg("sinks"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>(),
        "prefill_attention over a plan, writing into out [num_tokens, heads, v_head_dim] (contiguous, q's dtype).");
  m.def("cpu_attention_isa", &cpu::isa,
        "The instruction set the CPU attention kernels use: 'avx512_bf16', 'avx512', 'avx2' or 'generic'.");
  m.def("cpu_attention_isas", &cpu::available_isas,
        "The instruction sets this CPU and build can run the CPU attention kernels with, portable first.");
  m.def("_set_cpu_attention_isa", &cpu::set_isa, py::arg("name"),
        "Force one of cpu_attention_isas() (ValueError naming the available ones otherwise), or 'auto' (the best); "
        "cbcore.ops does it from CBCORE_CPU_ISA.");
}

}  // namespace cbcore
