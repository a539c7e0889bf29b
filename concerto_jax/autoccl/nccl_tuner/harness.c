/* Test harness for the tuner plugin, no GPU needed: dlopen it and call it as NCCL would.
 *
 * Query mode:  harness <plugin.so> [v3|v4] <nranks> (<collective> <nBytes>)...
 *   One line per query: "<coll> <bytes> rc=<rc> algo=<a> proto=<p> channels=<n>"
 *   (algo/proto "default" when no cell was set to 0.0; channels -1 when unchanged).
 *   The argument "sleep:<ms>" between queries pauses (lets a test rewrite the table).
 *
 * Stress mode: harness <plugin.so> stress <table> <seconds> <readers> [first_generation]
 *   A writer thread keeps replacing the table: valid tables g = first_generation, first_generation+1, ...
 *   (written to a temporary file and renamed over the path) alternating with invalid ones: a
 *   malformed rule, no end line, garbage, half a table written in place (truncated first), the
 *   first half of another same-layout table written in place WITHOUT truncation (so the old end
 *   line and count are still there: only the checksum tells), a version 2 table (no checksum),
 *   the file deleted. Every valid table g answers every query with channels = g,
 *   algorithm = g % 2, protocol = g % 3; invalid tables answer channels = INVALID_CH (never a
 *   generation) or a flipped algorithm. <readers> threads call getCollInfo continuously (one context
 *   each, as NCCL has one per communicator, plus one context shared by all readers) and check each
 *   answer came from one valid table, never older than the last one that context answered from
 *   (or NCCL's defaults, before that context's first load).
 *   Prints "calls=<n> bad=<n> tables_seen=<n> writes=<n> invalid_writes=<n> first_generation=<g>
 *   last_generation=<g>"; exit 0 iff bad == 0.
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "concerto_tuner_api.h"

#define NUM_ALGO 7
#define NUM_PROTO 3
#define MAX_G 1000000

static int quiet = 0;

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags; (void)file; (void)line;
  if (quiet) return;
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

static ncclTuner_v4_t* v4;
static ncclTuner_v3_t* v3;

static ncclResult_t call(void* ctx, int coll, size_t bytes, float table[NUM_ALGO][NUM_PROTO], int* channels) {
  for (int a = 0; a < NUM_ALGO; a++)
    for (int p = 0; p < NUM_PROTO; p++) table[a][p] = (a <= 1) ? 1.0f + a + 0.1f * p : -1.0f;
  *channels = -1;
  if (v4) return v4->getCollInfo(ctx, (ncclFunc_t)coll, bytes, 1, (float**)table, NUM_ALGO, NUM_PROTO, 0, channels);
  return v3->getCollInfo(ctx, (ncclFunc_t)coll, bytes, 1, (float**)table, NUM_ALGO, NUM_PROTO, channels);
}

static void chosen(float table[NUM_ALGO][NUM_PROTO], int* algo, int* proto) {
  *algo = *proto = -1;
  for (int a = 0; a < NUM_ALGO; a++)
    for (int p = 0; p < NUM_PROTO; p++)
      if (table[a][p] == 0.0f) { *algo = a; *proto = p; }
}

/* ------------------------------------------------------------------ stress */
#define INVALID_CH (MAX_G + 7) /* channels of every invalid table: never a generation */

static const char* g_path;
static int g_stop = 0;             /* atomic */
static int g_first = 1;            /* first generation written */
static long g_writes = 0, g_invalid = 0, g_last = 0;
static void* g_shared_ctx;

static uint32_t crc32_of(const char* p, size_t n) { /* zlib's CRC-32, as the plugin computes it */
  uint32_t crc = ~0u;
  for (size_t i = 0; i < n; i++) {
    crc ^= (unsigned char)p[i];
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

static void write_file(const char* path, const char* text, int atomic) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE* f = fopen(atomic ? tmp : path, "w");
  if (!f) return;
  fputs(text, f);
  fclose(f);
  if (atomic) rename(tmp, path);
}

/* Overwrites the first n bytes of path in place, without truncating: a writer caught half way
 * through rewriting the file (what follows is the previous version's bytes). */
static void overwrite_prefix(const char* path, const char* text, size_t n) {
  int fd = open(path, O_WRONLY);
  if (fd < 0) return;
  ssize_t w = write(fd, text, n);
  (void)w;
  close(fd);
}

/* A table of 120 rules (3 collectives x 40 size classes), all answering (algo, proto, channels);
 * sealed with the end line and its checksum unless seal is 0. */
static char* table_text(int tag, int algo, int proto, int channels, int seal) {
  static const char* colls[] = {"allreduce", "allgather", "reducescatter"};
  static const char* algos[] = {"tree", "ring"};
  static const char* protos[] = {"ll", "ll128", "simple"};
  size_t cap = 1 << 16, len = 0;
  char* s = malloc(cap);
  len += snprintf(s + len, cap - len, "concerto-tuner-table 3\n# generation %d\n", tag);
  int n = 0;
  for (int c = 0; c < 3; c++)
    for (int k = 0; k < 40; k++) { /* 40 size classes per collective: a long table, slow to parse */
      unsigned long long lo = k == 0 ? 0 : (1ULL << k), hi = (1ULL << (k + 1)) - 1;
      len += snprintf(s + len, cap - len, "%s %llu %llu * * %s %s %d\n", colls[c], lo, hi, algos[algo],
                      protos[proto], channels);
      n++;
    }
  if (seal) snprintf(s + len, cap - len, "end %d crc32=%08x\n", n, crc32_of(s, len));
  return s;
}

/* Valid table g: every query answers channels = g, algorithm = g % 2, protocol = g % 3. */
static char* valid_table(int g) { return table_text(g, g % 2, g % 3, g, 1); }

/* Seals a hand-written body (header and rules) with its end line and checksum. */
static char* sealed(const char* body, int n_rules) {
  size_t len = strlen(body);
  char* s = malloc(len + 64);
  snprintf(s, len + 64, "%send %d crc32=%08x\n", body, n_rules, crc32_of(body, len));
  return s;
}

static void* writer(void* arg) {
  (void)arg;
  int g = g_first - 1;
  char inv[64];
  snprintf(inv, sizeof inv, "%d", INVALID_CH);
  while (!__atomic_load_n(&g_stop, __ATOMIC_RELAXED) && g < MAX_G - 1) {
    g++;
    char* s = valid_table(g);
    write_file(g_path, s, 1);
    __atomic_store_n(&g_last, g, __ATOMIC_RELAXED);
    g_writes++;
    usleep(200);
    char body[512];
    switch (g % 7) { /* then an invalid version */
      case 0: { /* a malformed rule in a sealed table */
        snprintf(body, sizeof body, "concerto-tuner-table 3\nallreduce 0 99999999999 * * ring ll %s\nbogus\n", inv);
        char* t = sealed(body, 2);
        write_file(g_path, t, 1);
        free(t);
        break;
      }
      case 1: /* no end line */
        snprintf(body, sizeof body, "concerto-tuner-table 3\nallreduce 0 99999999999 * * tree simple %s\n", inv);
        write_file(g_path, body, 1);
        break;
      case 2: write_file(g_path, "\x01\x02 garbage \xff\n", 1); break;
      case 3: { /* half of a valid-looking table written in place (truncated first): no end line */
        char* bad = table_text(g, 1, 0, INVALID_CH, 1);
        bad[strlen(bad) / 2] = '\0';
        write_file(g_path, bad, 0);
        free(bad);
        break;
      }
      case 4: { /* in place, no truncation: the first half of a same-layout table whose rules no valid
                   table has (algorithm flipped); the rest, end line included, is table g's */
        char* bad = table_text(g, (g + 1) % 2, g % 3, g, 1);
        overwrite_prefix(g_path, bad, strlen(bad) / 2);
        free(bad);
        break;
      }
      case 5: /* the version 2 format: no checksum */
        snprintf(body, sizeof body, "concerto-tuner-table 2\nallreduce 0 99999999999 * * ring ll %s\nend 1\n", inv);
        write_file(g_path, body, 1);
        break;
      default: unlink(g_path); break;
    }
    g_invalid++;
    g_writes++;
    usleep(200);
    free(s);
  }
  return NULL;
}

typedef struct { long calls, bad; char* seen; } reader_stats_t;

static void* reader(void* arg) {
  reader_stats_t* st = (reader_stats_t*)arg;
  void* own = NULL;
  v4 ? v4->init(8, 1, logger, &own) : v3->init(8, 1, logger, &own);
  static const int colls[] = {ncclFuncAllReduce, ncclFuncAllGather, ncclFuncReduceScatter};
  unsigned seed = (unsigned)(size_t)arg;
  int last_g[2] = {0, 0}; /* per context: the generation last answered (0: NCCL's defaults so far) */
  while (!__atomic_load_n(&g_stop, __ATOMIC_RELAXED)) {
    int which = (int)(st->calls & 1);
    void* ctx = which ? own : g_shared_ctx;
    float table[NUM_ALGO][NUM_PROTO];
    int channels, algo, proto;
    int k = rand_r(&seed) % 40;
    size_t span = (size_t)1 << k; /* size class k: [2^k, 2^(k+1)) */
    size_t bytes = (k == 0) ? 1 : span + (size_t)rand_r(&seed) % span;
    ncclResult_t rc = call(ctx, colls[rand_r(&seed) % 3], bytes, table, &channels);
    chosen(table, &algo, &proto);
    st->calls++;
    int ok;
    if (channels == -1) /* defaults: only before the context's first good load */
      ok = rc == ncclSuccess && algo == -1 && last_g[which] == 0;
    else /* one valid table, and never an older one than this context answered before */
      ok = rc == ncclSuccess && channels >= 1 && channels < MAX_G && algo == channels % 2 &&
           proto == channels % 3 && channels >= last_g[which];
    if (!ok) {
      if (st->bad < 5)
        fprintf(stderr, "BAD answer: rc=%d channels=%d algo=%d proto=%d (context %s, last generation %d)\n", (int)rc,
                channels, algo, proto, which ? "own" : "shared", last_g[which]);
      st->bad++;
    } else if (channels > 0) {
      last_g[which] = channels;
      st->seen[channels] = 1;
    }
  }
  v4 ? v4->destroy(own) : v3->destroy(own);
  return NULL;
}

static int stress(const char* table, double seconds, int n_readers) {
  g_path = table;
  quiet = 1;
  unlink(table);
  setenv(CONCERTO_TUNER_TABLE_ENV, table, 1);
  (v4 ? v4->init(8, 1, logger, &g_shared_ctx) : v3->init(8, 1, logger, &g_shared_ctx));
  pthread_t w, r[64];
  reader_stats_t st[64];
  if (n_readers > 64) n_readers = 64;
  for (int i = 0; i < n_readers; i++) {
    memset(&st[i], 0, sizeof st[i]);
    st[i].seen = calloc(MAX_G, 1);
    pthread_create(&r[i], NULL, reader, &st[i]);
  }
  pthread_create(&w, NULL, writer, NULL);
  usleep((useconds_t)(seconds * 1e6));
  __atomic_store_n(&g_stop, 1, __ATOMIC_RELAXED);
  pthread_join(w, NULL);
  long calls = 0, bad = 0, seen = 0;
  char* any = calloc(MAX_G, 1);
  for (int i = 0; i < n_readers; i++) {
    pthread_join(r[i], NULL);
    calls += st[i].calls;
    bad += st[i].bad;
    for (int g = 0; g < MAX_G; g++) any[g] |= st[i].seen[g];
    free(st[i].seen);
  }
  for (int g = 0; g < MAX_G; g++) seen += any[g];
  free(any);
  (v4 ? v4->destroy(g_shared_ctx) : v3->destroy(g_shared_ctx));
  printf("calls=%ld bad=%ld tables_seen=%ld writes=%ld invalid_writes=%ld first_generation=%d last_generation=%ld\n",
         calls, bad, seen, g_writes, g_invalid, g_first, g_last);
  return bad == 0 ? 0 : 1;
}

/* ------------------------------------------------------------------- main */
int main(int argc, char** argv) {
  static const char* algos[] = {"tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat"};
  static const char* protos[] = {"ll", "ll128", "simple"};
  if (argc < 3) { fprintf(stderr, "usage: %s plugin.so v3|v4 nranks [coll bytes]... | stress ...\n", argv[0]); return 2; }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) { fprintf(stderr, "dlopen failed: %s\n", dlerror()); return 3; }
  v4 = (ncclTuner_v4_t*)dlsym(lib, "ncclTunerPlugin_v4");
  v3 = (ncclTuner_v3_t*)dlsym(lib, "ncclTunerPlugin_v3");
  if (!v4 || !v3) { fprintf(stderr, "symbol ncclTunerPlugin_v4 or _v3 missing\n"); return 4; }
  if (!strcmp(argv[2], "stress")) {
    if (argc != 6 && argc != 7) {
      fprintf(stderr, "usage: %s plugin.so stress table seconds readers [first_generation]\n", argv[0]);
      return 2;
    }
    if (argc == 7) g_first = atoi(argv[6]);
    if (g_first < 1 || g_first >= MAX_G) { fprintf(stderr, "first_generation must be in [1, %d)\n", MAX_G); return 2; }
    return stress(argv[3], atof(argv[4]), atoi(argv[5]));
  }
  if (!strcmp(argv[2], "v3")) v4 = NULL;
  size_t nranks = argc > 3 ? strtoull(argv[3], NULL, 10) : 8;
  void* ctx = NULL;
  ncclResult_t rc0 = v4 ? v4->init(nranks, 1, logger, &ctx) : v3->init(nranks, 1, logger, &ctx);
  if (rc0 != ncclSuccess) { fprintf(stderr, "init failed\n"); return 5; }
  printf("name=%s\n", v4 ? v4->name : v3->name);
  fflush(stdout);
  for (int i = 4; i < argc;) {
    if (!strncmp(argv[i], "sleep:", 6)) { usleep(1000 * atoi(argv[i] + 6)); i++; continue; }
    if (i + 1 >= argc) break;
    float table[NUM_ALGO][NUM_PROTO];
    int channels, a, p;
    size_t bytes = strtoull(argv[i + 1], NULL, 10);
    ncclResult_t rc = call(ctx, coll_of(argv[i]), bytes, table, &channels);
    chosen(table, &a, &p);
    printf("%s %zu rc=%d algo=%s proto=%s channels=%d\n", argv[i], bytes, (int)rc, a < 0 ? "default" : algos[a],
           p < 0 ? "default" : protos[p], channels);
    fflush(stdout);
    i += 2;
  }
  v4 ? v4->destroy(ctx) : v3->destroy(ctx);
  dlclose(lib);
  return 0;
}
