/* concerto_jax NCCL tuner plugin (API v3 and v4): answers getCollInfo from a *live* table file.
 *
 * Table: path in $CONCERTO_NCCL_TUNER_TABLE. Format (version 2):
 *   concerto-tuner-table 2                       first non-comment line
 *   <coll> <min_bytes> <max_bytes> <nranks> <occ> <algorithm> <protocol> <channels>   one rule a line
 *   end <number of rules>                        last non-comment line
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
 * path; when (device, inode, size, mtime, ctime) changed, the file is parsed completely into a new
 * table, validated (header, every line, the `end` count: a half-written file fails), and only then
 * published with one atomic pointer store. A reader loads the pointer once per call, so it sees one
 * whole table. Replaced tables are kept until destroy (never freed while a reader may hold them).
 * A bad or vanished table keeps the last good one (warning once per file version); with no good
 * table ever loaded, NCCL's own choices apply. Never aborts.
 *
 * Writers should write a temporary file and rename(2) it over the path (atomic).
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

#include "concerto_tuner_api.h"

#define MAX_RULES 65536
#define SIZE_CLASSES 64
#define ANY (-1)

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
  table_t* current;                /* atomic; NULL = NCCL defaults */
  table_t* retired;                /* guarded by lock */
  pthread_mutex_t lock;            /* one reloader at a time */
  file_id_t seen;                  /* guarded by lock */
  long long last_check_ns;         /* atomic */
  unsigned long long reloads, rejects; /* guarded by lock */
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

static file_id_t file_id(const char* path) {
  file_id_t id;
  memset(&id, 0, sizeof id);
  struct stat st;
  if (stat(path, &st) != 0) return id;
  id.exists = 1;
  id.dev = st.st_dev; id.ino = st.st_ino; id.size = st.st_size;
  id.mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
  id.ctime_ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
  return id;
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

/* Parses the whole file into a new table; NULL (and *why set) when anything is wrong. */
static table_t* parse_table(const char* path, const char** why, int* bad_line) {
  *bad_line = 0;
  FILE* f = fopen(path, "r");
  if (!f) { *why = strerror(errno); return NULL; }
  table_t* t = calloc(1, sizeof(table_t) + 64 * sizeof(rule_t));
  int cap = 64, lineno = 0, header = 0, ended = 0;
  char line[512];
  *why = NULL;
  while (t && fgets(line, sizeof line, f)) {
    lineno++;
    if (!strchr(line, '\n') && !feof(f)) { *why = "line too long"; break; }
    char* hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char word[32], extra[8];
    int n_end;
    if (sscanf(line, "%31s", word) != 1) continue; /* blank or comment */
    if (ended) { *why = "text after the end line"; break; }
    if (!header) {
      int version;
      if (sscanf(line, "concerto-tuner-table %d %7s", &version, extra) != 1 || version != 2) {
        *why = "missing header 'concerto-tuner-table 2'"; break;
      }
      header = 1;
      continue;
    }
    if (!strcmp(word, "end")) {
      if (sscanf(line, "end %d %7s", &n_end, extra) != 1 || n_end != t->n_rules) {
        *why = "end line count differs from the rules read"; break;
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
  fclose(f);
  if (!t && !*why) *why = "out of memory";
  if (!*why && !header) *why = "empty file";
  if (!*why && !ended) *why = "no end line (truncated or half-written file)";
  if (*why) { *bad_line = lineno; free(t); return NULL; }
  return t;
}

/* Re-reads the table if the file changed since the last look. Cheap when nothing changed. */
static void maybe_reload(context_t* ctx) {
  if (!ctx->path) return;
  if (ctx->poll_ns > 0) {
    long long now = now_ns(), last = __atomic_load_n(&ctx->last_check_ns, __ATOMIC_RELAXED);
    if (now - last < ctx->poll_ns) return;
    __atomic_store_n(&ctx->last_check_ns, now, __ATOMIC_RELAXED);
  }
  if (pthread_mutex_trylock(&ctx->lock) != 0) return; /* another thread is reloading */
  file_id_t id = file_id(ctx->path);
  if (!same_id(&id, &ctx->seen)) {
    ctx->seen = id;
    table_t* old = __atomic_load_n(&ctx->current, __ATOMIC_ACQUIRE);
    if (!id.exists) {
      LOG(ctx, NCCL_LOG_WARN, "concerto tuner: table %s missing; %s", ctx->path,
          old ? "keeping the last good table" : "using NCCL defaults");
    } else {
      const char* why;
      int bad_line;
      table_t* t = parse_table(ctx->path, &why, &bad_line);
      if (!t) {
        ctx->rejects++;
        LOG(ctx, NCCL_LOG_WARN, "concerto tuner: table %s rejected (%s, line %d); %s", ctx->path, why, bad_line,
            old ? "keeping the last good table" : "using NCCL defaults");
      } else {
        __atomic_store_n(&ctx->current, t, __ATOMIC_RELEASE);
        if (old) { old->retired_next = ctx->retired; ctx->retired = old; }
        ctx->reloads++;
        LOG(ctx, NCCL_LOG_INFO, "concerto tuner: %d rule(s) loaded from %s (load %llu)", t->n_rules, ctx->path,
            ctx->reloads);
      }
    }
  }
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
  (void)numPipeOps; (void)regBuff;
  context_t* ctx = (context_t*)context;
  if (!ctx || !collCostTable || (int)collType < 0 || (int)collType >= CONCERTO_NUM_FUNCS) return ncclSuccess;
  maybe_reload(ctx);
  table_t* t = __atomic_load_n(&ctx->current, __ATOMIC_ACQUIRE); /* one whole table for this call */
  if (!t) return ncclSuccess;
  unsigned long long occ =
      __atomic_fetch_add(&t->counters[collType * SIZE_CLASSES + size_class(nBytes)], 1ULL, __ATOMIC_RELAXED);
  float* table = (float*)collCostTable; /* contiguous [numAlgo][numProto] */
  for (int i = 0; i < t->n_rules; i++) {
    const rule_t* r = &t->rules[i];
    if ((r->coll != ANY && r->coll != (int)collType) || nBytes < r->lo || nBytes > r->hi) continue;
    if (r->nranks != ANY && (size_t)r->nranks != ctx->n_ranks) continue;
    if (r->period > 0 && (int)(occ % (unsigned long long)r->period) != r->occ) continue;
    if (r->algo != ANY) {
      if (r->algo >= numAlgo || r->proto >= numProto) return ncclSuccess; /* not in this NCCL's table */
      float* cell = &table[r->algo * numProto + r->proto];
      if (*cell == CONCERTO_ALGO_PROTO_IGNORE) return ncclSuccess; /* unavailable here: NCCL decides */
      *cell = 0.0f;
    }
    if (r->channels > 0 && nChannels) *nChannels = r->channels;
    return ncclSuccess;
  }
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
