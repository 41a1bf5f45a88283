/* ffi_atomic.c -- the baseline for bench/bench_luajit.lua: the cheapest
 * increment a LuaJIT FFI call can make, one relaxed atomic add on a cell
 * (what tally_counter_incr does on its shard, without finding the shard),
 * with the same signature shape as tally_counter_incr. */
#include <stdatomic.h>
#include <stdint.h>

__attribute__((visibility("default"))) int ffi_atomic_add(_Atomic int64_t *cell,
                                                          int64_t delta) {
  atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
  return 0;
}
