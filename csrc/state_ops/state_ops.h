// The CPU kernels of the stateful layers' ops: causal depthwise conv1d with a per-request conv state, and the gated
// delta rule with a per-request recurrent state (Qwen3.5 / Qwen3-Next's linear attention), both over pools of state
// slots. Kept free of torch headers so that csrc/bindings.cpp, which includes it, still compiles in seconds.
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds causal_conv1d_update, causal_conv1d_varlen, gated_delta_rule_recurrent, gated_delta_rule_varlen,
// state_ops_isa, state_ops_isas and _set_state_ops_isa to the module (cbcore._C).
void register_state_ops_bindings(pybind11::module_& m);

}  // namespace cbcore
