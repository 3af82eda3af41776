// The CPU kernels of the stateful layers' ops: causal depthwise conv1d with a per-request conv state, the gated delta
// rule with a per-request recurrent state (Qwen3.5 / Qwen3-Next's linear attention), and Mamba-1's and Mamba-2's
// selective scans, all over pools of state slots. Kept free of torch headers so that csrc/bindings.cpp, which
// includes it, still compiles in seconds.
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds causal_conv1d_update, causal_conv1d_varlen, gated_delta_rule_recurrent, gated_delta_rule_varlen,
// mamba2_state_update, mamba2_scan_varlen, mamba_state_update, mamba_scan_varlen, state_ops_isa, state_ops_isas and
// _set_state_ops_isa to the module (cbcore._C).
void register_state_ops_bindings(pybind11::module_& m);

}  // namespace cbcore
