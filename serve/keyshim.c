
/* scorestack: put the admin key into tritonserver's argv from an inherited pipe (serve/security.py). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void die(const char *why) {
    static const char prefix[] = "scorestack admin-key handoff: ";
    (void)!write(2, prefix, sizeof prefix - 1);
    (void)!write(2, why, strlen(why));
    (void)!write(2, "\n", 1);
    _exit(78);
}

__attribute__((constructor)) static void scorestack_key_handoff(int argc, char **argv, char **envp) {
    (void)envp;
    const char *fd_text = getenv("SCORESTACK_ADMIN_KEY_FD");
    const char *mark_env = getenv("SCORESTACK_ADMIN_KEY_PLACEHOLDER");
    if (!fd_text || !mark_env) return;            /* not a tritonserver we started: do nothing */
    char mark[128];
    size_t mark_len = strlen(mark_env);
    if (mark_len == 0 || mark_len >= sizeof mark) die("bad placeholder");
    memcpy(mark, mark_env, mark_len + 1);
    int fd = atoi(fd_text);
    char key[1024];
    size_t n = 0;
    for (;;) {
        ssize_t got = read(fd, key + n, sizeof key - 1 - n);
        if (got < 0) die("cannot read the key from its pipe");
        if (got == 0) break;
        n += (size_t)got;
        if (n == sizeof key - 1) die("key too long");
    }
    close(fd);
    while (n && (key[n - 1] == '\n' || key[n - 1] == '\r')) n--;
    key[n] = 0;
    if (n == 0) die("empty key on its pipe");
    /* Children (the Python backend's stubs) neither need nor get any of it. */
    unsetenv("SCORESTACK_ADMIN_KEY_FD");
    unsetenv("SCORESTACK_ADMIN_KEY_PLACEHOLDER");
    /* LD_PRELOAD is "<this library>[:what the caller had]": children keep only the caller's part. */
    const char *preload = getenv("LD_PRELOAD");
    const char *rest = preload ? strchr(preload, ':') : NULL;
    if (rest && rest[1]) setenv("LD_PRELOAD", rest + 1, 1); else unsetenv("LD_PRELOAD");
    int replaced = 0;
    for (int i = 0; i < argc; i++) {
        char *at = strstr(argv[i], mark);
        if (!at) continue;
        size_t len = strlen(argv[i]), head = (size_t)(at - argv[i]);
        char *copy = malloc(len - mark_len + n + 1);
        if (!copy) die("out of memory");
        memcpy(copy, argv[i], head);
        memcpy(copy + head, key, n);
        strcpy(copy + head + n, at + mark_len);
        argv[i] = copy;                           /* main() sees this; /proc/<pid>/cmdline does not */
        replaced++;
    }
    memset(key, 0, sizeof key);
    if (!replaced) die("no argument holds the placeholder");
}
