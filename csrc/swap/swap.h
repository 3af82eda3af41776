// Swap to host: a pool of host blocks and batched copies of many blocks across all layers, one call per direction.
//
// Python (cbcore._C):
//
//   pool = SwapPool(num_layers, num_host_blocks, page_size, num_kv_heads, head_dim, dtype, pin=None)
//   pool.swap_out(key_caches, value_caches, device_block_ids, host_block_ids)   # device block d[i] -> host block h[i]
//   pool.swap_in(key_caches, value_caches, host_block_ids, device_block_ids)    # host block h[i] -> device block d[i]
//   pool.wait_on_current_stream()   # the current stream waits for every copy issued so far (host not blocked)
//   pool.synchronize()              # the host waits for every copy issued so far
//   pool.key(layer), pool.value(layer)   # the host tensors [num_host_blocks, page_size, num_kv_heads, head_dim]
//
// CPU caches: the copies are a parallel memcpy and are done when the call returns. CUDA caches: the copies run on a
// side stream, after the work already queued on the current stream, and the call returns at once; the caller
// orders later work with wait_on_current_stream() (before reading swapped-in blocks, and before reusing the device
// blocks of a swap-out) or synchronize(). The copy itself is the dispatcher op cbcore::copy_blocks: its CPU kernel
// lives here, its CUDA kernel (one launch for every block of every layer, through unified addressing of the pinned
// pool) in cbcore._cuda, and a device-generic fallback (per-layer gather/scatter) runs when that module is absent.
// This keeps cbcore._C free of any CUDA build or link dependency: streams and events go through c10's
// device-generic interfaces, which the CUDA build of torch serves at run time.
#pragma once

#include <pybind11/pybind11.h>

namespace cbcore {

// Adds SwapPool to the module (cbcore._C).
void register_swap_bindings(pybind11::module_& m);

}  // namespace cbcore
