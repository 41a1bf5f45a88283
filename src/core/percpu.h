/* percpu.h -- the cpu policy's increment: a restartable sequence, inline.
 *
 * A cpu counter of n = 2P + 1 shards keeps shard 0 for resets, shards
 * 1..P for the thread policy's path and shards P+1..2P one per CPU. A
 * thread adds to its CPU's shard with a plain load and store inside a
 * restartable sequence (rseq) on glibc's own registration: the kernel
 * restarts the sequence at its abort handler if the thread is preempted,
 * migrated or signalled before the store, so no other writer (of any
 * process: one thread runs on a CPU at a time) can come between the load
 * and the store. The sequence gives up (the thread policy's path, shards
 * 1..P, then does the add) where the CPU has no shard or its bit in the
 * store's cpu_seen is clear (the first increment on a CPU sets it, so
 * that a mover knows to pass that CPU), the store's cpu_fence is up (a
 * mover is at work, journal.c), or the cell or its new value is out of
 * the live range (retired by a move, or about to leave it). The argument
 * is in docs/design.md.
 *
 * Only x86-64 Linux with glibc's <sys/rseq.h> has the sequence; elsewhere,
 * and under ThreadSanitizer (which cannot see into the asm), the cpu
 * policy always takes the thread policy's path.
 */
#ifndef TALLY_PERCPU_H
#define TALLY_PERCPU_H

#include "internal.h"

#if defined(__x86_64__) && defined(__linux__) && !defined(__SANITIZE_THREAD__) &&        \
    defined(__has_include)
#if __has_include(<sys/rseq.h>)
#include <sys/rseq.h>
#if defined(RSEQ_SIG)
#define TALLY__RSEQ 1
#endif
#endif
#endif
#ifndef TALLY__RSEQ
#define TALLY__RSEQ 0
#endif

/* 1 once this process may use the sequence: glibc registered rseq
 * (__rseq_size > 0; not with GLIBC_TUNABLES=glibc.pthread.rseq=0). */
extern int tally__rseq_on;

#define TALLY__STR_(x)       #x
#define TALLY__STR(x)        TALLY__STR_(x)
#define TALLY__ROW_BYTES_LIT 4160 /* for the asm */
_Static_assert(TALLY__ROW_BYTES == TALLY__ROW_BYTES_LIT, "the asm's row size");

#ifdef TALLY_TEST_SEAMS
/* tests: pause this many times between the load and the commit, so that
 * a mover that failed to fence would meet sequences in flight */
extern unsigned tally__test_rseq_spin;
#define TALLY__RSEQ_SPIN                                                                 \
  "movl %[spin], %%edx\n\t"                                                              \
  "5:\n\t"                                                                               \
  "testl %%edx, %%edx\n\t"                                                               \
  "jz 6f\n\t"                                                                            \
  "pause\n\t"                                                                            \
  "decl %%edx\n\t"                                                                       \
  "jmp 5b\n\t"                                                                           \
  "6:\n\t"
#define TALLY__RSEQ_SPIN_ARG , [spin] "m"(tally__test_rseq_spin)
#else
#define TALLY__RSEQ_SPIN
#define TALLY__RSEQ_SPIN_ARG
#endif

/* Add delta to this CPU's cell of the cpu counter c (its handle's loc):
 * 0 if added, 1 if the thread policy's path must do it (nothing added). */
static inline int tally__cpu_try(tally_counter *c, int64_t delta) {
#if TALLY__RSEQ
  if (__builtin_expect(!tally__rseq_on || delta <= -TALLY__FAST_DELTA ||
                           delta >= TALLY__FAST_DELTA,
                       0))
    return 1;
  uint64_t loc = atomic_load_explicit(&c->loc, memory_order_acquire);
  uint32_t p = (tally__loc_shards(loc) - 1) / 2; /* 0 for the tombstone: gives up */
  unsigned char *row = (unsigned char *)tally__cell_in(c->base, loc, 1 + p);
  struct tally__header *h = (struct tally__header *)(void *)c->base;
  const uint64_t *fence = (const uint64_t *)&h->cpu_fence;
  const uint64_t *seen = (const uint64_t *)h->cpu_seen;
  /* The descriptor (struct rseq_cs: version, flags, start, length of the
   * section up to the commit, abort address) and the abort handler, after
   * the signature the kernel checks, are in sections of their own. The
   * section is 1: to 2:, its last instruction the commit. */
  __asm__ goto(
      ".pushsection __rseq_cs, \"aw\"\n\t"
      ".balign 32\n\t"
      "3:\n\t"
      ".long 0, 0\n\t"
      ".quad 1f, 2f - 1f, 4f\n\t"
      ".popsection\n\t"
      ".pushsection __rseq_failure, \"ax\"\n\t"
      ".byte 0x0f, 0xb9, 0x3d\n\t" /* ud1 <sig>(%rip), %edi */
      ".long " TALLY__STR(
          RSEQ_SIG) "\n\t"
                    "4:\n\t"
                    "jmp %l[give_up]\n\t"
                    ".popsection\n\t"
                    "leaq 3b(%%rip), %%rax\n\t"
                    "movq %%rax, %%fs:8(%[abi])\n\t" /* rseq->rseq_cs */
                    "1:\n\t"
                    "movl %%fs:4(%[abi]), %%eax\n\t" /* rseq->cpu_id */
                    "cmpl %[p], %%eax\n\t"           /* no shard, or not registered */
                    "jae %l[give_up]\n\t"
                    "movl %%eax, %%edx\n\t" /* cpu_seen's bit of this CPU */
                    "shrl $6, %%edx\n\t"
                    "movq (%[seen], %%rdx, 8), %%rdx\n\t"
                    "btq %%rax, %%rdx\n\t"
                    "jnc %l[give_up]\n\t"
                    "cmpq $0, %[fence]\n\t"
                    "jne %l[give_up]\n\t"
                    "imulq $" TALLY__STR(
                        TALLY__ROW_BYTES_LIT) ", %%rax, %%rax\n\t"
                                              "movq (%[row], %%rax), %%rcx\n\t"
                                              "leaq (%%rcx, %%rcx), %%rdx\n\t" /* live: bits 63 and 62 agree */
                                              "xorq %%rcx, %%rdx\n\t"
                                              "js %l[give_up]\n\t"
                                              "addq %[delta], %%rcx\n\t" /* and v + delta too */
                                              "leaq (%%rcx, %%rcx), %%rdx\n\t"
                                              "xorq %%rcx, %%rdx\n\t"
                                              "js %l[give_up]\n\t" TALLY__RSEQ_SPIN
                                              "movq %%rcx, (%[row], %%rax)\n\t" /* the commit */
                                              "2:\n\t"
      :
      : [abi] "r"(__rseq_offset), [p] "r"(p), [fence] "m"(*fence), [seen] "r"(seen),
        [row] "r"(row), [delta] "r"(delta)TALLY__RSEQ_SPIN_ARG
      : "rax", "rcx", "rdx", "memory", "cc"
      : give_up);
  return 0;
give_up: /* the caller's slow path notes a CPU new to the store */
  return 1;
#else
  (void)c, (void)delta;
  return 1;
#endif
}

#endif
