/* scorestack's native Triton backend: batch-library artifacts (TL2cgen, the tree kernel) served
 * without the Python backend.
 *
 * The compiler builds this file into libtriton_scorestack.so and places it in every version folder
 * whose config says `backend: "scorestack"`; Triton looks for a backend library in the version
 * folder first. A model it serves is a list of bands, each a shared library exporting the batch ABI
 * of compile/_tree_commons.py (scorestack_predict_batch / scorestack_output_shape /
 * scorestack_result_type), as the config parameter `scorestack_native` states:
 *
 *     "<output tensor> <min_rows> <artifact> <output column or -1> [<min_rows> <artifact> <column>]..."
 *
 * A joined batch of n rows runs on the last band whose min_rows <= n, exactly as the Python runtime
 * (scorestack_runtime.py) chooses. Before anything loads, every file in the version folder's
 * SHA256SUMS is checked (parameter scorestack_integrity "sha256"), as the Python runtime does.
 *
 * Why: the Python backend costs a request a round trip through shared memory to a stub process
 * (server CPU per request at 64 callers: 324 µs through it vs 179 µs through this backend, same
 * model and machine; benchmarks/REPORT.md, 2026-12-02). This library calls the
 * artifact on Triton's own instance thread. It declares the parts of Triton's C API it uses
 * (tritonbackend.h / tritonserver.h, API 1.x) instead of including them: those headers are not
 * installed on the machines that build models.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the parts of Triton's C API used here (opaque handles, enums by value) ---- */
typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;

enum { ERR_UNKNOWN = 0, ERR_INTERNAL = 1, ERR_NOT_FOUND = 2, ERR_INVALID_ARG = 3, ERR_UNAVAILABLE = 4, ERR_UNSUPPORTED = 5 };
enum { TYPE_FP32 = 11 };
enum { MEMORY_CPU = 0, MEMORY_CPU_PINNED = 1 };
enum { LOG_INFO = 0, LOG_WARN = 1, LOG_ERROR = 2 };
enum { REQUEST_RELEASE_ALL = 1, RESPONSE_COMPLETE_FINAL = 1 };
#define API_MAJOR 1u
#define API_MINOR 4u /* the newest call used here (batch statistics) is older than 1.4 */

extern TRITONSERVER_Error* TRITONSERVER_ErrorNew(int code, const char* msg);
extern void TRITONSERVER_ErrorDelete(TRITONSERVER_Error* error);
extern const char* TRITONSERVER_ErrorMessage(TRITONSERVER_Error* error);
extern TRITONSERVER_Error* TRITONSERVER_LogMessage(int level, const char* filename, int line, const char* msg);
extern TRITONSERVER_Error* TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message* message, const char** base, size_t* byte_size);
extern TRITONSERVER_Error* TRITONSERVER_MessageDelete(TRITONSERVER_Message* message);
extern TRITONSERVER_Error* TRITONBACKEND_ApiVersion(uint32_t* major, uint32_t* minor);
extern TRITONSERVER_Error* TRITONBACKEND_ModelName(TRITONBACKEND_Model* model, const char** name);
extern TRITONSERVER_Error* TRITONBACKEND_ModelVersion(TRITONBACKEND_Model* model, uint64_t* version);
extern TRITONSERVER_Error* TRITONBACKEND_ModelRepository(TRITONBACKEND_Model* model, int* artifact_type, const char** location);
extern TRITONSERVER_Error* TRITONBACKEND_ModelConfig(TRITONBACKEND_Model* model, uint32_t config_version, TRITONSERVER_Message** config);
extern TRITONSERVER_Error* TRITONBACKEND_ModelSetState(TRITONBACKEND_Model* model, void* state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelState(TRITONBACKEND_Model* model, void** state);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Model** model);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInputCount(TRITONBACKEND_Request* request, uint32_t* count);
extern TRITONSERVER_Error* TRITONBACKEND_RequestInputByIndex(TRITONBACKEND_Request* request, uint32_t index, TRITONBACKEND_Input** input);
extern TRITONSERVER_Error* TRITONBACKEND_InputProperties(TRITONBACKEND_Input* input, const char** name, int* datatype, const int64_t** shape,
                                                         uint32_t* dims_count, uint64_t* byte_size, uint32_t* buffer_count);
extern TRITONSERVER_Error* TRITONBACKEND_InputBuffer(TRITONBACKEND_Input* input, uint32_t index, const void** buffer, uint64_t* buffer_byte_size,
                                                     int* memory_type, int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseNew(TRITONBACKEND_Response** response, TRITONBACKEND_Request* request);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseOutput(TRITONBACKEND_Response* response, TRITONBACKEND_Output** output, const char* name, int datatype,
                                                        const int64_t* shape, uint32_t dims_count);
extern TRITONSERVER_Error* TRITONBACKEND_OutputBuffer(TRITONBACKEND_Output* output, void** buffer, uint64_t byte_size, int* memory_type,
                                                      int64_t* memory_type_id);
extern TRITONSERVER_Error* TRITONBACKEND_ResponseSend(TRITONBACKEND_Response* response, uint32_t send_flags, TRITONSERVER_Error* error);
extern TRITONSERVER_Error* TRITONBACKEND_RequestRelease(TRITONBACKEND_Request* request, uint32_t release_flags);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportStatistics(TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request* request, bool success,
                                                                       uint64_t exec_start_ns, uint64_t compute_start_ns, uint64_t compute_end_ns,
                                                                       uint64_t exec_end_ns);
extern TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReportBatchStatistics(TRITONBACKEND_ModelInstance* instance, uint64_t batch_size,
                                                                            uint64_t exec_start_ns, uint64_t compute_start_ns, uint64_t compute_end_ns,
                                                                            uint64_t exec_end_ns);

#define MAX_BANDS 8
#define MAX_THREADS 64
#define PARALLEL_MIN_ROWS 256 /* below this a thread costs more than it saves (as the Python runner) */
#define MSG 1024

typedef int (*predict_fn)(const float* x, int64_t n_rows, int32_t n_cols, int pred_margin, void* out);
typedef void (*shape_fn)(int64_t* shape);
typedef const char* (*type_fn)(void);

typedef struct {
  int64_t min_rows;
  void* handle;
  predict_fn predict;
  int is_double;
  int64_t width;  /* values the library writes per row (targets x classes) */
  int64_t column; /* the value kept per row, or -1: all `width` values */
} Band;

typedef struct {
  char name[256];
  char output[128];
  int32_t n_features;
  int threads;       /* scorestack_threads: batches of PARALLEL_MIN_ROWS rows or more are split */
  int64_t out_width; /* values per row in the output tensor */
  int n_bands;
  Band bands[MAX_BANDS];
} ModelState;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* Triton's own timestamps are steady_clock */
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static TRITONSERVER_Error* fail(int code, const char* fmt, ...) {
  char msg[MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return TRITONSERVER_ErrorNew(code, msg);
}

/* ---- SHA-256 (FIPS 180-4), for the SHA256SUMS check ---- */
typedef struct {
  uint32_t h[8];
  uint64_t len;
  unsigned char buf[64];
  size_t fill;
} Sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be,
    0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa,
    0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85,
    0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3,
    0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f,
    0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(Sha256* s, const unsigned char* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i) w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3], e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
  for (int i = 0; i < 64; ++i) {
    uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
    uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
  }
  s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d, s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha256_init(Sha256* s) {
  static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, h0, sizeof h0);
  s->len = 0;
  s->fill = 0;
}

static void sha256_update(Sha256* s, const unsigned char* p, size_t n) {
  s->len += n;
  while (n > 0) {
    size_t take = 64 - s->fill < n ? 64 - s->fill : n;
    memcpy(s->buf + s->fill, p, take);
    s->fill += take, p += take, n -= take;
    if (s->fill == 64) sha256_block(s, s->buf), s->fill = 0;
  }
}

static void sha256_hex(Sha256* s, char out[65]) {
  uint64_t bits = s->len * 8;
  unsigned char pad = 0x80, zero = 0, len[8];
  sha256_update(s, &pad, 1);
  while (s->fill != 56) sha256_update(s, &zero, 1);
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(bits >> (56 - 8 * i));
  sha256_update(s, len, 8);
  for (int i = 0; i < 8; ++i) sprintf(out + 8 * i, "%08x", s->h[i]);
  out[64] = 0;
}

/* Digest of a file as lowercase hex; 0 on success, errno otherwise. Exported for the tests. */
int scorestack_file_sha256(const char* path, char out[65]) {
  FILE* fh = fopen(path, "rb");
  if (fh == NULL) return errno ? errno : ENOENT;
  Sha256 s;
  sha256_init(&s);
  unsigned char chunk[1 << 16];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, fh)) > 0) sha256_update(&s, chunk, n);
  int err = ferror(fh) ? EIO : 0;
  fclose(fh);
  if (!err) sha256_hex(&s, out);
  return err;
}

/* Every file SHA256SUMS lists must exist and match: the same rule and messages as
 * scorestack_runtime.check_integrity. Messages name the repository's file (.scorestack_origin). */
static TRITONSERVER_Error* check_integrity(const char* model, const char* vdir) {
  char path[4096], origin[3072] = "", line[4096];
  snprintf(path, sizeof path, "%s/.scorestack_origin", vdir);
  FILE* fo = fopen(path, "r");
  if (fo != NULL) {
    if (fgets(origin, sizeof origin, fo) == NULL) origin[0] = 0;
    origin[strcspn(origin, "\r\n")] = 0;
    fclose(fo);
  }
  const char* shown_dir = origin[0] ? origin : vdir;
  snprintf(path, sizeof path, "%s/SHA256SUMS", vdir);
  FILE* fh = fopen(path, "r");
  if (fh == NULL)
    return fail(ERR_NOT_FOUND,
                "model %s: %s/SHA256SUMS is missing, so the artifact cannot be checked; recompile the model (scorestack compile) or restore the version folder",
                model, shown_dir);
  TRITONSERVER_Error* err = NULL;
  while (err == NULL && fgets(line, sizeof line, fh) != NULL) {
    line[strcspn(line, "\r\n")] = 0;
    char* sep = strchr(line, ' ');
    if (sep == NULL) continue;
    *sep = 0;
    const char* name = sep + 1;
    while (*name == ' ' || *name == '*') ++name;
    char want[65], got[65];
    if (strlen(line) != 64) {
      err = fail(ERR_INVALID_ARG, "model %s: %s/SHA256SUMS: the line for %s has no SHA-256 digest; recompile the model", model, shown_dir, name);
      break;
    }
    memcpy(want, line, 65);
    snprintf(path, sizeof path, "%s/%s", vdir, name);
    int rc = scorestack_file_sha256(path, got);
    if (rc == ENOENT)
      err = fail(ERR_NOT_FOUND, "model %s: %s/%s listed in SHA256SUMS is missing; recompile or restore it", model, shown_dir, name);
    else if (rc != 0)
      err = fail(ERR_INTERNAL, "model %s: cannot read %s/%s: %s", model, shown_dir, name, strerror(rc));
    else if (strcmp(got, want) != 0)
      err = fail(ERR_INVALID_ARG,
                 "model %s: %s/%s is corrupted or was modified after compile (sha256 %.16s…, compiled as %.16s…); refusing to load it. "
                 "Recompile the model or restore the file",
                 model, shown_dir, name, got, want);
  }
  fclose(fh);
  return err;
}

/* ---- the model config: the few values read from its JSON ---- */
/* The string value of parameter `key` ({"key":{"string_value":"..."}}), copied into out. */
static int config_parameter(const char* json, const char* key, char* out, size_t cap) {
  char pattern[160];
  snprintf(pattern, sizeof pattern, "\"%s\":{\"string_value\":\"", key);
  const char* p = strstr(json, pattern);
  if (p == NULL) return 0;
  p += strlen(pattern);
  size_t n = 0;
  while (p[n] && p[n] != '"' && n + 1 < cap) ++n;
  if (p[n] != '"') return 0; /* escaped or too long: not a value this backend writes */
  memcpy(out, p, n);
  out[n] = 0;
  return 1;
}

static int64_t dims_product(const char* p) {
  if ((p = strstr(p, "\"dims\":[")) == NULL) return -1;
  p += 8;
  int64_t width = 1;
  while (*p && *p != ']') {
    while (*p == '"' || *p == ',' || *p == ' ') ++p;
    if (*p == ']') break;
    char* end;
    long long d = strtoll(p, &end, 10);
    if (end == p || d <= 0) return -1;
    width *= d;
    p = end;
  }
  return width;
}

static void free_state(ModelState* s) {
  if (s == NULL) return;
  for (int i = 0; i < s->n_bands; ++i)
    if (s->bands[i].handle) dlclose(s->bands[i].handle);
  free(s);
}

static TRITONSERVER_Error* load_band(ModelState* s, Band* b, const char* vdir, const char* artifact) {
  char link[4096], path[PATH_MAX];
  snprintf(link, sizeof link, "%s/%s", vdir, artifact);
  /* Messages name the file a user fixes: the repository's (a local view links to it). */
  if (realpath(link, path) == NULL) snprintf(path, sizeof path, "%s", link);
  b->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (b->handle == NULL) return fail(ERR_INVALID_ARG, "model %s: cannot load %s: %s", s->name, path, dlerror());
  b->predict = (predict_fn)dlsym(b->handle, "scorestack_predict_batch");
  shape_fn shape = (shape_fn)dlsym(b->handle, "scorestack_output_shape");
  type_fn type = (type_fn)dlsym(b->handle, "scorestack_result_type");
  if (b->predict == NULL || shape == NULL || type == NULL)
    return fail(ERR_INVALID_ARG, "model %s: %s lacks the batch entry point scorestack_predict_batch (compiled by an older scorestack?); recompile the model",
                s->name, path);
  int64_t dims[2] = {0, 0};
  shape(dims);
  b->width = dims[0] * dims[1];
  b->is_double = strcmp(type(), "double") == 0;
  int64_t kept = (b->column >= 0 && b->width > 1) ? 1 : b->width;
  if (b->column >= b->width)
    return fail(ERR_INVALID_ARG, "model %s: output column %lld of %s is out of range (it writes %lld values a row)", s->name, (long long)b->column, artifact,
                (long long)b->width);
  if (kept != s->out_width)
    return fail(ERR_INVALID_ARG, "model %s: %s gives %lld values a row, the config's output %s has %lld", s->name, artifact, (long long)kept, s->output,
                (long long)s->out_width);
  return NULL;
}

/* ---- backend entry points ---- */
TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  uint32_t major = 0, minor = 0;
  TRITONSERVER_Error* err = TRITONBACKEND_ApiVersion(&major, &minor);
  if (err) return err;
  if (major != API_MAJOR || minor < API_MINOR)
    return fail(ERR_UNSUPPORTED, "scorestack backend needs Triton backend API %u.>=%u, this server has %u.%u", API_MAJOR, API_MINOR, major, minor);
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  const char *name = NULL, *location = NULL, *json = NULL;
  uint64_t version = 0;
  int artifact_type = 0;
  size_t json_size = 0;
  TRITONSERVER_Message* config = NULL;
  TRITONSERVER_Error* err;
  if ((err = TRITONBACKEND_ModelName(model, &name)) || (err = TRITONBACKEND_ModelVersion(model, &version)) ||
      (err = TRITONBACKEND_ModelRepository(model, &artifact_type, &location)) || (err = TRITONBACKEND_ModelConfig(model, 1, &config)))
    return err;
  if ((err = TRITONSERVER_MessageSerializeToJson(config, &json, &json_size))) {
    TRITONSERVER_MessageDelete(config);
    return err;
  }
  ModelState* s = calloc(1, sizeof *s);
  char vdir[3072], plan[2048], integrity[32] = "", threads[16] = "1";
  snprintf(s->name, sizeof s->name, "%s", name);
  snprintf(vdir, sizeof vdir, "%s/%llu", location, (unsigned long long)version);
  /* the JSON is a copy we own only until the message is deleted: read everything now */
  int has_plan = config_parameter(json, "scorestack_native", plan, sizeof plan);
  config_parameter(json, "scorestack_integrity", integrity, sizeof integrity);
  config_parameter(json, "scorestack_threads", threads, sizeof threads);
  s->threads = atoi(threads);
  if (s->threads < 1) s->threads = 1;
  if (s->threads > MAX_THREADS) s->threads = MAX_THREADS;
  const char* in_block = strstr(json, "\"input\":[");
  int64_t in_width = in_block ? dims_product(in_block) : -1;
  const char* out_block = strstr(json, "\"output\":[");
  s->out_width = out_block ? dims_product(out_block) : -1;
  TRITONSERVER_MessageDelete(config);

  if (!has_plan) err = fail(ERR_INVALID_ARG, "model %s: config parameter scorestack_native is missing; recompile the model (scorestack compile)", s->name);
  else if (in_width <= 0 || in_width > INT32_MAX || s->out_width <= 0)
    err = fail(ERR_INVALID_ARG, "model %s: the scorestack backend needs one FP32 input and one FP32 output with fixed dims", s->name);
  if (!err && strcmp(integrity, "sha256") == 0) err = check_integrity(s->name, vdir);
  if (!err) {
    s->n_features = (int32_t)in_width;
    char* save = NULL;
    char* tok = strtok_r(plan, " ", &save);
    snprintf(s->output, sizeof s->output, "%s", tok ? tok : "");
    while (!err && (tok = strtok_r(NULL, " ", &save)) != NULL) {
      char* artifact = strtok_r(NULL, " ", &save);
      char* column = strtok_r(NULL, " ", &save);
      if (artifact == NULL || column == NULL || s->n_bands == MAX_BANDS) {
        err = fail(ERR_INVALID_ARG, "model %s: scorestack_native must be '<output> <min_rows> <artifact> <column>...' with at most %d bands", s->name,
                   MAX_BANDS);
        break;
      }
      Band* b = &s->bands[s->n_bands++];
      b->min_rows = strtoll(tok, NULL, 10);
      b->column = strtoll(column, NULL, 10);
      int64_t prev = s->n_bands > 1 ? s->bands[s->n_bands - 2].min_rows : 0;
      if ((s->n_bands == 1 && b->min_rows != 1) || b->min_rows <= prev)
        err = fail(ERR_INVALID_ARG, "model %s: scorestack_native bands must start at min_rows 1 and ascend", s->name);
      else
        err = load_band(s, b, vdir, artifact);
    }
    if (!err && s->n_bands == 0) err = fail(ERR_INVALID_ARG, "model %s: scorestack_native names no artifact", s->name);
  }
  if (err) {
    free_state(s);
    return err;
  }
  return TRITONBACKEND_ModelSetState(model, s);
}

TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model) {
  void* state = NULL;
  TRITONSERVER_Error* err = TRITONBACKEND_ModelState(model, &state);
  if (err) return err;
  free_state((ModelState*)state);
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance* instance) {
  (void)instance; /* instances share the model's read-only state; each runs on its own Triton thread */
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance* instance) {
  (void)instance;
  return NULL;
}

/* Rows of one request's FP32 input, or an error naming what is wrong with it. */
static TRITONSERVER_Error* request_rows(const ModelState* s, TRITONBACKEND_Request* request, TRITONBACKEND_Input** input, int64_t* rows,
                                        uint32_t* buffers) {
  uint32_t count = 0;
  TRITONSERVER_Error* err = TRITONBACKEND_RequestInputCount(request, &count);
  if (err) return err;
  if (count != 1) return fail(ERR_INVALID_ARG, "model %s: expected 1 input tensor, got %u", s->name, count);
  if ((err = TRITONBACKEND_RequestInputByIndex(request, 0, input))) return err;
  const char* name;
  int datatype;
  const int64_t* shape;
  uint32_t dims = 0;
  uint64_t bytes = 0;
  if ((err = TRITONBACKEND_InputProperties(*input, &name, &datatype, &shape, &dims, &bytes, buffers))) return err;
  if (datatype != TYPE_FP32) return fail(ERR_INVALID_ARG, "model %s: input %s must be FP32", s->name, name);
  if (dims != 2 || shape[1] != s->n_features)
    return fail(ERR_INVALID_ARG, "model %s: input %s must have shape [rows, %d]", s->name, name, s->n_features);
  if (bytes != (uint64_t)shape[0] * (uint64_t)s->n_features * 4u) return fail(ERR_INVALID_ARG, "model %s: input %s holds %llu bytes, its shape needs %llu", s->name, name, (unsigned long long)bytes, (unsigned long long)(shape[0] * s->n_features * 4));
  *rows = shape[0];
  return NULL;
}

/* Copy one request's input (possibly several buffers) to dst. */
static TRITONSERVER_Error* copy_input(TRITONBACKEND_Input* input, uint32_t buffers, char* dst) {
  for (uint32_t i = 0; i < buffers; ++i) {
    const void* buf;
    uint64_t size;
    int mem;
    int64_t mem_id;
    TRITONSERVER_Error* err = TRITONBACKEND_InputBuffer(input, i, &buf, &size, &mem, &mem_id);
    if (err) return err;
    if (mem != MEMORY_CPU && mem != MEMORY_CPU_PINNED) return TRITONSERVER_ErrorNew(ERR_UNSUPPORTED, "the scorestack backend reads inputs in CPU memory only");
    memcpy(dst, buf, size);
    dst += size;
  }
  return NULL;
}

/* Values the band wrote for `rows` rows -> float32 output values (the kept column, or all). */
static void gather(const Band* b, const void* raw, int64_t rows, float* out) {
  const int64_t w = b->width;
  if (b->column >= 0 && w > 1) {
    for (int64_t r = 0; r < rows; ++r) out[r] = b->is_double ? (float)((const double*)raw)[r * w + b->column] : ((const float*)raw)[r * w + b->column];
  } else if (b->is_double) {
    for (int64_t i = 0; i < rows * w; ++i) out[i] = (float)((const double*)raw)[i];
  } else {
    memcpy(out, raw, (size_t)(rows * w) * sizeof(float));
  }
}

typedef struct {
  const Band* band;
  const float* x;
  int64_t rows;
  int32_t cols;
  void* out;
  int rc;
} Chunk;

static void* run_chunk(void* arg) {
  Chunk* c = (Chunk*)arg;
  c->rc = c->band->predict(c->x, c->rows, c->cols, 0, c->out);
  return NULL;
}

/* The band over `rows` rows, split across up to s->threads threads for large batches. */
static int predict(const ModelState* s, const Band* b, const float* x, int64_t rows, void* out) {
  int n = (s->threads > 1 && rows >= PARALLEL_MIN_ROWS) ? s->threads : 1;
  if (n == 1) return b->predict(x, rows, s->n_features, 0, out);
  Chunk chunks[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  bool started[MAX_THREADS];
  const int64_t step = (rows + n - 1) / n;
  const size_t out_row = (size_t)b->width * (b->is_double ? sizeof(double) : sizeof(float));
  int k = 0;
  for (int64_t lo = 0; lo < rows; lo += step, ++k) {
    int64_t hi = lo + step < rows ? lo + step : rows;
    chunks[k] = (Chunk){b, x + lo * s->n_features, hi - lo, s->n_features, (char*)out + (size_t)lo * out_row, 0};
    started[k] = k > 0 && pthread_create(&tids[k], NULL, run_chunk, &chunks[k]) == 0;
    if (k > 0 && !started[k]) run_chunk(&chunks[k]); /* no thread to be had: run it here */
  }
  run_chunk(&chunks[0]);
  int rc = 0;
  for (int i = 0; i < k; ++i) {
    if (i > 0 && started[i]) pthread_join(tids[i], NULL);
    if (chunks[i].rc != 0 && rc == 0) rc = chunks[i].rc;
  }
  return rc;
}

static const Band* band_for(const ModelState* s, int64_t rows) {
  int i = s->n_bands - 1;
  while (i > 0 && s->bands[i].min_rows > rows) --i;
  return &s->bands[i];
}

static void send(TRITONBACKEND_Request* request, TRITONBACKEND_Response* response, TRITONSERVER_Error* error) {
  if (response == NULL) {
    TRITONSERVER_Error* e = TRITONBACKEND_ResponseNew(&response, request);
    if (e) {
      TRITONSERVER_ErrorDelete(e);
      if (error) TRITONSERVER_ErrorDelete(error);
      return;
    }
  }
  TRITONSERVER_Error* e = TRITONBACKEND_ResponseSend(response, RESPONSE_COMPLETE_FINAL, error);
  if (e) TRITONSERVER_ErrorDelete(e);
  if (error) TRITONSERVER_ErrorDelete(error);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests,
                                                       const uint32_t request_count) {
  uint64_t exec_start = now_ns();
  TRITONBACKEND_Model* model;
  void* state;
  TRITONSERVER_Error* err;
  if ((err = TRITONBACKEND_ModelInstanceModel(instance, &model)) || (err = TRITONBACKEND_ModelState(model, &state))) return err;
  const ModelState* s = (const ModelState*)state;

  /* Read every request's shape; a bad request gets its own error and leaves the batch. */
  TRITONBACKEND_Input* inputs[request_count];
  int64_t rows[request_count];
  uint32_t buffers[request_count];
  bool ok[request_count];
  int64_t total = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    TRITONSERVER_Error* e = request_rows(s, requests[r], &inputs[r], &rows[r], &buffers[r]);
    ok[r] = e == NULL;
    if (e) send(requests[r], NULL, e);
    else total += rows[r];
  }

  /* Join the inputs (one request in one buffer is read in place), run once, split the outputs. */
  uint64_t compute_start = now_ns(), compute_end = compute_start;
  char* joined = NULL;
  void* raw = NULL;
  const float* x = NULL;
  const Band* b = band_for(s, total > 0 ? total : 1);
  TRITONSERVER_Error* batch_err = NULL;
  if (total > 0) {
    uint32_t only = 0, n_ok = 0;
    for (uint32_t r = 0; r < request_count; ++r)
      if (ok[r]) only = r, ++n_ok;
    if (n_ok == 1 && buffers[only] == 1) {
      const void* buf;
      uint64_t size;
      int mem;
      int64_t mem_id;
      batch_err = TRITONBACKEND_InputBuffer(inputs[only], 0, &buf, &size, &mem, &mem_id);
      if (!batch_err && mem != MEMORY_CPU && mem != MEMORY_CPU_PINNED)
        batch_err = TRITONSERVER_ErrorNew(ERR_UNSUPPORTED, "the scorestack backend reads inputs in CPU memory only");
      x = buf;
    } else {
      joined = malloc((size_t)total * (size_t)s->n_features * sizeof(float));
      if (joined == NULL) batch_err = TRITONSERVER_ErrorNew(ERR_INTERNAL, "out of memory joining a batch");
      size_t offset = 0;
      for (uint32_t r = 0; r < request_count && !batch_err; ++r) {
        if (!ok[r]) continue;
        batch_err = copy_input(inputs[r], buffers[r], joined + offset);
        offset += (size_t)rows[r] * (size_t)s->n_features * sizeof(float);
      }
      x = (const float*)joined;
    }
    if (!batch_err) {
      raw = malloc((size_t)total * (size_t)b->width * (b->is_double ? sizeof(double) : sizeof(float)));
      if (raw == NULL) batch_err = TRITONSERVER_ErrorNew(ERR_INTERNAL, "out of memory for a batch's outputs");
    }
    compute_start = now_ns();
    if (!batch_err) {
      int rc = predict(s, b, x, total, raw);
      if (rc != 0) batch_err = fail(ERR_INTERNAL, "model %s: the artifact returned error %d", s->name, rc);
    }
    compute_end = now_ns();
  }

  int64_t offset = 0;
  size_t value_size = b->is_double ? sizeof(double) : sizeof(float);
  for (uint32_t r = 0; r < request_count; ++r) {
    if (!ok[r]) continue;
    TRITONBACKEND_Response* response = NULL;
    TRITONSERVER_Error* e = batch_err ? fail(ERR_INTERNAL, "model %s: %s", s->name, TRITONSERVER_ErrorMessage(batch_err)) : NULL;
    if (!e) e = TRITONBACKEND_ResponseNew(&response, requests[r]);
    if (!e) {
      TRITONBACKEND_Output* output;
      int64_t shape[2] = {rows[r], s->out_width};
      void* buf;
      int mem = MEMORY_CPU;
      int64_t mem_id = 0;
      e = TRITONBACKEND_ResponseOutput(response, &output, s->output, TYPE_FP32, shape, 2);
      if (!e) e = TRITONBACKEND_OutputBuffer(output, &buf, (uint64_t)(rows[r] * s->out_width) * sizeof(float), &mem, &mem_id);
      if (!e && mem != MEMORY_CPU && mem != MEMORY_CPU_PINNED) e = TRITONSERVER_ErrorNew(ERR_UNSUPPORTED, "output buffer is not in CPU memory");
      if (!e) gather(b, (const char*)raw + (size_t)offset * (size_t)b->width * value_size, rows[r], (float*)buf);
    }
    offset += rows[r];
    send(requests[r], response, e);
  }
  if (batch_err) {
    TRITONSERVER_Error* e = TRITONSERVER_LogMessage(LOG_ERROR, __FILE__, __LINE__, TRITONSERVER_ErrorMessage(batch_err));
    if (e) TRITONSERVER_ErrorDelete(e);
    TRITONSERVER_ErrorDelete(batch_err);
  }
  free(joined);
  free(raw);

  uint64_t exec_end = now_ns();
  for (uint32_t r = 0; r < request_count; ++r) {
    TRITONSERVER_Error* e = TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[r], ok[r] && !batch_err, exec_start, compute_start, compute_end, exec_end);
    if (e) TRITONSERVER_ErrorDelete(e);
    e = TRITONBACKEND_RequestRelease(requests[r], REQUEST_RELEASE_ALL);
    if (e) TRITONSERVER_ErrorDelete(e);
  }
  if (total > 0) {
    TRITONSERVER_Error* e = TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, (uint64_t)total, exec_start, compute_start, compute_end, exec_end);
    if (e) TRITONSERVER_ErrorDelete(e);
  }
  return NULL;
}
