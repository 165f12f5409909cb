/* scorestack's native Triton backend: batch-library artifacts (TL2cgen, the tree kernel) served
 * without the Python backend.
 *
 * The compiler builds this file into libtriton_scorestack.so and places it in every version folder
 * whose config says `backend: "scorestack"`; Triton looks for a backend library in the version
 * folder first. A model it serves is a list of bands, each a shared library exporting the batch ABI
 * of compile/_tree_commons.py (scorestack_predict_batch / scorestack_output_shape /
 * scorestack_result_type). It reads the same config parameters as the Python runtime
 * (scorestack_runtime.py), which defines them: scorestack_runtime "tl2cgen" with scorestack_artifact
 * (and scorestack_output_column) for one library, or scorestack_runtime "dispatch" with the plan in
 * scorestack_dispatch, whose format is specified once in scorestack_runtime.py (parse_dispatch) and
 * read here by parse_plan, band for band, refusal for refusal.
 *
 * A joined batch of n rows runs on the last band whose min_rows <= n, exactly as the Python runtime
 * chooses. Before anything loads, the version folder passes the SHA256SUMS rule stated in
 * scorestack_runtime.py (parameter scorestack_integrity "sha256"), with the same messages.
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
#include <sys/stat.h>
#include <sys/types.h>
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

#define MAX_BANDS 16 /* PLAN_MAX_BANDS */
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

/* Digest of a file as lowercase hex; 0 on success, errno otherwise (EISDIR for a folder, as open(2)
 * reports it to Python). Exported for the tests. */
int scorestack_file_sha256(const char* path, char out[65]) {
  FILE* fh = fopen(path, "rb");
  if (fh == NULL) return errno ? errno : ENOENT;
  struct stat st;
  if (fstat(fileno(fh), &st) == 0 && S_ISDIR(st.st_mode)) {
    fclose(fh);
    return EISDIR;
  }
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

/* ---- integrity: the SHA256SUMS rule ----
 * The rule and its messages are stated once, in scorestack_runtime.py (INTEGRITY_MESSAGES and the
 * comment above it); this is the same rule, message for message, and tests/test_contracts.py runs
 * both on one set of version folders. */

/* One manifest line (without its "\n"): 1 with the digest and name set, 0 for an empty line, -1 if
 * it is not "<64 lowercase hex digits><space><space or *><file name>". */
static int manifest_line(char* line, size_t len, char** digest, char** name) {
  if (len > 0 && line[len - 1] == '\r') line[--len] = 0;
  if (len == 0) return 0;
  if (len < 67 || line[64] != ' ' || (line[65] != ' ' && line[65] != '*')) return -1;
  for (int i = 0; i < 64; ++i)
    if (!((line[i] >= '0' && line[i] <= '9') || (line[i] >= 'a' && line[i] <= 'f'))) return -1;
  if (memchr(line + 66, '/', len - 66) != NULL || memchr(line, 0, len) != NULL) return -1;
  line[64] = 0;
  *digest = line;
  *name = line + 66;
  return 1;
}

/* 0 when the version folder passes the rule, else a Triton error code and the message in msg.
 * Exported for the tests. */
int scorestack_check_manifest(const char* model, const char* vdir, char* msg, size_t cap) {
  char path[4096], folder[PATH_MAX] = "";
  snprintf(path, sizeof path, "%s/.scorestack_origin", vdir);
  FILE* fo = fopen(path, "r");
  if (fo != NULL) {
    if (fgets(folder, sizeof folder, fo) == NULL) folder[0] = 0;
    folder[strcspn(folder, "\r\n")] = 0;
    fclose(fo);
  }
  if (folder[0] == 0 && realpath(vdir, folder) == NULL) snprintf(folder, sizeof folder, "%s", vdir);
  snprintf(path, sizeof path, "%s/SHA256SUMS", vdir);
  FILE* fh = fopen(path, "rb");
  if (fh == NULL && errno == ENOENT) {
    snprintf(msg, cap,
             "model %s: %s/SHA256SUMS is missing, so the artifact cannot be checked; recompile the model (scorestack compile) or restore the version "
             "folder",
             model, folder);
    return ERR_NOT_FOUND;
  }
  struct stat st;
  int open_err = fh == NULL ? errno : (fstat(fileno(fh), &st) == 0 && S_ISDIR(st.st_mode)) ? EISDIR : 0;
  if (open_err) {
    if (fh != NULL) fclose(fh);
    snprintf(msg, cap, "model %s: cannot read %s/SHA256SUMS: %s", model, folder, strerror(open_err));
    return ERR_INTERNAL;
  }
  char* line = NULL;
  size_t line_cap = 0;
  ssize_t len;
  int code = 0, number = 0, entries = 0;
  char *digest, *name;
  /* First pass: every line's form, then that there is a file to check. */
  while (code == 0 && (len = getline(&line, &line_cap, fh)) >= 0) {
    ++number;
    if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
    int kind = manifest_line(line, (size_t)len, &digest, &name);
    if (kind < 0) {
      snprintf(msg, cap,
               "model %s: %s/SHA256SUMS line %d is not '<sha256>  <file>'; recompile the model (scorestack compile) or restore the version folder", model,
               folder, number);
      code = ERR_INVALID_ARG;
    }
    entries += kind > 0;
  }
  if (code == 0 && ferror(fh)) {
    snprintf(msg, cap, "model %s: cannot read %s/SHA256SUMS: %s", model, folder, strerror(EIO));
    code = ERR_INTERNAL;
  }
  if (code == 0 && entries == 0) {
    snprintf(msg, cap,
             "model %s: %s/SHA256SUMS lists no files, so the artifact cannot be checked; recompile the model (scorestack compile) or restore the version "
             "folder",
             model, folder);
    code = ERR_INVALID_ARG;
  }
  /* Second pass: file by file, in the manifest's order. */
  if (code == 0) rewind(fh);
  while (code == 0 && (len = getline(&line, &line_cap, fh)) >= 0) {
    if (len > 0 && line[len - 1] == '\n') line[--len] = 0;
    if (manifest_line(line, (size_t)len, &digest, &name) <= 0) continue;
    char got[65];
    snprintf(path, sizeof path, "%s/%s", vdir, name);
    int rc = scorestack_file_sha256(path, got);
    if (rc == ENOENT) {
      snprintf(msg, cap, "model %s: %s/%s listed in SHA256SUMS is missing; recompile or restore it", model, folder, name);
      code = ERR_NOT_FOUND;
    } else if (rc != 0) {
      snprintf(msg, cap, "model %s: cannot read %s/%s: %s", model, folder, name, strerror(rc));
      code = ERR_INTERNAL;
    } else if (strcmp(got, digest) != 0) {
      snprintf(msg, cap,
               "model %s: %s/%s is corrupted or was modified after compile (sha256 %.16s…, compiled as %.16s…); refusing to load it. Recompile the model "
               "or restore the file",
               model, folder, name, got, digest);
      code = ERR_INVALID_ARG;
    }
  }
  free(line);
  fclose(fh);
  return code;
}

static TRITONSERVER_Error* check_integrity(const char* model, const char* vdir) {
  char msg[MSG];
  int code = scorestack_check_manifest(model, vdir, msg, sizeof msg);
  return code ? TRITONSERVER_ErrorNew(code, msg) : NULL;
}

/* ---- JSON strings: the config's values, and the strings of a dispatch plan ---- */
static int hex4(const char* p, const char* end, unsigned* cp) {
  if (end - p < 4) return 0;
  *cp = 0;
  for (int i = 0; i < 4; ++i) {
    char c = p[i];
    unsigned d = (c >= '0' && c <= '9') ? (unsigned)(c - '0') : (c >= 'a' && c <= 'f') ? (unsigned)(c - 'a' + 10) : (c >= 'A' && c <= 'F') ? (unsigned)(c - 'A' + 10) : 16u;
    if (d > 15) return 0;
    *cp = *cp << 4 | d;
  }
  return 1;
}

/* Decode the JSON string starting after its opening quote at *p; *p ends after the closing quote.
 * Up to cap - 1 bytes go to out (NUL-terminated); *len is the full decoded length (it may exceed
 * cap - 1: then out holds its start). \uXXXX becomes UTF-8. 0 if it is not a JSON string. */
static int json_string(const char** p, const char* end, char* out, size_t cap, size_t* len) {
  const char* q = *p;
  size_t n = 0;
#define PUT(byte)                                  \
  do {                                             \
    if (n + 1 < cap) out[n] = (char)(byte);        \
    ++n;                                           \
  } while (0)
  while (q < end && *q != '"') {
    unsigned char c = (unsigned char)*q++;
    if (c < 0x20) return 0;
    if (c != '\\') {
      PUT(c);
      continue;
    }
    if (q >= end) return 0;
    char e = *q++;
    unsigned cp;
    switch (e) {
      case '"': PUT('"'); break;
      case '\\': PUT('\\'); break;
      case '/': PUT('/'); break;
      case 'b': PUT('\b'); break;
      case 'f': PUT('\f'); break;
      case 'n': PUT('\n'); break;
      case 'r': PUT('\r'); break;
      case 't': PUT('\t'); break;
      case 'u':
        if (!hex4(q, end, &cp)) return 0;
        q += 4;
        if (cp < 0x80) PUT(cp);
        else if (cp < 0x800) {
          PUT(0xC0 | cp >> 6);
          PUT(0x80 | (cp & 0x3F));
        } else {
          PUT(0xE0 | cp >> 12);
          PUT(0x80 | ((cp >> 6) & 0x3F));
          PUT(0x80 | (cp & 0x3F));
        }
        break;
      default: return 0;
    }
  }
#undef PUT
  if (q >= end) return 0;
  if (cap > 0) out[n < cap ? n : cap - 1] = 0;
  *len = n;
  *p = q + 1;
  return 1;
}

/* ---- the model config: the few values read from its JSON ---- */
/* The string value of parameter `key` ({"key":{"string_value":"..."}}), decoded into out: 1, with
 * *len its length; 0 if the config has no such parameter; -1 if it is longer than cap - 1 bytes. */
static int config_parameter(const char* json, const char* key, char* out, size_t cap, size_t* len) {
  char pattern[160];
  snprintf(pattern, sizeof pattern, "\"%s\":{\"string_value\":\"", key);
  const char* p = strstr(json, pattern);
  if (p == NULL) return 0;
  p += strlen(pattern);
  size_t n = 0;
  if (!json_string(&p, p + strlen(p), out, cap, &n)) return 0;
  if (len != NULL) *len = n;
  return n < cap ? 1 : -1;
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

/* ---- the dispatch plan (config parameter scorestack_dispatch) ----
 * The format, the order of its checks and its messages are specified once, in scorestack_runtime.py
 * (the comment above parse_dispatch); this reader accepts and refuses the same texts with the same
 * messages (tests/test_contracts.py runs both on one set of plans). It parses the whole text first
 * (JSON syntax, as Python's json module), then checks the bands in the specified order. */
#define PLAN_MAX_BYTES 16383
#define PLAN_MAX_BANDS 16
#define PLAN_INT_MAX 2147483647LL
#define PLAN_NAME_MAX 255
#define PLAN_DEPTH_MAX 256 /* nesting inside a value: refused as "not valid JSON" beyond this */
static const char* const PLAN_KEYS[5] = {"min_rows", "runtime", "artifact", "output_column", "method"};
enum { K_MIN_ROWS, K_RUNTIME, K_ARTIFACT, K_COLUMN, K_METHOD };
enum { V_ABSENT = 0, V_INT, V_OTHER_NUMBER, V_STRING, V_NULL, V_OTHER };

typedef struct {
  int kind;
  long long i; /* V_INT: the value, when !big */
  int big;     /* V_INT beyond +-PLAN_INT_MAX */
  char s[PLAN_NAME_MAX + 2];
  size_t len; /* V_STRING: decoded length */
} PlanValue;

typedef struct {
  int is_object;
  char unknown[64]; /* the first unknown key, as much of it as fits */
  int has_unknown;
  int repeated; /* the first key met twice (index into PLAN_KEYS), or -1 */
  unsigned seen;
  PlanValue v[5];
} PlanRaw;

typedef struct {
  int64_t min_rows;
  char runtime[PLAN_NAME_MAX + 1];
  char artifact[PLAN_NAME_MAX + 1];
  int64_t column; /* -1: null */
  char method[PLAN_NAME_MAX + 1]; /* "": null */
} PlanBand;

typedef struct {
  const char* p;
  const char* end;
} Cursor;

static void ws(Cursor* c) {
  while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) ++c->p;
}

static int literal(Cursor* c, const char* word) {
  size_t n = strlen(word);
  if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return 0;
  c->p += n;
  return 1;
}

static int digit(Cursor* c) { return c->p < c->end && *c->p >= '0' && *c->p <= '9'; }

/* A JSON number (and Python's NaN / Infinity / -Infinity, which its json module reads as floats). */
static int plan_number(Cursor* c, PlanValue* v) {
  int neg = c->p < c->end && *c->p == '-';
  if (neg) ++c->p;
  if (literal(c, "Infinity") || (!neg && literal(c, "NaN"))) return v->kind = V_OTHER_NUMBER, 1;
  if (!digit(c)) return 0;
  long long value = 0;
  int big = 0;
  if (*c->p == '0') ++c->p;
  else
    while (digit(c)) {
      value = value * 10 + (*c->p++ - '0');
      if (value > PLAN_INT_MAX) big = 1, value = PLAN_INT_MAX;
    }
  v->kind = V_INT;
  if (c->p < c->end && *c->p == '.') {
    ++c->p;
    if (!digit(c)) return 0;
    while (digit(c)) ++c->p;
    v->kind = V_OTHER_NUMBER;
  }
  if (c->p < c->end && (*c->p == 'e' || *c->p == 'E')) {
    ++c->p;
    if (c->p < c->end && (*c->p == '+' || *c->p == '-')) ++c->p;
    if (!digit(c)) return 0;
    while (digit(c)) ++c->p;
    v->kind = V_OTHER_NUMBER;
  }
  v->i = neg ? -value : value;
  v->big = big;
  return 1;
}

static int plan_value(Cursor* c, PlanValue* v, int depth);

/* `"key"` then `:`, with the white space around: the key into `key` (at most `cap` bytes, its length in *n). */
static int plan_key(Cursor* c, char* key, size_t cap, size_t* n) {
  if (c->p >= c->end || *c->p != '"') return 0;
  ++c->p;
  if (!json_string(&c->p, c->end, key, cap, n)) return 0;
  ws(c);
  if (c->p >= c->end || *c->p != ':') return 0;
  ++c->p;
  ws(c);
  return 1;
}

/* An object or array inside a value: only its syntax matters (a band's value must not be one). */
static int plan_container(Cursor* c, int depth) {
  char close = *c->p == '{' ? '}' : ']';
  int object = close == '}';
  ++c->p;
  if (depth > PLAN_DEPTH_MAX) return 0;
  ws(c);
  if (c->p < c->end && *c->p == close) return ++c->p, 1;
  for (;;) {
    PlanValue scratch;
    if (object) {
      char key[8];
      size_t n;
      if (!plan_key(c, key, sizeof key, &n)) return 0;
    }
    if (!plan_value(c, &scratch, depth + 1)) return 0;
    ws(c);
    if (c->p < c->end && *c->p == ',') {
      ++c->p;
      ws(c);
      continue;
    }
    if (c->p < c->end && *c->p == close) return ++c->p, 1;
    return 0;
  }
}

static int plan_value(Cursor* c, PlanValue* v, int depth) {
  memset(v, 0, sizeof *v);
  if (c->p >= c->end) return 0;
  char ch = *c->p;
  if (ch == '"') {
    ++c->p;
    v->kind = V_STRING;
    return json_string(&c->p, c->end, v->s, sizeof v->s, &v->len);
  }
  if (ch == '-' || (ch >= '0' && ch <= '9') || ch == 'N' || ch == 'I') return plan_number(c, v);
  if (literal(c, "null")) return v->kind = V_NULL, 1;
  if (literal(c, "true") || literal(c, "false")) return v->kind = V_OTHER, 1;
  if (ch == '{' || ch == '[') return v->kind = V_OTHER, plan_container(c, depth);
  return 0;
}

/* One element of the plan's list: a band object (its keys and values recorded), or anything else. */
static int plan_band(Cursor* c, PlanRaw* b) {
  memset(b, 0, sizeof *b);
  b->repeated = -1;
  if (c->p >= c->end || *c->p != '{') {
    PlanValue scratch;
    return plan_value(c, &scratch, 1);
  }
  b->is_object = 1;
  ++c->p;
  ws(c);
  if (c->p < c->end && *c->p == '}') return ++c->p, 1;
  for (;;) {
    char key[64];
    size_t n;
    if (!plan_key(c, key, sizeof key, &n)) return 0;
    int k = -1;
    for (int i = 0; i < 5 && n < sizeof key; ++i)
      if (n == strlen(PLAN_KEYS[i]) && memcmp(key, PLAN_KEYS[i], n) == 0) k = i;
    PlanValue scratch;
    if (!plan_value(c, k >= 0 ? &b->v[k] : &scratch, 1)) return 0;
    if (k < 0 && !b->has_unknown) b->has_unknown = 1, snprintf(b->unknown, sizeof b->unknown, "%s", key);
    if (k >= 0 && (b->seen & (1u << k)) && b->repeated < 0) b->repeated = k;
    if (k >= 0) b->seen |= 1u << k;
    ws(c);
    if (c->p < c->end && *c->p == ',') {
      ++c->p;
      ws(c);
      continue;
    }
    if (c->p < c->end && *c->p == '}') return ++c->p, 1;
    return 0;
  }
}

static int plan_is_int(const PlanValue* v, long long lo) { return v->kind == V_INT && !v->big && v->i >= lo && v->i <= PLAN_INT_MAX; }

static int plan_is_name(const PlanValue* v) {
  if (v->kind != V_STRING || v->len == 0 || v->len > PLAN_NAME_MAX || v->s[0] == '.') return 0;
  for (size_t i = 0; i < v->len; ++i) {
    char ch = v->s[i];
    if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '+' || ch == '-')) return 0;
  }
  return 1;
}

#define NAME_RULE "letters, digits and . _ + -, not starting with ."

/* The plan's bands (at most PLAN_MAX_BANDS), their number returned; 0 with the reason in err. */
static int parse_plan(const char* text, size_t len, PlanBand* out, char* err, size_t cap) {
  if (len > PLAN_MAX_BYTES) return snprintf(err, cap, "longer than %d bytes", PLAN_MAX_BYTES), 0;
  PlanRaw raw[PLAN_MAX_BANDS];
  Cursor c = {text, text + len};
  int n = 0, is_list = 0;
  ws(&c);
  if (c.p < c.end && *c.p == '[') {
    is_list = 1;
    ++c.p;
    ws(&c);
    if (c.p < c.end && *c.p == ']') ++c.p;
    else
      for (;;) {
        PlanRaw scratch;
        if (!plan_band(&c, n < PLAN_MAX_BANDS ? &raw[n] : &scratch)) return snprintf(err, cap, "not valid JSON"), 0;
        ++n;
        ws(&c);
        if (c.p < c.end && *c.p == ',') {
          ++c.p;
          ws(&c);
          continue;
        }
        if (c.p < c.end && *c.p == ']') {
          ++c.p;
          break;
        }
        return snprintf(err, cap, "not valid JSON"), 0;
      }
  } else {
    PlanValue scratch;
    if (!plan_value(&c, &scratch, 0)) return snprintf(err, cap, "not valid JSON"), 0;
  }
  ws(&c);
  if (c.p != c.end) return snprintf(err, cap, "not valid JSON"), 0;
  if (!is_list) return snprintf(err, cap, "not a JSON list of bands"), 0;
  if (n == 0) return snprintf(err, cap, "no bands"), 0;
  if (n > PLAN_MAX_BANDS) return snprintf(err, cap, "more than %d bands", PLAN_MAX_BANDS), 0;
  for (int i = 0; i < n; ++i) {
    const PlanRaw* b = &raw[i];
    int k;
    if (!b->is_object) return snprintf(err, cap, "band %d is not a JSON object", i + 1), 0;
    if (b->has_unknown)
      return snprintf(err, cap, "band %d: unknown key \"%s\" (a band has min_rows, runtime, artifact, output_column, method)", i + 1, b->unknown), 0;
    if (b->repeated >= 0) return snprintf(err, cap, "band %d: key \"%s\" appears twice", i + 1, PLAN_KEYS[b->repeated]), 0;
    for (k = 0; k < 3; ++k)
      if (!(b->seen & (1u << k))) return snprintf(err, cap, "band %d: \"%s\" is missing", i + 1, PLAN_KEYS[k]), 0;
    if (!plan_is_int(&b->v[K_MIN_ROWS], 1)) return snprintf(err, cap, "band %d: min_rows must be an integer from 1 to %lld", i + 1, PLAN_INT_MAX), 0;
    if (!plan_is_name(&b->v[K_RUNTIME])) return snprintf(err, cap, "band %d: runtime must be a name (" NAME_RULE ")", i + 1), 0;
    if (!plan_is_name(&b->v[K_ARTIFACT])) return snprintf(err, cap, "band %d: artifact must be a name (" NAME_RULE ")", i + 1), 0;
    const PlanValue *column = &b->v[K_COLUMN], *method = &b->v[K_METHOD];
    if (column->kind != V_ABSENT && column->kind != V_NULL && !plan_is_int(column, 0))
      return snprintf(err, cap, "band %d: output_column must be null or an integer from 0 to %lld", i + 1, PLAN_INT_MAX), 0;
    if (method->kind != V_ABSENT && method->kind != V_NULL && !plan_is_name(method))
      return snprintf(err, cap, "band %d: method must be null or a name (" NAME_RULE ")", i + 1), 0;
    long long rows = b->v[K_MIN_ROWS].i;
    if (i == 0 && rows != 1) return snprintf(err, cap, "band 1: min_rows must be 1 (the first band starts at one row), not %lld", rows), 0;
    if (i > 0 && rows <= out[i - 1].min_rows)
      return snprintf(err, cap, "band %d: min_rows %lld does not ascend from band %d's %lld", i + 1, rows, i, (long long)out[i - 1].min_rows), 0;
    out[i].min_rows = rows;
    snprintf(out[i].runtime, sizeof out[i].runtime, "%s", b->v[K_RUNTIME].s);
    snprintf(out[i].artifact, sizeof out[i].artifact, "%s", b->v[K_ARTIFACT].s);
    out[i].column = column->kind == V_INT ? column->i : -1;
    snprintf(out[i].method, sizeof out[i].method, "%s", method->kind == V_STRING ? method->s : "");
  }
  return n;
}

/* The plan read back as JSON with all five keys per band (the tests compare it with Python's
 * reading); or 0 and the reason. Exported for the tests. */
int scorestack_parse_dispatch(const char* text, size_t len, char* out, size_t cap) {
  PlanBand bands[PLAN_MAX_BANDS];
  int n = parse_plan(text, len, bands, out, cap);
  if (n == 0) return 0;
  size_t used = (size_t)snprintf(out, cap, "[");
  for (int i = 0; i < n && used < cap; ++i) {
    char column[24] = "null", method[PLAN_NAME_MAX + 3] = "null";
    if (bands[i].column >= 0) snprintf(column, sizeof column, "%lld", (long long)bands[i].column);
    if (bands[i].method[0]) snprintf(method, sizeof method, "\"%s\"", bands[i].method);
    used += (size_t)snprintf(out + used, cap - used, "%s{\"min_rows\":%lld,\"runtime\":\"%s\",\"artifact\":\"%s\",\"output_column\":%s,\"method\":%s}",
                             i ? "," : "", (long long)bands[i].min_rows, bands[i].runtime, bands[i].artifact, column, method);
  }
  if (used < cap) snprintf(out + used, cap - used, "]");
  return n;
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
  if (s == NULL) {
    TRITONSERVER_MessageDelete(config);
    return TRITONSERVER_ErrorNew(ERR_INTERNAL, "out of memory loading a scorestack model");
  }
  static __thread char plan_text[PLAN_MAX_BYTES + 1];
  char vdir[3072], runtime[64] = "", artifact[PLAN_NAME_MAX + 1] = "", column[32] = "", integrity[32] = "", threads[16] = "1";
  size_t plan_len = 0;
  snprintf(s->name, sizeof s->name, "%s", name);
  snprintf(vdir, sizeof vdir, "%s/%llu", location, (unsigned long long)version);
  /* the JSON is a copy we own only until the message is deleted: read everything now. The
   * parameters are the Python runtime's (scorestack_runtime.py): one artifact, or a dispatch plan. */
  int has_runtime = config_parameter(json, "scorestack_runtime", runtime, sizeof runtime, NULL);
  int has_plan = config_parameter(json, "scorestack_dispatch", plan_text, sizeof plan_text, &plan_len);
  int has_artifact = config_parameter(json, "scorestack_artifact", artifact, sizeof artifact, NULL);
  int has_column = config_parameter(json, "scorestack_output_column", column, sizeof column, NULL);
  config_parameter(json, "scorestack_integrity", integrity, sizeof integrity, NULL);
  config_parameter(json, "scorestack_threads", threads, sizeof threads, NULL);
  s->threads = atoi(threads);
  if (s->threads < 1) s->threads = 1;
  if (s->threads > MAX_THREADS) s->threads = MAX_THREADS;
  const char* in_block = strstr(json, "\"input\":[");
  int64_t in_width = in_block ? dims_product(in_block) : -1;
  const char* out_block = strstr(json, "\"output\":[");
  s->out_width = out_block ? dims_product(out_block) : -1;
  const char* out_name = out_block ? strstr(out_block, "\"name\":\"") : NULL;
  size_t out_len = 0;
  if (out_name != NULL) out_name += 8;
  int has_output = out_name != NULL && json_string(&out_name, out_name + strlen(out_name), s->output, sizeof s->output, &out_len) && out_len > 0 &&
                   out_len < sizeof s->output;
  TRITONSERVER_MessageDelete(config);

  if (in_width <= 0 || in_width > INT32_MAX || s->out_width <= 0 || !has_output)
    err = fail(ERR_INVALID_ARG, "model %s: the scorestack backend needs one FP32 input and one FP32 output with fixed dims", s->name);
  if (!err && strcmp(integrity, "sha256") == 0) err = check_integrity(s->name, vdir);
  if (!err) s->n_features = (int32_t)in_width;
  PlanBand bands[PLAN_MAX_BANDS];
  int n = 0;
  if (!err && has_runtime == 1 && strcmp(runtime, "dispatch") == 0) {
    char why[MSG / 2];
    if (has_plan == 0) snprintf(why, sizeof why, "the parameter is missing");
    else if (has_plan < 0) snprintf(why, sizeof why, "longer than %d bytes", PLAN_MAX_BYTES);
    n = has_plan == 1 ? parse_plan(plan_text, plan_len, bands, why, sizeof why) : 0;
    if (n == 0)
      err = fail(ERR_INVALID_ARG, "model %s: config parameter scorestack_dispatch cannot be read (%s); recompile the model (scorestack compile)", s->name,
                 why);
  } else if (!err) {
    /* One artifact: the single-artifact parameters, read as the Python runtime reads them. */
    char* end = column;
    long long c = has_column == 1 && column[0] ? strtoll(column, &end, 10) : -1;
    if (has_runtime != 1 || strcmp(runtime, "tl2cgen") != 0)
      err = fail(ERR_INVALID_ARG, "model %s: config parameter scorestack_runtime is '%s'; scorestack's native backend runs tl2cgen or dispatch; recompile the model (scorestack compile)",
                 s->name, has_runtime == 1 ? runtime : "");
    else if (has_artifact != 1 || artifact[0] == 0)
      err = fail(ERR_INVALID_ARG, "model %s: config parameter scorestack_artifact is missing; recompile the model (scorestack compile)", s->name);
    else if (has_column < 0 || *end != 0 || c < -1 || c > PLAN_INT_MAX || (column[0] && c < 0))
      err = fail(ERR_INVALID_ARG, "model %s: config parameter scorestack_output_column is not a column number; recompile the model (scorestack compile)", s->name);
    else {
      n = 1;
      memset(&bands[0], 0, sizeof bands[0]);
      bands[0].min_rows = 1;
      snprintf(bands[0].runtime, sizeof bands[0].runtime, "%s", runtime);
      snprintf(bands[0].artifact, sizeof bands[0].artifact, "%s", artifact);
      bands[0].column = c;
    }
  }
  for (int i = 0; !err && i < n; ++i) {
    if (strcmp(bands[i].runtime, "tl2cgen") != 0) {
      err = fail(ERR_INVALID_ARG,
                 "model %s: band %d of scorestack_dispatch runs %s, and scorestack's native backend runs tl2cgen only; recompile the model (scorestack compile)",
                 s->name, i + 1, bands[i].runtime);
      break;
    }
    Band* b = &s->bands[s->n_bands++];
    b->min_rows = bands[i].min_rows;
    b->column = bands[i].column;
    err = load_band(s, b, vdir, bands[i].artifact);
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
