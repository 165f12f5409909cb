/* The in-process Triton's callbacks, in C so that Triton's threads never take Python's GIL.
 *
 * Triton calls these on its own threads: the response allocator (malloc/free of output buffers), the
 * request release (delete the request) and the response completion, which queues the response and
 * signals an eventfd that the asyncio loop watches (serve/inprocess.py drains the queue on the loop's
 * thread). Built at first use with the system C compiler; the Triton symbols resolve against
 * libtritonserver, loaded before this library. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

extern void *TRITONSERVER_InferenceRequestDelete(void *request);

void *scorestack_alloc(void *allocator, const char *name, size_t size, int memory_type, int64_t memory_type_id, void *userp,
                       void **buffer, void **buffer_userp, int *actual_type, int64_t *actual_id) {
  (void)allocator; (void)name; (void)memory_type; (void)memory_type_id; (void)userp;
  *buffer = size ? malloc(size) : NULL;
  *buffer_userp = NULL;
  *actual_type = 0; /* CPU */
  *actual_id = 0;
  return NULL;
}

void *scorestack_release(void *allocator, void *buffer, void *buffer_userp, size_t size, int memory_type, int64_t memory_type_id) {
  (void)allocator; (void)buffer_userp; (void)size; (void)memory_type; (void)memory_type_id;
  free(buffer);
  return NULL;
}

void scorestack_request_release(void *request, uint32_t flags, void *userp) {
  (void)userp;
  if (flags & 1u) TRITONSERVER_InferenceRequestDelete(request);
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static void **responses;
static uint64_t *keys;
static size_t capacity, count;
static int wake = -1;

void scorestack_response_complete(void *response, uint32_t flags, void *userp) {
  (void)flags;
  if (response == NULL) return; /* the final flag alone */
  pthread_mutex_lock(&lock);
  if (count == capacity) {
    size_t grown = capacity ? 2 * capacity : 1024;
    void **r = realloc(responses, grown * sizeof *r);
    uint64_t *k = realloc(keys, grown * sizeof *k);
    if (r) responses = r;
    if (k) keys = k;
    if (r && k) capacity = grown;
  }
  if (count < capacity) {
    responses[count] = response;
    keys[count] = (uint64_t)(uintptr_t)userp;
    count++;
  }
  pthread_mutex_unlock(&lock);
  uint64_t one = 1;
  ssize_t ignored = write(wake, &one, sizeof one);
  (void)ignored;
}

int scorestack_wake_fd(void) {
  if (wake < 0) wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  return wake;
}

/* Move up to `max` completed responses out; returns how many. */
size_t scorestack_drain(void **out_responses, uint64_t *out_keys, size_t max) {
  uint64_t value;
  ssize_t ignored = read(wake, &value, sizeof value);
  (void)ignored;
  pthread_mutex_lock(&lock);
  size_t n = count < max ? count : max;
  memcpy(out_responses, responses, n * sizeof *responses);
  memcpy(out_keys, keys, n * sizeof *keys);
  memmove(responses, responses + n, (count - n) * sizeof *responses);
  memmove(keys, keys + n, (count - n) * sizeof *keys);
  count -= n;
  pthread_mutex_unlock(&lock);
  if (count) { /* more than `max` were waiting: stay readable */
    uint64_t one = 1;
    ignored = write(wake, &one, sizeof one);
  }
  return n;
}
