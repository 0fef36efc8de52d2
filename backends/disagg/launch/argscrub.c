/* argscrub: keeps the values of secret options out of a program's /proc/PID/cmdline.
 *
 * Loaded into tritonserver with LD_PRELOAD. Its constructor runs in the dynamic loader, before main
 * and before any thread exists: for each argument that starts with one of the prefixes in
 * $DISAGG_SCRUB_PREFIXES (separated by '\n'), it points argv[i] at a copy on the heap, which main then
 * parses, and overwrites the original bytes after the prefix with '*'. /proc/PID/cmdline reads those
 * original bytes, so `ps` and every local user see the option with its value masked.
 *
 * The window: from execve until this constructor runs (the loader mapping the program's libraries,
 * about a millisecond), the value is readable in /proc/PID/cmdline.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#define PREFIXES_ENV "DISAGG_SCRUB_PREFIXES"

static int scrubbed;

int argscrub_count(void) { return scrubbed; }

static int matches(const char *arg, const char *prefixes, size_t *prefix_len) {
    const char *p = prefixes;
    while (*p) {
        const char *end = strchr(p, '\n');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0 && strncmp(arg, p, n) == 0) {
            *prefix_len = n;
            return 1;
        }
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

__attribute__((constructor)) static void scrub(int argc, char **argv, char **envp) {
    (void)envp;
    const char *prefixes = getenv(PREFIXES_ENV);
    if (prefixes == NULL || argv == NULL) return;
    for (int i = 1; i < argc; i++) {
        size_t n;
        if (argv[i] == NULL || !matches(argv[i], prefixes, &n)) continue;
        char *copy = strdup(argv[i]);
        if (copy == NULL) abort(); /* never run with the secret exposed, nor without it */
        memset(argv[i] + n, '*', strlen(argv[i] + n));
        argv[i] = copy;
        scrubbed++;
    }
}
