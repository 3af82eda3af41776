// Python bindings of the CUDA extension: the cbcore._cuda module (built only when torch has CUDA and nvcc exists).
//
// Importing it needs no GPU: the ops check their inputs and raise a clear error for tensors that are not on a CUDA
// device. It also registers the CUDA kernel of the dispatcher op cbcore::copy_blocks, which the swap pool in
// cbcore._C calls (see csrc/swap/swap.h).
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "attention/cuda_ops.h"

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _cuda
#endif

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cbcore's CUDA kernels: paged decode attention, cache writes, batched block copies for swapping.";
  m.def("cache_write", &cbcore::cuda::cache_write, py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"),
        R"doc(Writes k, v [num_tokens, kv_heads, head_dim] into k_cache, v_cache [num_blocks, page_size, kv_heads,
head_dim] at slot_mapping [num_tokens] (int64, block * page_size + offset). Negative slots are skipped (padding).)doc");
  m.def("decode_attention", &cbcore::cuda::decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = -1,
        py::arg("deterministic") = false, py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        R"doc(Paged decode attention: q [batch, heads, head_dim] (one token per request) against each request's
seq_lens[b] keys in its pages (block_table [batch, max_blocks] int32, seq_lens [batch] int32). sliding_window=-1:
none; else keys k > len - 1 - window are seen. deterministic=True fixes the split size, so each request's result is
bitwise independent of the rest of the batch. softcap=0: none; else scores become softcap * tanh(score / softcap).
sinks: None, or [heads] float32 sink logits that join each softmax's denominator (GPT-OSS). Returns [batch, heads, head_dim] in q's dtype; a request with no keys
gets zeros.)doc");
  m.def("decode_split_tokens", &cbcore::cuda::decode_split_tokens, py::arg("work_units"), py::arg("span"),
        py::arg("deterministic"), py::arg("num_sms"),
        "Keys per split that decode_attention picks for work_units = batch x kv_heads x head chunks and a longest "
        "key range of span tokens on a GPU with num_sms multiprocessors (for benchmarks and tests).");
  m.attr("DETERMINISTIC_SPLIT_TOKENS") = cbcore::cuda::kDeterministicSplitTokens;
}

TORCH_LIBRARY_IMPL(cbcore, CUDA, m) { m.impl("copy_blocks", &cbcore::cuda::copy_blocks); }
