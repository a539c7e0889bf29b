/* Our own declaration of the NCCL tuner-plugin ABI, version 3 (NCCL >= 2.22).
 *
 * Written from NCCL's documented interface (ext-tuner / tuner_v3): only the
 * types a v3 tuner needs. NCCL looks up the exported symbol
 * "ncclTunerPlugin_v3" (an ncclTuner_v3_t) in the library named by
 * NCCL_TUNER_PLUGIN. The cost table passed to getCollInfo is a contiguous
 * float[numAlgo][numProto] array (passed as float**); NCCL marks unusable
 * (algorithm, protocol) cells with -1.0 and picks the cheapest cell.
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

/* Subsystem flag used for our messages. */
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

/* Algorithm and protocol indices of the cost table. */
#define CONCERTO_ALGO_TREE 0
#define CONCERTO_ALGO_RING 1
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

/* Alias with the name used in our design notes. */
typedef ncclTuner_v3_t ncclTunerPlugin_v3_t;

#define CONCERTO_TUNER_TABLE_ENV "CONCERTO_NCCL_TUNER_TABLE"

#endif /* CONCERTO_TUNER_API_H_ */
