/* redis_flush.c -- exactly-once flushing of local counters to Redis.
 *
 * The flusher keeps one entry per local counter it has seen: the name, an
 * open counter handle, and (pinc, prev), the writer's w:W as last known
 * (valid when `known`): the incarnation it was written for and the value.
 * Entries live in a growing array, found by name through an open-addressing
 * table of indices. A round collects the matching names, reads their local
 * values with their incarnations, pipelines HGET w:W for entries with
 * unknown prev and for quiet ones not read back since their last write,
 * then pipelines the compare-and-set script for entries whose value or
 * incarnation moved. A value read back is marked shipped in the local
 * store, which lets the counter expire. A name the round's pattern covers
 * that the round did not find live (dropped, expired) loses its entry at
 * the round's end: the flusher keeps what the live counters need, not
 * every name it ever flushed. See tally_net.h for the protocol.
 */

#include "redis_cluster.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char SCRIPT[] = "local f = 'w:' .. ARGV[1]\n"
                             "local cur = redis.call('HGET', KEYS[1], f)\n"
                             "if not cur then cur = '0' end\n"
                             "if cur == ARGV[2] then\n"
                             "  redis.call('HINCRBY', KEYS[1], 'v', ARGV[4])\n"
                             "  redis.call('HSET', KEYS[1], f, ARGV[3])\n"
                             "  return 1\n"
                             "elseif cur == ARGV[3] then\n"
                             "  return 0\n"
                             "end\n"
                             "return cur\n";

#define KEY_MAX (TALLY_NAME_MAX + 32)

struct entry {
  char *name;
  uint32_t len;
  bool known;       /* (pinc, prev) is w:W as last seen */
  bool confirmed;   /* ... and was read from Redis, not only written */
  bool verifying;   /* known was cleared by a re-verification: expect prev */
  bool pending;     /* in this round */
  uint64_t seen;    /* the last round that found it live (or failed to read) */
  tally_counter *c; /* NULL: not open */
  uint64_t pinc;    /* w:W's incarnation; 0: none (nil, or an older format) */
  int64_t prev;
  uint64_t inc;  /* local incarnation read this round */
  int64_t cur;   /* ... and its value */
  int64_t delta; /* what this round's script adds, if it applies */
};

/* w:W holds "INCARNATION:VALUE" (16 lowercase hex digits, a colon, int64
 * decimal); a bare VALUE (nil reads "0") has no incarnation. */
#define FIELD_MAX 40
static int format_field(char *buf, uint64_t inc, int64_t v) {
  if (!inc) return snprintf(buf, FIELD_MAX, "%" PRId64, v);
  return snprintf(buf, FIELD_MAX, "%016" PRIx64 ":%" PRId64, inc, v);
}

struct tally_flusher {
  tally_store *local;
  tally_rc *rc;
  char *writer;
  size_t wlen;
  char *wfield; /* "w:" writer */
  size_t wflen;
  uint32_t shards; /* R */
  uint32_t shard;  /* this writer's shard */
  struct entry *ents;
  uint32_t n, cap;
  uint32_t *table; /* index + 1, 0 = empty */
  uint32_t tcap;   /* power of two */
  uint32_t *order; /* entries sent in the current batch, in add order */
  uint64_t round;  /* rounds begun */
  tally_rc_pipe *pipe;
  /* re-verification */
  uint32_t verify_ms;   /* 0: no timer */
  uint64_t last_verify; /* monotonic ms of the last forced re-read */
  uint64_t topo_seen;   /* rc's topology count when last verified */
  bool verify_due;
  /* names collected by tally_store_each */
  char *nbuf;
  size_t nlen, ncap;
  /* the first failure of a round */
  int first_code;
  char first_msg[512];
};

static uint32_t fnv1a32(const void *p, size_t n) {
  const unsigned char *b = p;
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) {
    h ^= b[i];
    h *= 16777619u;
  }
  return h;
}

const char *tally_flusher_script(void) {
  return SCRIPT;
}

uint32_t tally_flusher_shard(const tally_flusher *f) {
  return f->shard;
}

int tally_flusher_shard_key(const char *name, size_t len, uint32_t i, char *buf,
                            size_t cap) {
  if (!name || len == 0 || len > TALLY_NAME_MAX || !buf)
    return tally_error_set(TALLY_EINVAL, "redis flush: bad counter name");
  char num[16];
  int nl = snprintf(num, sizeof num, "%" PRIu32, i);
  size_t need = 7 + len + 1 + (size_t)nl + 1; /* "tally:{" name "#" i "}" */
  if (need + 1 > cap)
    return tally_error_set(TALLY_EINVAL, "redis flush: key buffer too small");
  memcpy(buf, "tally:{", 7);
  memcpy(buf + 7, name, len);
  buf[7 + len] = '#';
  memcpy(buf + 8 + len, num, (size_t)nl);
  buf[8 + len + (size_t)nl] = '}';
  buf[need] = '\0';
  return (int)need;
}

void tally_flusher_set_verify(tally_flusher *f, uint32_t ms) {
  if (f) f->verify_ms = ms;
}

void tally_flusher_verify(tally_flusher *f) {
  if (f) f->verify_due = true;
}

/* Forget every believed w:W if a re-verification is due. */
static void maybe_verify(tally_flusher *f) {
  tally_rc_stats rs;
  tally_rc_stats_get(f->rc, &rs);
  uint64_t now = (uint64_t)tally_monotonic_ms();
  if (rs.topology != f->topo_seen ||
      (f->verify_ms && now - f->last_verify >= f->verify_ms))
    f->verify_due = true;
  if (!f->verify_due) return;
  f->verify_due = false;
  f->topo_seen = rs.topology;
  f->last_verify = now;
  for (uint32_t i = 0; i < f->n; i++)
    if (f->ents[i].known) {
      f->ents[i].known = false;
      f->ents[i].verifying = true;
    }
}

static bool parse_i64(const char *s, size_t len, int64_t *out) {
  if (!s || len == 0 || len > 20) return false;
  char tmp[24];
  memcpy(tmp, s, len);
  tmp[len] = '\0';
  char *end;
  errno = 0;
  long long v = strtoll(tmp, &end, 10);
  if (errno || end != tmp + len) return false;
  *out = v;
  return true;
}

/* Parse w:W as format_field writes it, exactly (the script compares
 * strings, so only the canonical form can match). */
static bool parse_field(const char *str, size_t len, uint64_t *inc, int64_t *v) {
  const char *colon = str ? memchr(str, ':', len) : NULL;
  if (!colon) {
    *inc = 0;
    return parse_i64(str, len, v);
  }
  if (colon - str != 16) return false;
  uint64_t x = 0;
  for (int i = 0; i < 16; i++) {
    char ch = str[i];
    int d = ch >= '0' && ch <= '9'   ? ch - '0'
            : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                                     : -1;
    if (d < 0) return false;
    x = x << 4 | (uint64_t)d;
  }
  if (!x || !parse_i64(colon + 1, len - 17, v)) return false;
  char again[FIELD_MAX];
  *inc = x;
  return (size_t)format_field(again, x, *v) == len && memcmp(again, str, len) == 0;
}

/* Remember the first failure of a round (code and message). */
static void note_fail(tally_flusher *f, int code) {
  if (f->first_code) return;
  f->first_code = code;
  snprintf(f->first_msg, sizeof f->first_msg, "%s", tally_errmsg());
}

int tally_flusher_new(tally_store *local, tally_rc *rc, const char *writer,
                      uint32_t remote_shards, tally_flusher **out) {
  if (out) *out = NULL;
  if (!local || !rc || !writer || !out)
    return tally_error_set(TALLY_EINVAL, "redis flush: NULL argument");
  size_t wlen = strlen(writer);
  if (wlen == 0 || wlen > TALLY_FLUSH_WRITER_MAX)
    return tally_error_set(TALLY_EINVAL, "redis flush: writer id must be 1..%u bytes",
                           TALLY_FLUSH_WRITER_MAX);
  if (remote_shards == 0 || remote_shards > TALLY_MAX_SHARDS)
    return tally_error_set(TALLY_ESHARDS,
                           "redis flush: remote shards %" PRIu32 " not in 1..%d",
                           remote_shards, TALLY_MAX_SHARDS);
  tally_flusher *f = calloc(1, sizeof *f);
  if (!f) return tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
  f->local = local;
  f->rc = rc;
  f->wlen = wlen;
  f->writer = malloc(wlen + 1);
  f->wflen = wlen + 2;
  f->wfield = malloc(wlen + 3);
  f->tcap = 64;
  f->table = calloc(f->tcap, sizeof *f->table);
  if (!f->writer || !f->wfield || !f->table) {
    tally_flusher_free(f);
    return tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
  }
  memcpy(f->writer, writer, wlen + 1);
  memcpy(f->wfield, "w:", 2);
  memcpy(f->wfield + 2, writer, wlen + 1);
  f->shards = remote_shards;
  f->shard = fnv1a32(writer, wlen) % remote_shards;
  f->verify_ms = TALLY_FLUSH_VERIFY_MS;
  f->last_verify = (uint64_t)tally_monotonic_ms();
  tally_rc_stats rs;
  tally_rc_stats_get(rc, &rs);
  f->topo_seen = rs.topology;
  int code = tally_rc_pipe_new(rc, &f->pipe);
  if (code) {
    tally_flusher_free(f);
    return code;
  }
  *out = f;
  return 0;
}

void tally_flusher_free(tally_flusher *f) {
  if (!f) return;
  for (uint32_t i = 0; i < f->n; i++) {
    tally_counter_close(f->ents[i].c);
    free(f->ents[i].name);
  }
  free(f->ents);
  free(f->table);
  free(f->order);
  free(f->nbuf);
  free(f->writer);
  free(f->wfield);
  tally_rc_pipe_free(f->pipe);
  free(f);
}

/* ---- the entry table ------------------------------------------------------ */

/* FNV-1a: spreads names over the open-addressed table well enough. */
static uint32_t name_hash(const char *name, size_t len) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)name[i]) * 16777619u;
  return h;
}

static uint32_t slot_of(const tally_flusher *f, const char *name, size_t len) {
  uint32_t mask = f->tcap - 1, h = name_hash(name, len) & mask;
  for (;;) {
    uint32_t e = f->table[h];
    if (e == 0) return h;
    const struct entry *en = &f->ents[e - 1];
    if (en->len == len && memcmp(en->name, name, len) == 0) return h;
    h = (h + 1) & mask;
  }
}

static int resize_table(tally_flusher *f, uint32_t ncap) {
  uint32_t *t = calloc(ncap, sizeof *t);
  if (!t) return tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
  free(f->table);
  f->table = t;
  f->tcap = ncap;
  for (uint32_t i = 0; i < f->n; i++)
    f->table[slot_of(f, f->ents[i].name, f->ents[i].len)] = i + 1;
  return 0;
}

static int grow_table(tally_flusher *f) {
  return resize_table(f, f->tcap * 2);
}

/* The entry for name, created if absent; NULL on ENOMEM (errmsg set). */
static struct entry *entry_get(tally_flusher *f, const char *name, size_t len) {
  uint32_t h = slot_of(f, name, len);
  if (f->table[h]) return &f->ents[f->table[h] - 1];
  if ((f->n + 1) * 2 > f->tcap) {
    if (grow_table(f)) return NULL;
    h = slot_of(f, name, len);
  }
  if (f->n == f->cap) {
    uint32_t ncap = f->cap ? f->cap * 2 : 64;
    struct entry *e = realloc(f->ents, ncap * sizeof *e);
    uint32_t *o = realloc(f->order, ncap * sizeof *o);
    if (e) f->ents = e;
    if (o) f->order = o;
    if (!e || !o) {
      tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
      return NULL;
    }
    f->cap = ncap;
  }
  struct entry *en = &f->ents[f->n];
  memset(en, 0, sizeof *en);
  en->name = malloc(len + 1);
  if (!en->name) {
    tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
    return NULL;
  }
  memcpy(en->name, name, len);
  en->name[len] = '\0';
  en->len = (uint32_t)len;
  f->table[h] = ++f->n;
  return en;
}

/* Remove entry i: its handle closed, its name freed, the last entry moved
 * into its place. Its table slot is emptied by backward-shift deletion
 * (each later entry of the probe run that the hole would cut off from its
 * home slot moves back into it), so every other name is still found. */
static void entry_remove(tally_flusher *f, uint32_t i) {
  struct entry *en = &f->ents[i];
  uint32_t mask = f->tcap - 1, hole = slot_of(f, en->name, en->len);
  for (uint32_t j = hole;;) {
    j = (j + 1) & mask;
    uint32_t e = f->table[j];
    if (e == 0) break;
    const struct entry *x = &f->ents[e - 1];
    uint32_t home = name_hash(x->name, x->len) & mask;
    if (hole <= j ? hole < home && home <= j : hole < home || home <= j)
      continue; /* reached from its home without crossing the hole */
    f->table[hole] = e;
    hole = j;
  }
  f->table[hole] = 0;
  tally_counter_close(en->c);
  free(en->name);
  uint32_t last = --f->n;
  if (i != last) {
    *en = f->ents[last]; /* the table finds it by name under index last */
    f->table[slot_of(f, en->name, en->len)] = i + 1;
  }
}

/* End of a round: clear the pending marks and remove the entries of the
 * names the pattern covers that this round did not find live. Such a
 * counter was dropped (what it had not flushed is given up) or expired
 * (its final value read back first): what its entry knew of w:W served
 * that incarnation only. A name made again is a new incarnation and a new
 * entry, whose prev is not known: its first round reads w:W (HGET) and
 * flushes its whole value on top, once. One pass over the entries, and
 * O(1) expected per entry removed; the table and the arrays shrink once
 * mostly empty (rebuilt in O(entries), after as many removals). */
static void forget_gone(tally_flusher *f, const char *pattern, size_t plen) {
  for (uint32_t i = f->n; i-- > 0;) { /* the entry moved into i was seen */
    struct entry *en = &f->ents[i];
    en->pending = false;
    if (en->seen != f->round && tally_glob_match(pattern, plen, en->name, en->len))
      entry_remove(f, i);
  }
  uint64_t tcap = 64;
  while (tcap < (uint64_t)f->n * 4) tcap *= 2;
  if (f->tcap > tcap * 2) (void)resize_table(f, (uint32_t)tcap); /* ENOMEM: the old */
  if (f->cap > 64 && f->n * 4 < f->cap) {
    uint32_t ncap = f->n * 2 > 64 ? f->n * 2 : 64;
    struct entry *e = realloc(f->ents, ncap * sizeof *e);
    if (e) f->ents = e;
    uint32_t *o = realloc(f->order, ncap * sizeof *o);
    if (o) f->order = o;
    if (e || o) f->cap = ncap; /* one that failed is larger: still room */
  }
}

/* ---- a round ---------------------------------------------------------------- */

/* tally_store_each callback: append "len name" records to f->nbuf. */
static int collect(void *ud, const char *name, size_t len) {
  tally_flusher *f = ud;
  size_t need = f->nlen + sizeof(uint32_t) + len;
  if (need > f->ncap) {
    size_t ncap = f->ncap ? f->ncap * 2 : 4096;
    while (ncap < need) ncap *= 2;
    char *b = realloc(f->nbuf, ncap);
    if (!b) return tally_error_set(TALLY_ENOMEM, "redis flush: out of memory");
    f->nbuf = b;
    f->ncap = ncap;
  }
  uint32_t l = (uint32_t)len;
  memcpy(f->nbuf + f->nlen, &l, sizeof l);
  memcpy(f->nbuf + f->nlen + sizeof l, name, len);
  f->nlen = need;
  return 0;
}

static int add_cmd(tally_flusher *f, tally_flush_stats *st, const char *key, size_t klen,
                   int argc, const char **argv, const size_t *argvlen) {
  int code = tally_rc_pipe_add(f->pipe, key, klen, argc, argv, argvlen);
  if (code) return code;
  st->commands++;
  for (int i = 0; i < argc; i++) st->bytes += argvlen[i];
  return 0;
}

static void fail_entry(tally_flusher *f, tally_flush_stats *st, struct entry *en,
                       int code) {
  note_fail(f, code);
  st->errors++;
  en->pending = false;
}

/* A reply that is not what the protocol expects: an error reply (WRONGTYPE,
 * script error, overflow) or a type we never produce. */
static void bad_reply(tally_flusher *f, tally_flush_stats *st, struct entry *en,
                      const char *what, const redisReply *r) {
  tally_error_set(TALLY_EREMOTE, "redis flush: %s tally:{%s#%" PRIu32 "}: %s", what,
                  en->name, f->shard,
                  r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply type");
  fail_entry(f, st, en, TALLY_EREMOTE);
}

/* A quiet counter whose w:W was written, not read, since it last moved:
 * read it back before marking it shipped, so a flush that a failover lost
 * is found before the counter may expire. */
static bool to_confirm(const struct entry *en) {
  return en->known && !en->confirmed && en->pinc == en->inc && en->cur == en->prev;
}

/* w:W read for this incarnation: the local store may let the counter go. */
static void confirm(tally_flusher *f, tally_flush_stats *st, struct entry *en) {
  en->confirmed = true;
  if (en->pinc != en->inc) return;
  int code = tally_counter_ship(en->c, en->inc, en->prev);
  if (code && code != TALLY_EDROPPED) {
    note_fail(f, code);
    st->errors++;
  }
}

/* HGET w:W for the pending entries whose prev is not known, or to confirm. */
static int phase_hget(tally_flusher *f, tally_flush_stats *st) {
  char key[KEY_MAX];
  uint32_t nb = 0;
  tally_rc_pipe_reset(f->pipe);
  for (uint32_t i = 0; i < f->n; i++) {
    struct entry *en = &f->ents[i];
    if (!en->pending || (en->known && !to_confirm(en))) continue;
    int klen = tally_flusher_shard_key(en->name, en->len, f->shard, key, sizeof key);
    if (klen < 0) return klen;
    const char *argv[] = {"HGET", key, f->wfield};
    size_t lens[] = {4, (size_t)klen, f->wflen};
    int code = add_cmd(f, st, key, (size_t)klen, 3, argv, lens);
    if (code) return code;
    f->order[nb++] = i;
  }
  if (nb == 0) return 0;
  int xcode = tally_rc_pipe_exec(f->pipe);
  if (xcode) note_fail(f, xcode);
  for (uint32_t j = 0; j < nb; j++) {
    struct entry *en = &f->ents[f->order[j]];
    const redisReply *r = tally_rc_pipe_reply(f->pipe, j);
    int64_t v = 0;
    uint64_t inc = 0;
    if (!r) {
      fail_entry(f, st, en, xcode ? xcode : TALLY_EREMOTE);
    } else if (r->type == REDIS_REPLY_NIL ||
               (r->type == REDIS_REPLY_STRING && parse_field(r->str, r->len, &inc, &v))) {
      if (en->verifying) {
        st->verified++;
        if (v != en->prev || inc != en->pinc) st->repaired++;
        en->verifying = false;
      }
      en->pinc = inc;
      en->prev = v;
      en->known = true;
      confirm(f, st, en);
    } else {
      bad_reply(f, st, en, "HGET", r);
    }
  }
  return 0;
}

/* The compare-and-set script for the pending entries that moved. */
static int phase_eval(tally_flusher *f, tally_flush_stats *st) {
  char key[KEY_MAX];
  uint32_t nb = 0;
  tally_rc_pipe_reset(f->pipe);
  for (uint32_t i = 0; i < f->n; i++) {
    struct entry *en = &f->ents[i];
    if (!en->pending || !en->known) continue;
    if (en->cur == en->prev && en->pinc == en->inc) {
      st->unchanged++;
      continue;
    }
    /* mark it unknown, then read what to send (tally.h): an expiry before
     * the mark saw a value Redis has, and shows here as ENOENT */
    tally_send send;
    en->confirmed = false; /* until a read of w:W marks it again (confirm) */
    int mcode = tally_counter_send_begin(en->c, en->prev, en->pinc, &send);
    if (mcode == TALLY_ENOENT || mcode == TALLY_EDROPPED || mcode == TALLY_EBUSY) {
      en->pending = false; /* gone meanwhile, or made again twice: next round */
      continue;
    }
    if (mcode == TALLY_ERANGE) {
      tally_error_set(TALLY_ERANGE,
                      "redis flush: %s: delta %" PRId64 " - w:W overflows int64",
                      en->name, send.value);
    }
    if (mcode) {
      fail_entry(f, st, en, mcode);
      continue;
    }
    en->cur = send.value;
    en->inc = send.incarnation;
    en->delta = send.delta;
    if (en->cur == en->prev && en->pinc == en->inc) { /* moved back: read it back */
      st->unchanged++;
      continue;
    }
    int klen = tally_flusher_shard_key(en->name, en->len, f->shard, key, sizeof key);
    if (klen < 0) return klen;
    char sp[FIELD_MAX], sn[FIELD_MAX], sd[24];
    int lp = format_field(sp, en->pinc, en->prev);
    int ln = format_field(sn, en->inc, en->cur);
    int ld = snprintf(sd, sizeof sd, "%" PRId64, en->delta);
    const char *argv[] = {"EVAL", SCRIPT, "1", key, f->writer, sp, sn, sd};
    size_t lens[] = {4,       sizeof SCRIPT - 1, 1,          (size_t)klen,
                     f->wlen, (size_t)lp,        (size_t)ln, (size_t)ld};
    int code = add_cmd(f, st, key, (size_t)klen, 8, argv, lens);
    if (code) return code;
    f->order[nb++] = i;
  }
  if (nb == 0) return 0;
  int xcode = tally_rc_pipe_exec(f->pipe);
  if (xcode) note_fail(f, xcode);
  for (uint32_t j = 0; j < nb; j++) {
    struct entry *en = &f->ents[f->order[j]];
    const redisReply *r = tally_rc_pipe_reply(f->pipe, j);
    int64_t cur;
    uint64_t inc;
    if (!r) {
      /* it may have run: prev stays, and the next round's script answers
       * 0 (same value) or a conflict carrying the applied value */
      fail_entry(f, st, en, xcode ? xcode : TALLY_EREMOTE);
    } else if (r->type == REDIS_REPLY_INTEGER && (r->integer == 1 || r->integer == 0)) {
      if (r->integer == 1) {
        st->flushed++;
        int64_t d = en->delta;
        if (__builtin_add_overflow(st->delta, d, &st->delta))
          st->delta = d > 0 ? INT64_MAX : INT64_MIN;
      } else {
        st->already++;
      }
      en->pinc = en->inc;
      en->prev = en->cur;
      en->confirmed = false;
    } else if (r->type == REDIS_REPLY_STRING && parse_field(r->str, r->len, &inc, &cur)) {
      st->conflicts++;
      en->pinc = inc;
      en->prev = cur;
      confirm(f, st, en);
    } else {
      bad_reply(f, st, en, "EVAL", r);
    }
    en->pending = false;
  }
  return 0;
}

int tally_flusher_run(tally_flusher *f, const char *pattern, size_t plen,
                      tally_flush_stats *st) {
  tally_flush_stats dummy;
  if (!st) st = &dummy;
  memset(st, 0, sizeof *st);
  if (!f) return tally_error_set(TALLY_EINVAL, "redis flush: NULL flusher");
  if (!pattern) {
    pattern = "*";
    plen = 1;
  }
  f->first_code = 0;
  f->first_msg[0] = '\0';
  f->nlen = 0;
  f->round++;
  maybe_verify(f);
  /* before listing: a counter created from now on is held until shipped */
  int code = tally_store_ship(f->local, f->writer, f->wlen, pattern, plen);
  if (!code) code = tally_store_each(f->local, pattern, plen, collect, f);
  if (code) {
    st->entries = f->n;
    return code;
  }

  /* local values */
  for (size_t off = 0; off < f->nlen;) {
    uint32_t len;
    memcpy(&len, f->nbuf + off, sizeof len);
    const char *name = f->nbuf + off + sizeof len;
    off += sizeof len + len;
    struct entry *en = entry_get(f, name, len);
    if (!en) {
      for (uint32_t i = 0; i < f->n; i++) f->ents[i].pending = false;
      st->entries = f->n;
      return TALLY_ENOMEM;
    }
    en->pending = false;
    /* a handle whose counter was dropped is opened again by name, once:
     * a counter created again is a new incarnation, flushed this round */
    for (int attempt = 0; attempt < 2; attempt++) {
      if (!en->c) {
        code = tally_counter_open(f->local, name, len, NULL, 0, &en->c);
        if (code) break;
      }
      code = tally_counter_read(en->c, &en->cur, &en->inc);
      if (code != TALLY_EDROPPED) break;
      tally_counter_close(en->c);
      en->c = NULL;
    }
    if (code == TALLY_ENOENT || code == TALLY_EDROPPED) continue; /* gone since listed */
    if (code) {
      note_fail(f, code);
      st->errors++;
      en->seen = f->round; /* not known to be gone: kept */
      continue;
    }
    if (en->inc == 0) continue; /* expired since listed */
    en->seen = f->round;
    en->pending = true;
    st->counters++;
  }

  code = phase_hget(f, st);
  if (!code) code = phase_eval(f, st);
  forget_gone(f, pattern, plen);
  st->entries = f->n;
  if (code) return code; /* ENOMEM adding to the pipeline */
  if (f->first_code) return tally_error_set(f->first_code, "%s", f->first_msg);
  return 0;
}

int tally_flusher_remote_value(tally_flusher *f, const char *name, size_t len,
                               int64_t *out) {
  if (!f || !out) return tally_error_set(TALLY_EINVAL, "redis flush: NULL argument");
  char key[KEY_MAX];
  tally_rc_pipe_reset(f->pipe);
  for (uint32_t i = 0; i < f->shards; i++) {
    int klen = tally_flusher_shard_key(name, len, i, key, sizeof key);
    if (klen < 0) return klen;
    const char *argv[] = {"HGET", key, "v"};
    size_t lens[] = {4, (size_t)klen, 1};
    int code = tally_rc_pipe_add(f->pipe, key, (size_t)klen, 3, argv, lens);
    if (code) return code;
  }
  int code = tally_rc_pipe_exec(f->pipe);
  if (code) {
    tally_rc_pipe_reset(f->pipe);
    return code;
  }
  int64_t sum = 0;
  for (uint32_t i = 0; i < f->shards && !code; i++) {
    const redisReply *r = tally_rc_pipe_reply(f->pipe, i);
    int64_t v = 0;
    if (r->type == REDIS_REPLY_NIL) continue;
    if (r->type != REDIS_REPLY_STRING || !parse_i64(r->str, r->len, &v))
      code = tally_error_set(
          TALLY_EREMOTE, "redis flush: HGET tally:{%.*s#%" PRIu32 "} v: %s", (int)len,
          name, i, r->type == REDIS_REPLY_ERROR ? r->str : "not an integer");
    else if (__builtin_add_overflow(sum, v, &sum))
      code =
          tally_error_set(TALLY_ERANGE, "redis flush: %.*s: remote total overflows int64",
                          (int)len, name);
  }
  tally_rc_pipe_reset(f->pipe);
  if (!code) *out = sum;
  return code;
}
