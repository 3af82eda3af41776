// Registration of the CPU attention ops with cbcore._C. Kept free of torch headers so that
// csrc/bindings.cpp, which includes it, still compiles in seconds.
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds cache_write, decode_attention, prefill_attention, cpu_attention_isa and
// _set_cpu_attention_isa to the module (cbcore._C).
void register_cpu_attention_bindings(pybind11::module_& m);

// Adds enter_cpu_step, enter_warmup_step, exit_cpu_step and set_python_step_attention: the context of the C++ CPU
// kernel of cbcore::step_attention (csrc/attention/cpu_step_attention.cpp).
void register_cpu_step_attention_bindings(pybind11::module_& m);

}  // namespace cbcore
