// Greedy decoding's token choice: the first maximum of each row of the scores (cbcore/sampling.py).
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds greedy_tokens to the module (cbcore._C).
void register_greedy_bindings(pybind11::module_& m);

}  // namespace cbcore
