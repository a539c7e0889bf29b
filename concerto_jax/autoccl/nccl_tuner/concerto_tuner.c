/* concerto_jax NCCL tuner plugin (API v3): answers getCollInfo from a table file.
 *
 * Table: path in $CONCERTO_NCCL_TUNER_TABLE; one rule per line,
 *   <collective> <min_bytes> <max_bytes> <algorithm> <protocol> <channels>
 * collective: allreduce|allgather|reducescatter|broadcast|reduce|*
 * algorithm: ring|tree   protocol: ll|ll128|simple   channels: >0 sets nChannels, 0 keeps NCCL's.
 * '#' starts a comment. The first rule with min_bytes <= nBytes <= max_bytes wins.
 * Any malformed line rejects the whole table (warning; NCCL defaults apply).
 * A missing variable or file also leaves NCCL's defaults. Never aborts.
 *
 * References: AutoCCL NSDI'25 §5 (per-collective configuration inside NCCL).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "concerto_tuner_api.h"

#define MAX_RULES 4096

typedef struct {
  int coll; /* ncclFunc_t, or -1 for any */
  size_t min_bytes, max_bytes;
  int algo, proto, channels;
} rule_t;

typedef struct {
  ncclDebugLogger_t log;
  int n_rules;
  rule_t rules[];
} context_t;

#define LOG(ctx_log, level, ...) \
  do { if (ctx_log) (ctx_log)(level, CONCERTO_NCCL_TUNING_FLAG, __FILE__, __LINE__, __VA_ARGS__); } while (0)

static int parse_coll(const char* s) {
  if (!strcmp(s, "*")) return -1;
  if (!strcasecmp(s, "allreduce")) return ncclFuncAllReduce;
  if (!strcasecmp(s, "allgather")) return ncclFuncAllGather;
  if (!strcasecmp(s, "reducescatter")) return ncclFuncReduceScatter;
  if (!strcasecmp(s, "broadcast")) return ncclFuncBroadcast;
  if (!strcasecmp(s, "reduce")) return ncclFuncReduce;
  return -2;
}

static int parse_algo(const char* s) {
  if (!strcasecmp(s, "ring")) return CONCERTO_ALGO_RING;
  if (!strcasecmp(s, "tree")) return CONCERTO_ALGO_TREE;
  return -1;
}

static int parse_proto(const char* s) {
  if (!strcasecmp(s, "ll")) return CONCERTO_PROTO_LL;
  if (!strcasecmp(s, "ll128")) return CONCERTO_PROTO_LL128;
  if (!strcasecmp(s, "simple")) return CONCERTO_PROTO_SIMPLE;
  return -1;
}

/* Parses the table into ctx; returns 0 on success, -1 (after a warning) otherwise. */
static int load_table(context_t* ctx, const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) {
    LOG(ctx->log, NCCL_LOG_WARN, "concerto tuner: cannot open table %s (%s); using NCCL defaults", path,
        strerror(errno));
    return -1;
  }
  char line[512];
  int lineno = 0, n = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char* hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char coll[32], algo[32], proto[32], extra[8];
    unsigned long long lo, hi;
    int ch;
    int got = sscanf(line, "%31s %llu %llu %31s %31s %d %7s", coll, &lo, &hi, algo, proto, &ch, extra);
    if (got <= 0) continue; /* blank or comment */
    rule_t r;
    if (got != 6 || (r.coll = parse_coll(coll)) == -2 || (r.algo = parse_algo(algo)) < 0 ||
        (r.proto = parse_proto(proto)) < 0 || ch < 0 || lo > hi || n >= MAX_RULES) {
      LOG(ctx->log, NCCL_LOG_WARN, "concerto tuner: bad line %d in %s; ignoring the whole table", lineno, path);
      fclose(f);
      ctx->n_rules = 0;
      return -1;
    }
    r.min_bytes = (size_t)lo;
    r.max_bytes = (size_t)hi;
    r.channels = ch;
    ctx->rules[n++] = r;
  }
  fclose(f);
  ctx->n_rules = n;
  if (n == 0) {
    LOG(ctx->log, NCCL_LOG_WARN, "concerto tuner: no rule in %s; using NCCL defaults", path);
    return -1;
  }
  LOG(ctx->log, NCCL_LOG_INFO, "concerto tuner: %d rule(s) loaded from %s", n, path);
  return 0;
}

static ncclResult_t concerto_init(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context) {
  context_t* ctx = calloc(1, sizeof(context_t) + MAX_RULES * sizeof(rule_t));
  if (!ctx) return ncclSystemError;
  ctx->log = logFunction;
  const char* path = getenv(CONCERTO_TUNER_TABLE_ENV);
  if (!path || !*path) {
    LOG(logFunction, NCCL_LOG_WARN, "concerto tuner: %s not set; using NCCL defaults", CONCERTO_TUNER_TABLE_ENV);
  } else {
    load_table(ctx, path);
  }
  LOG(logFunction, NCCL_LOG_INFO, "concerto tuner: init nRanks=%zu nNodes=%zu", nRanks, nNodes);
  *context = ctx;
  return ncclSuccess;
}

static ncclResult_t concerto_get_coll_info(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                           float** collCostTable, int numAlgo, int numProto, int* nChannels) {
  (void)numPipeOps;
  context_t* ctx = (context_t*)context;
  if (!ctx || !collCostTable) return ncclSuccess;
  float* table = (float*)collCostTable; /* contiguous [numAlgo][numProto] */
  for (int i = 0; i < ctx->n_rules; i++) {
    const rule_t* r = &ctx->rules[i];
    if ((r->coll != -1 && r->coll != (int)collType) || nBytes < r->min_bytes || nBytes > r->max_bytes) continue;
    if (r->algo >= numAlgo || r->proto >= numProto) {
      LOG(ctx->log, NCCL_LOG_INFO, "concerto tuner: rule %d names a cell outside the %dx%d table; defaults", i,
          numAlgo, numProto);
      return ncclSuccess;
    }
    float* cell = &table[r->algo * numProto + r->proto];
    if (*cell == CONCERTO_ALGO_PROTO_IGNORE) {
      LOG(ctx->log, NCCL_LOG_INFO, "concerto tuner: rule %d cell (%d,%d) unavailable here; defaults", i, r->algo,
          r->proto);
      return ncclSuccess;
    }
    *cell = 0.0f;
    if (r->channels > 0 && nChannels) *nChannels = r->channels;
    return ncclSuccess;
  }
  return ncclSuccess;
}

static ncclResult_t concerto_destroy(void* context) {
  free(context);
  return ncclSuccess;
}

__attribute__((visibility("default"))) const ncclTuner_v3_t ncclTunerPlugin_v3 = {
    .name = "concerto_jax",
    .init = concerto_init,
    .getCollInfo = concerto_get_coll_info,
    .destroy = concerto_destroy,
};
