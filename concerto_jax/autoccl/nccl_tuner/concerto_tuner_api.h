/* Our own declaration of the NCCL tuner-plugin ABI, versions 3 and 4.
 *
 * Written from NCCL's documented interface (ext-tuner, tuner_v3.h /
 * tuner_v4.h): only the types a tuner needs. NCCL dlopens the library named
 * by NCCL_TUNER_PLUGIN and looks up the newest symbol it knows, falling back
 * to older ones: "ncclTunerPlugin_v4" (NCCL >= 2.24: getCollInfo gains
 * `regBuff`) and "ncclTunerPlugin_v3" (NCCL >= 2.22). Current NCCL releases
 * (2.27/2.28, tuner v5..v7) still load v4 and v3 plugins, so exporting both
 * covers every NCCL a jax-cuda12/13 wheel ships.
 *
 * The cost table passed to getCollInfo is a contiguous float[numAlgo][numProto]
 * array (passed as float**); NCCL marks unusable (algorithm, protocol) cells
 * with -1.0 and picks the cheapest cell. A plugin may set nothing, or an
 * algorithm *and* a protocol, and/or nChannels.
 */
#ifndef CONCERTO_TUNER_API_H_
#define CONCERTO_TUNER_API_H_

#include <stddef.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3, NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

/* Subsystem flag used for our messages (NCCL_TUNING). */
#define CONCERTO_NCCL_TUNING_FLAG 0x40UL

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);

typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4,
  ncclFuncSendRecv = 5,
  ncclFuncSend = 6,
  ncclFuncRecv = 7
} ncclFunc_t;
#define CONCERTO_NUM_FUNCS 5 /* collectives a tuner is asked about (SendRecv excluded) */

/* Algorithm and protocol indices of the cost table (NCCL_ALGO_*, NCCL_PROTO_*). */
#define CONCERTO_ALGO_TREE 0
#define CONCERTO_ALGO_RING 1
#define CONCERTO_ALGO_COLLNET_DIRECT 2
#define CONCERTO_ALGO_COLLNET_CHAIN 3
#define CONCERTO_ALGO_NVLS 4
#define CONCERTO_ALGO_NVLS_TREE 5
#define CONCERTO_ALGO_PAT 6
#define CONCERTO_PROTO_LL 0
#define CONCERTO_PROTO_LL128 1
#define CONCERTO_PROTO_SIMPLE 2
#define CONCERTO_ALGO_PROTO_IGNORE (-1.0f)

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v3_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void** context);
  ncclResult_t (*getCollInfo)(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float** collCostTable, int numAlgo, int numProto, int regBuff,
                              int* nChannels);
  ncclResult_t (*destroy)(void* context);
} ncclTuner_v4_t;

/* Path of the live table. */
#define CONCERTO_TUNER_TABLE_ENV "CONCERTO_NCCL_TUNER_TABLE"
/* Minimum microseconds between two checks of the table file (default 0: every call). */
#define CONCERTO_TUNER_POLL_ENV "CONCERTO_NCCL_TUNER_POLL_US"
/* Microseconds during which a just-modified table file is read again even if its identity
 * (inode, size, mtime, ctime) did not change (default 25000; raise it on file systems with
 * coarse timestamps, e.g. 2000000 for 1-second ones). */
#define CONCERTO_TUNER_RACY_ENV "CONCERTO_NCCL_TUNER_RACY_US"
/* set (non-empty, not "0"): one INFO line per getCollInfo call (what NCCL asked, what we answered) */
#define CONCERTO_TUNER_TRACE_ENV "CONCERTO_NCCL_TUNER_TRACE"

#endif /* CONCERTO_TUNER_API_H_ */
