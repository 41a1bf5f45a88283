/* policy.c -- which shard an increment lands on.
 *
 * thread:      a ticket per (thread, store), drawn from a counter in the
 *              store header, so threads of every process that share a file
 *              get consecutive tickets; shard = ticket mod n. While writers
 *              <= shards, no two writers share a shard.
 * random:      a per-thread xorshift64* generator; shard by multiply-shift.
 * round_robin: a per-thread position that advances on every increment,
 *              starting at the thread's ticket so threads start apart.
 * key:         hash of the key, so the same key lands on the same shard.
 * cpu:         the CPU's own shard, by a restartable sequence (percpu.c).
 *
 * The per-thread state is forgotten in a forked child (pthread_atfork), so
 * pre-forked workers (nginx) do not inherit their parent's shard.
 */
#include "internal.h"

#include <string.h>

_Thread_local struct tally__writer tally__me;

static void forget_in_child(void) {
  memset(&tally__me, 0, sizeof tally__me);
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static void init(void) {
  pthread_atfork(NULL, NULL, forget_in_child);
  tally__cpu_init();
}
void tally__policy_init(void) {
  pthread_once(&init_once, init);
}

void tally__draw_ticket(tally_store *s) {
  tally__me.ticket = atomic_fetch_add_explicit(&s->hdr->writers, 1, memory_order_relaxed);
  tally__me.rr = tally__me.ticket;
  tally__me.store_id = s->id;
}

void tally__seed_random(void) {
  tally__me.rng =
      tally__mix((uint64_t)(uintptr_t)&tally__me ^ (uint64_t)tally_monotonic_ns()) | 1;
}

uint32_t tally__key_shard(const void *key, size_t len, uint32_t n) {
  return (uint32_t)(((tally__hash(key, len, 0x6b6579) >> 32) * n) >> 32);
}

uint32_t tally_key_shard(const void *key, size_t len, uint32_t n) {
  return n ? tally__key_shard(key, len, n) : 0;
}

static const char *const names[TALLY_POLICY_COUNT_] = {
    "thread", "random", "round_robin", "key", "custom", "slot", "cpu"};

const char *tally_policy_name(int policy) {
  return policy >= 0 && policy < TALLY_POLICY_COUNT_ ? names[policy] : NULL;
}

int tally_policy_parse(const char *name, size_t len) {
  if (!name) return TALLY_EPOLICY;
  for (int i = 0; i < TALLY_POLICY_COUNT_; i++)
    if (strlen(names[i]) == len && memcmp(names[i], name, len) == 0) return i;
  return TALLY_EPOLICY;
}
