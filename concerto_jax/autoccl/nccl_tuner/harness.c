/* Test harness: dlopen a v3 tuner plugin, query it, print the chosen cell.
 * usage: harness <plugin.so> <collective> <nBytes> [<collective> <nBytes> ...]
 * Prints one line per query: "<coll> <bytes> algo=<a> proto=<p> channels=<n>"
 * (algo/proto "default" when no cell was set to 0.0; channels -1 when unchanged).
 */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "concerto_tuner_api.h"

#define NUM_ALGO 7
#define NUM_PROTO 3

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags; (void)file; (void)line;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[log %d] ", (int)level);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

static int coll_of(const char* s) {
  if (!strcmp(s, "allreduce")) return ncclFuncAllReduce;
  if (!strcmp(s, "allgather")) return ncclFuncAllGather;
  if (!strcmp(s, "reducescatter")) return ncclFuncReduceScatter;
  if (!strcmp(s, "broadcast")) return ncclFuncBroadcast;
  return ncclFuncReduce;
}

int main(int argc, char** argv) {
  static const char* algos[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
  static const char* protos[] = {"ll", "ll128", "simple"};
  if (argc < 2) { fprintf(stderr, "usage: %s plugin.so [coll bytes]...\n", argv[0]); return 2; }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "dlopen failed: %s\n", dlerror()); return 3; }
  ncclTuner_v3_t* t = (ncclTuner_v3_t*)dlsym(lib, "ncclTunerPlugin_v3");
  if (!t) { fprintf(stderr, "symbol ncclTunerPlugin_v3 missing\n"); return 4; }
  void* ctx = NULL;
  if (t->init(8, 1, logger, &ctx) != ncclSuccess) { fprintf(stderr, "init failed\n"); return 5; }
  printf("name=%s\n", t->name);
  for (int i = 2; i + 1 < argc; i += 2) {
    float table[NUM_ALGO][NUM_PROTO];
    for (int a = 0; a < NUM_ALGO; a++)
      for (int p = 0; p < NUM_PROTO; p++) table[a][p] = (a <= 1) ? 1.0f + a + 0.1f * p : -1.0f;
    int channels = -1;
    size_t bytes = strtoull(argv[i + 1], NULL, 10);
    ncclResult_t rc = t->getCollInfo(ctx, (ncclFunc_t)coll_of(argv[i]), bytes, 1, (float**)table, NUM_ALGO,
                                     NUM_PROTO, &channels);
    const char *algo = "default", *proto = "default";
    for (int a = 0; a < NUM_ALGO; a++)
      for (int p = 0; p < NUM_PROTO; p++)
        if (table[a][p] == 0.0f) { algo = algos[a]; proto = protos[p]; }
    printf("%s %zu rc=%d algo=%s proto=%s channels=%d\n", argv[i], bytes, (int)rc, algo, proto, channels);
  }
  t->destroy(ctx);
  dlclose(lib);
  return 0;
}
