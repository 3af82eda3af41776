// Structured output's token mask (cbcore/grammar.py): the logits of the tokens a request's grammar does not allow
// next set to -inf, from the grammar engine's bitmask.
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds apply_token_bitmask to the module (cbcore._C).
void register_token_bitmask_bindings(pybind11::module_& m);

}  // namespace cbcore
