// Prepacked oneDNN linear layers by integer handle: the op torch.ops.cbcore.packed_linear (cbcore/linear.py).
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds register_packed_linear and drop_packed_linear to the module (cbcore._C); the op itself is registered
// with the dispatcher (TORCH_LIBRARY_FRAGMENT(cbcore)) when the module loads.
void register_packed_linear_bindings(pybind11::module_& m);

}  // namespace cbcore
