/* concerto_jax NCCL tuner plugin (API v3 and v4): answers getCollInfo from a *live* table file.
 *
 * Table: path in $CONCERTO_NCCL_TUNER_TABLE. Format (version 3):
 *   concerto-tuner-table 3                       first non-comment line
 *   <coll> <min_bytes> <max_bytes> <nranks> <occ> <algorithm> <protocol> <channels>   one rule a line
 *   end <number of rules> crc32=<8 hex digits>   last line, ends with a newline
 * crc32: CRC-32 (zlib's, as Python's zlib.crc32) of every byte of the file before the end line
 *   (header, comments, blank lines, rules, their newlines). With the rule count it makes the table
 *   self-validating: a prefix of a table has no end line, and a file mixing two versions (an in-place
 *   writer that did not truncate, or was caught half way) fails the checksum.
 * coll: allreduce|allgather|reducescatter|broadcast|reduce|*
 * nranks: communicator size the rule applies to, or * for any.
 * occ: k/p = only the k-th (0-based, modulo p) call of this collective type and size
 *   class (floor(log2(nBytes))) on this communicator since the table was loaded; * for all.
 *   This is how repeated same-size collectives of one step get different settings.
 * algorithm: tree|ring|collnet_direct|collnet_chain|nvls|nvls_tree|pat|*   protocol: ll|ll128|simple|*
 *   (both * = keep NCCL's choice; one * alone is an error, as the NCCL API requires both or none).
 * channels: > 0 sets nChannels, 0 keeps NCCL's.
 * '#' starts a comment. The first matching rule wins.
 *
 * Live: every getCollInfo (or at most every $CONCERTO_NCCL_TUNER_POLL_US microseconds) stats the
 * path; when (device, inode, size, mtime, ctime) changed, one thread (trylock; the others go on with
 * the current table) opens the file, takes its identity with fstat, reads it whole, validates it
 * (header, every line, the end count and checksum) and only then publishes it with one release
 * store. A reader does one acquire load per call, so it sees one whole table. Replaced tables are
 * kept until destroy (never freed while a reader may hold them).
 * "Racy" files: a file whose mtime/ctime is within $CONCERTO_NCCL_TUNER_RACY_US (default
 * DEFAULT_RACY_NS) of the moment it was read may still be
 * changed without its identity changing (coarse file timestamps, inode numbers reused by the next
 * rename of a same-size table). Such a file is read again at the next look until it is older than
 * that (at most every RACY_RECHECK_NS); content identical to what was read last (same CRC and
 * length) is then ignored (no second warning, no reload).
 * A bad or vanished table keeps the last good one (one warning per file version); with no good
 * table ever loaded, NCCL's own choices apply. Never aborts.
 *
 * Writers should write a temporary file and rename(2) it over the path (atomic); an in-place writer
 * is safe too (its partial or mixed states are rejected), only slower to be picked up.
 *
 * References: AutoCCL NSDI'25 §5 (per-collective configuration inside NCCL, changed online).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "concerto_tuner_api.h"

#define MAX_RULES 65536
#define SIZE_CLASSES 64
#define ANY (-1)
#define TABLE_VERSION 3
#define MAX_TABLE_BYTES (16 << 20)
#define DEFAULT_RACY_NS 25000000LL /* 25 ms: above coarse file timestamp granularity (one jiffy, <= 10 ms) */
#define RACY_RECHECK_NS 1000000LL  /* a racy file is read again at most every 1 ms */

typedef struct {
  int coll;                        /* ncclFunc_t or ANY */
  unsigned long long lo, hi;       /* inclusive byte range */
  int nranks;                      /* or ANY */
  int occ, period;                 /* period 0 = any occurrence */
  int algo, proto;                 /* ANY = keep NCCL's */
  int channels;                    /* 0 = keep NCCL's */
} rule_t;

typedef struct table {
  struct table* retired_next;      /* list of replaced tables, freed in destroy */
  unsigned long long counters[CONCERTO_NUM_FUNCS * SIZE_CLASSES]; /* calls per (coll, class) */
  int n_rules;
  rule_t rules[];
} table_t;

typedef struct {
  dev_t dev; ino_t ino; off_t size;
  long long mtime_ns, ctime_ns;
  int exists;
} file_id_t;

typedef struct {
  ncclDebugLogger_t log;
  size_t n_ranks;
  char* path;                      /* NULL: no table configured */
  long long poll_ns;
  long long racy_ns;               /* a file modified this recently is read again */
  table_t* current;                /* atomic; NULL = NCCL defaults */
  table_t* retired;                /* guarded by lock */
  pthread_mutex_t lock;            /* one reloader at a time */
  file_id_t seen;                  /* guarded by lock: identity of the file last read (fstat) */
  int seen_racy;                   /* guarded by lock: read again (at most every RACY_RECHECK_NS) */
  long long racy_read_ns;          /* guarded by lock: when a racy file was read last */
  uint32_t seen_crc;               /* guarded by lock: CRC-32 and length of the bytes last read */
  size_t seen_len;
  long long last_check_ns;         /* atomic */
  unsigned long long reloads, rejects; /* guarded by lock */
  int trace;                       /* CONCERTO_NCCL_TUNER_TRACE: log every call */
} context_t;

#define LOG(ctx, level, ...) \
  do { if ((ctx)->log) (ctx)->log(level, CONCERTO_NCCL_TUNING_FLAG, __FILE__, __LINE__, __VA_ARGS__); } while (0)

static const char* const kAlgos[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
static const char* const kProtos[] = {"ll", "ll128", "simple"};
static const char* const kColls[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};

static int lookup(const char* s, const char* const* names, int n) {
  if (!strcmp(s, "*")) return ANY;
  for (int i = 0; i < n; i++)
    if (!strcasecmp(s, names[i])) return i;
  return -2;
}

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int size_class(size_t n) {
  int c = 0;
  while (n > 1 && c < SIZE_CLASSES - 1) { n >>= 1; c++; }
  return c;
}

static long long realtime_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static file_id_t id_of(const struct stat* s) {
  file_id_t id;
  memset(&id, 0, sizeof id);
  const struct stat st = *s;
  id.exists = 1;
  id.dev = st.st_dev; id.ino = st.st_ino; id.size = st.st_size;
  id.mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
  id.ctime_ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
  return id;
}

static file_id_t file_id(const char* path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    file_id_t none;
    memset(&none, 0, sizeof none);
    return none;
  }
  return id_of(&st);
}

/* CRC-32 (IEEE 802.3 polynomial, reflected; the same as zlib.crc32), one table lookup a byte. */
static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    crc_table[i] = c;
  }
}

static uint32_t crc32_update(uint32_t crc, const char* p, size_t n) {
  pthread_once(&crc_once, crc_init);
  crc = ~crc;
  for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ (unsigned char)p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

static int same_id(const file_id_t* a, const file_id_t* b) {
  return a->exists == b->exists && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
         a->mtime_ns == b->mtime_ns && a->ctime_ns == b->ctime_ns;
}

static int parse_rule(char* line, rule_t* r) {
  char coll[32], nranks[16], occ[32], algo[32], proto[32], extra[8];
  unsigned long long lo, hi;
  int ch;
  int got = sscanf(line, "%31s %llu %llu %15s %31s %31s %31s %d %7s", coll, &lo, &hi, nranks, occ, algo,
                   proto, &ch, extra);
  if (got != 8) return -1;
  if ((r->coll = lookup(coll, kColls, CONCERTO_NUM_FUNCS)) == -2) return -1;
  if ((r->algo = lookup(algo, kAlgos, 7)) == -2 || (r->proto = lookup(proto, kProtos, 3)) == -2) return -1;
  if ((r->algo == ANY) != (r->proto == ANY)) return -1;
  if (lo > hi || ch < 0) return -1;
  r->lo = lo; r->hi = hi; r->channels = ch;
  if (!strcmp(nranks, "*")) r->nranks = ANY;
  else if (sscanf(nranks, "%d%7s", &r->nranks, extra) != 1 || r->nranks < 1) return -1;
  if (!strcmp(occ, "*")) { r->occ = 0; r->period = 0; }
  else if (sscanf(occ, "%d/%d%7s", &r->occ, &r->period, extra) != 2 || r->period < 1 || r->occ < 0 ||
           r->occ >= r->period) return -1;
  return 0;
}

static const char kVanished[] = "file vanished";

typedef struct {
  char* data;
  size_t len;
  file_id_t id;                    /* fstat of the descriptor that was read */
} file_bytes_t;

/* Opens, fstats and reads the whole file (what a concurrent writer leaves there may be anything:
 * the parser decides). 0 on success; -1 with *why set otherwise. */
static int read_whole(const char* path, file_bytes_t* out, const char** why) {
  memset(out, 0, sizeof *out);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) { *why = errno == ENOENT ? kVanished : "cannot open the file"; return -1; }
  struct stat st;
  if (fstat(fd, &st) != 0) { close(fd); *why = "cannot stat the file"; return -1; }
  out->id = id_of(&st);
  size_t cap = st.st_size > 0 && st.st_size < MAX_TABLE_BYTES ? (size_t)st.st_size + 1 : 4096;
  out->data = malloc(cap);
  *why = NULL;
  while (out->data) {
    if (out->len == cap) {
      if (cap >= MAX_TABLE_BYTES) { *why = "file too large"; break; }
      char* bigger = realloc(out->data, cap * 2);
      if (!bigger) break;
      out->data = bigger;
      cap *= 2;
    }
    ssize_t got = read(fd, out->data + out->len, cap - out->len);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) { *why = "read error"; break; }
    if (got == 0) break;
    out->len += (size_t)got;
  }
  close(fd);
  if (!out->data && !*why) *why = "out of memory";
  if (*why) { free(out->data); out->data = NULL; return -1; }
  return 0;
}

/* Parses and validates a whole table (bytes of one read of the file); NULL (and *why set) when
 * anything is wrong: header, any rule, the end line (count, checksum), text after it. */
static table_t* parse_table(const char* data, size_t len, const char** why, int* bad_line) {
  *bad_line = 0;
  *why = NULL;
  if (memchr(data, '\0', len)) { *why = "NUL byte in the file (garbage or a hole from a concurrent writer)"; return NULL; }
  table_t* t = calloc(1, sizeof(table_t) + 64 * sizeof(rule_t));
  int cap = 64, lineno = 0, header = 0, ended = 0;
  char line[512];
  size_t pos = 0;
  while (t && pos < len) {
    const char* start = data + pos;
    const char* nl = memchr(start, '\n', len - pos);
    lineno++;
    if (!nl) { *why = "last line has no newline (truncated or half-written file)"; break; }
    size_t n = (size_t)(nl - start);
    if (n >= sizeof line) { *why = "line too long"; break; }
    memcpy(line, start, n);
    line[n] = '\0';
    size_t line_start = pos;
    pos += n + 1;
    if (ended) { *why = "text after the end line (a longer old table under a shorter new one?)"; break; }
    char* hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char word[32], extra[8], sum[32];
    int n_end;
    if (sscanf(line, "%31s", word) != 1) continue; /* blank or comment */
    if (!header) {
      int version;
      if (sscanf(line, "concerto-tuner-table %d %7s", &version, extra) != 1 || version != TABLE_VERSION) {
        *why = (sscanf(line, "concerto-tuner-table %d", &version) == 1 && version == 2)
                   ? "version 2 table (no checksum): write 'concerto-tuner-table 3' tables (autoccl.plugin.write_table)"
                   : "missing header 'concerto-tuner-table 3'";
        break;
      }
      header = 1;
      continue;
    }
    if (!strcmp(word, "end")) {
      if (sscanf(line, "end %d %31s %7s", &n_end, sum, extra) != 2 || n_end != t->n_rules) {
        *why = "end line count differs from the rules read"; break;
      }
      char* hex_end = NULL;
      unsigned long want = strncmp(sum, "crc32=", 6) || strlen(sum) != 14 ? 0 : strtoul(sum + 6, &hex_end, 16);
      if (!hex_end || *hex_end) { *why = "end line without 'crc32=<8 hex digits>'"; break; }
      if ((uint32_t)want != crc32_update(0, data, line_start)) {
        *why = "checksum mismatch (a partly rewritten or mixed file)"; break;
      }
      ended = 1;
      continue;
    }
    if (t->n_rules >= MAX_RULES) { *why = "too many rules"; break; }
    if (t->n_rules == cap) {
      cap *= 2;
      table_t* bigger = realloc(t, sizeof(table_t) + (size_t)cap * sizeof(rule_t));
      if (!bigger) { *why = "out of memory"; break; }
      t = bigger;
    }
    if (parse_rule(line, &t->rules[t->n_rules]) != 0) { *why = "malformed rule"; break; }
    t->n_rules++;
  }
  if (!t && !*why) *why = "out of memory";
  if (!*why && !header) *why = "empty file";
  if (!*why && !ended) *why = "no end line (truncated or half-written file)";
  if (*why) { *bad_line = lineno; free(t); return NULL; }
  return t;
}

static long long llabs_diff(long long a, long long b) { return a > b ? a - b : b - a; }

/* Re-reads the table if the file changed since the last look (or was racy then). Cheap (one stat)
 * when nothing changed. Caller: any thread; at most one reloads at a time, the others go on. */
static void maybe_reload(context_t* ctx) {
  if (!ctx->path) return;
  if (ctx->poll_ns > 0) {
    long long now = now_ns(), last = __atomic_load_n(&ctx->last_check_ns, __ATOMIC_RELAXED);
    if (now - last < ctx->poll_ns) return;
    __atomic_store_n(&ctx->last_check_ns, now, __ATOMIC_RELAXED);
  }
  if (pthread_mutex_trylock(&ctx->lock) != 0) return; /* another thread is reloading */
  file_id_t id = file_id(ctx->path);
  int changed = !same_id(&id, &ctx->seen);
  if (!changed && (!ctx->seen_racy || now_ns() - ctx->racy_read_ns < RACY_RECHECK_NS)) {
    pthread_mutex_unlock(&ctx->lock);
    return;
  }
  table_t* old = __atomic_load_n(&ctx->current, __ATOMIC_ACQUIRE);
  const char* keep = old ? "keeping the last good table" : "using NCCL defaults";
  file_bytes_t fb;
  const char* why = NULL;
  long long t_read = realtime_ns(); /* before the read: a later write gets a later timestamp */
  if (!id.exists || read_whole(ctx->path, &fb, &why) != 0) {
    if (id.exists && why == kVanished) { /* removed between stat and open */
      memset(&id, 0, sizeof id);
      changed = !same_id(&id, &ctx->seen);
    }
    if (changed) {
      if (!id.exists) LOG(ctx, NCCL_LOG_WARN, "concerto tuner: table %s missing; %s", ctx->path, keep);
      else LOG(ctx, NCCL_LOG_WARN, "concerto tuner: table %s unreadable (%s); %s", ctx->path, why, keep);
    }
    ctx->seen = id;
    ctx->seen_racy = 0;
    ctx->seen_len = (size_t)-1;
    pthread_mutex_unlock(&ctx->lock);
    return;
  }
  uint32_t crc = crc32_update(0, fb.data, fb.len);
  int same_version = same_id(&fb.id, &ctx->seen) && crc == ctx->seen_crc && fb.len == ctx->seen_len;
  long long stamp = fb.id.mtime_ns > fb.id.ctime_ns ? fb.id.mtime_ns : fb.id.ctime_ns;
  ctx->seen = fb.id;
  ctx->seen_racy = llabs_diff(t_read, stamp) < ctx->racy_ns;
  ctx->racy_read_ns = now_ns();
  ctx->seen_crc = crc;
  ctx->seen_len = fb.len;
  if (!same_version) { /* a racy re-read of the same bytes changes nothing (and warns no more) */
    int bad_line;
    table_t* t = parse_table(fb.data, fb.len, &why, &bad_line);
    if (!t) {
      ctx->rejects++;
      LOG(ctx, NCCL_LOG_WARN, "concerto tuner: table %s rejected (%s, line %d); %s", ctx->path, why, bad_line, keep);
    } else {
      __atomic_store_n(&ctx->current, t, __ATOMIC_RELEASE);
      if (old) { old->retired_next = ctx->retired; ctx->retired = old; }
      ctx->reloads++;
      LOG(ctx, NCCL_LOG_INFO, "concerto tuner: %d rule(s) loaded from %s (load %llu)", t->n_rules, ctx->path,
          ctx->reloads);
    }
  }
  free(fb.data);
  pthread_mutex_unlock(&ctx->lock);
}

static ncclResult_t concerto_init(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context) {
  context_t* ctx = calloc(1, sizeof(context_t));
  if (!ctx) return ncclSystemError;
  ctx->log = logFunction;
  ctx->n_ranks = nRanks;
  pthread_mutex_init(&ctx->lock, NULL);
  const char* path = getenv(CONCERTO_TUNER_TABLE_ENV);
  const char* poll = getenv(CONCERTO_TUNER_POLL_ENV);
  ctx->poll_ns = poll ? atoll(poll) * 1000LL : 0;
  const char* racy = getenv(CONCERTO_TUNER_RACY_ENV);
  ctx->racy_ns = racy && *racy ? atoll(racy) * 1000LL : DEFAULT_RACY_NS;
  const char* trace = getenv(CONCERTO_TUNER_TRACE_ENV);
  ctx->trace = trace && *trace && strcmp(trace, "0") != 0;
  ctx->last_check_ns = now_ns() - ctx->poll_ns - 1; /* the first call always looks */
  if (!path || !*path) {
    LOG(ctx, NCCL_LOG_WARN, "concerto tuner: %s not set; using NCCL defaults", CONCERTO_TUNER_TABLE_ENV);
  } else {
    ctx->path = strdup(path);
    ctx->seen.exists = -1; /* differs from any file state: the first look reports */
    maybe_reload(ctx);
  }
  LOG(ctx, NCCL_LOG_INFO, "concerto tuner: init nRanks=%zu nNodes=%zu", nRanks, nNodes);
  *context = ctx;
  return ncclSuccess;
}

static ncclResult_t concerto_get_coll_info_v4(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                              float** collCostTable, int numAlgo, int numProto, int regBuff,
                                              int* nChannels) {
  context_t* ctx = (context_t*)context;
  if (!ctx || !collCostTable || (int)collType < 0 || (int)collType >= CONCERTO_NUM_FUNCS) return ncclSuccess;
  maybe_reload(ctx);
  table_t* t = __atomic_load_n(&ctx->current, __ATOMIC_ACQUIRE); /* one whole table for this call */
  int matched = -1;
  const char* answer = "no table: NCCL decides";
  if (t) {
    unsigned long long occ =
        __atomic_fetch_add(&t->counters[collType * SIZE_CLASSES + size_class(nBytes)], 1ULL, __ATOMIC_RELAXED);
    float* table = (float*)collCostTable; /* contiguous [numAlgo][numProto] */
    answer = "no rule matched: NCCL decides";
    for (int i = 0; i < t->n_rules; i++) {
      const rule_t* r = &t->rules[i];
      if ((r->coll != ANY && r->coll != (int)collType) || nBytes < r->lo || nBytes > r->hi) continue;
      if (r->nranks != ANY && (size_t)r->nranks != ctx->n_ranks) continue;
      if (r->period > 0 && (int)(occ % (unsigned long long)r->period) != r->occ) continue;
      matched = i;
      answer = "rule applied";
      if (r->algo != ANY) {
        if (r->algo >= numAlgo || r->proto >= numProto) { answer = "cell not in this NCCL's table: NCCL decides"; break; }
        float* cell = &table[r->algo * numProto + r->proto];
        if (*cell == CONCERTO_ALGO_PROTO_IGNORE) { answer = "cell unavailable here: NCCL decides"; break; }
        *cell = 0.0f;
      }
      if (r->channels > 0 && nChannels) *nChannels = r->channels;
      break;
    }
  }
  if (ctx->trace)
    LOG(ctx, NCCL_LOG_INFO,
        "concerto tuner: getCollInfo %s nBytes=%zu numPipeOps=%d numAlgo=%d numProto=%d regBuff=%d -> rule %d, %s, "
        "nChannels=%d",
        kColls[collType], nBytes, numPipeOps, numAlgo, numProto, regBuff, matched, answer, nChannels ? *nChannels : -1);
  return ncclSuccess;
}

static ncclResult_t concerto_get_coll_info_v3(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                              float** collCostTable, int numAlgo, int numProto, int* nChannels) {
  return concerto_get_coll_info_v4(context, collType, nBytes, numPipeOps, collCostTable, numAlgo, numProto, 0,
                                   nChannels);
}

static ncclResult_t concerto_destroy(void* context) {
  context_t* ctx = (context_t*)context;
  if (!ctx) return ncclSuccess;
  free(ctx->current);
  for (table_t* t = ctx->retired; t;) {
    table_t* next = t->retired_next;
    free(t);
    t = next;
  }
  pthread_mutex_destroy(&ctx->lock);
  free(ctx->path);
  free(ctx);
  return ncclSuccess;
}

__attribute__((visibility("default"))) const ncclTuner_v4_t ncclTunerPlugin_v4 = {
    .name = "concerto_jax",
    .init = concerto_init,
    .getCollInfo = concerto_get_coll_info_v4,
    .destroy = concerto_destroy,
};

__attribute__((visibility("default"))) const ncclTuner_v3_t ncclTunerPlugin_v3 = {
    .name = "concerto_jax",
    .init = concerto_init,
    .getCollInfo = concerto_get_coll_info_v3,
    .destroy = concerto_destroy,
};
