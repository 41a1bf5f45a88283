/* clock.c -- the library's one monotonic clock.
 *
 * Leases, waits and timeouts are measured with CLOCK_MONOTONIC, which no
 * one can set back; rollup periods use the caller's wall clock instead
 * (tally_schedule_tick takes `now`). Exported so the network layer and the
 * bindings measure with the same clock rather than copies of it.
 */
#include "internal.h"

#include <time.h>

int64_t tally_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t tally_monotonic_ms(void) {
  return tally_monotonic_ns() / 1000000;
}
