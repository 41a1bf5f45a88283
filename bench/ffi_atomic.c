/* ffi_atomic.c -- the baselines for bench/bench_luajit.lua and
 * scripts/bench-openresty: the cheapest increment a LuaJIT FFI call can
 * make, one relaxed atomic add on a cell (what tally_counter_incr does on
 * its shard, without finding the shard), with the same signature shape as
 * tally_counter_incr; and the same add as a caller holding the cell's
 * index would have to make it to stay exact through moves. */
#include <stdatomic.h>
#include <stdint.h>

__attribute__((visibility("default"))) int ffi_atomic_add(_Atomic int64_t *cell,
                                                          int64_t delta) {
  atomic_fetch_add_explicit(cell, delta, memory_order_relaxed);
  return 0;
}

/* Cells, and a generation per region of 8192 of them. */
struct ffi_cells {
  _Atomic int64_t *cells;
  const _Atomic uint64_t *gens;
};

/* entry: the generation << 33 | the cell's index (a Lua number). Returns 0
 * when added; 1 when the entry's generation is not its region's (nothing
 * added: a held index made stale by a move must not be followed); 2 when
 * the add's result is out of tally's live range (a retired cell). What an
 * increment through a held cell address costs at the least. */
__attribute__((visibility("default"))) int ffi_checked_add(const struct ffi_cells *t,
                                                           int64_t entry, int64_t delta) {
  uint64_t i = (uint64_t)entry & ((UINT64_C(1) << 33) - 1);
  if (atomic_load_explicit(&t->gens[i >> 13], memory_order_acquire) !=
      (uint64_t)entry >> 33)
    return 1;
  uint64_t old =
      (uint64_t)atomic_fetch_add_explicit(&t->cells[i], delta, memory_order_relaxed);
  uint64_t now = old + (uint64_t)delta;
  return (int)(((old ^ (old << 1)) | (now ^ (now << 1))) >> 63) * 2;
}
