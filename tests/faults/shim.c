/* A fault injector at the OS boundary, for the crash tests (tests/test_crash.py builds it and
 * preloads it with LD_PRELOAD). Every call that publishes bytes under $FAULT_DIR is a point: a
 * write(2)-family call or fsync on a regular file there, a rename into a folder there. From the
 * $FAULT_AT-th point on (1-based) each fails with $FAULT_ERRNO (default ENOSPC: the disk stays
 * full), or the process is SIGKILLed at exactly that point, before the call ($FAULT_ACTION=kill).
 * Python, numpy and safetensors' Rust all call these libc symbols. At exit the number of points is
 * written to $FAULT_COUNT (when set), so a clean run tells how many points a path has. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static long count = 0;

static int counted(int fd) {
    const char *dir = getenv("FAULT_DIR");
    struct stat st;
    char link[64], path[PATH_MAX];
    if (dir == NULL || fd <= 2 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) return 0;
    path[n] = 0;
    return strncmp(path, dir, strlen(dir)) == 0;
}

static int counted_path(const char *p) {
    const char *dir = getenv("FAULT_DIR");
    char copy[PATH_MAX], real[PATH_MAX];
    if (dir == NULL) return 0;
    snprintf(copy, sizeof copy, "%s", p);
    char *slash = strrchr(copy, '/');
    if (slash == NULL) snprintf(copy, sizeof copy, ".");
    else if (slash == copy) copy[1] = 0;
    else *slash = 0;
    if (realpath(copy, real) == NULL) return 0;
    return strncmp(real, dir, strlen(dir)) == 0;
}

/* 1: fail this call (errno set); 0: go on. */
static int point(int yes) {
    if (!yes) return 0;
    long k = __atomic_add_fetch(&count, 1, __ATOMIC_SEQ_CST);
    const char *at = getenv("FAULT_AT");
    if (at == NULL || k < atol(at)) return 0;
    const char *action = getenv("FAULT_ACTION");
    if (action != NULL && strcmp(action, "kill") == 0) kill(getpid(), SIGKILL);
    const char *e = getenv("FAULT_ERRNO");
    errno = e ? atoi(e) : ENOSPC;
    return 1;
}

ssize_t write(int fd, const void *buf, size_t n) {
    static ssize_t (*real)(int, const void *, size_t);
    if (!real) real = dlsym(RTLD_NEXT, "write");
    return point(counted(fd)) ? -1 : real(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite");
    return point(counted(fd)) ? -1 : real(fd, buf, n, off);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite64");
    return point(counted(fd)) ? -1 : real(fd, buf, n, off);
}

ssize_t writev(int fd, const struct iovec *iov, int n) {
    static ssize_t (*real)(int, const struct iovec *, int);
    if (!real) real = dlsym(RTLD_NEXT, "writev");
    return point(counted(fd)) ? -1 : real(fd, iov, n);
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fsync");
    return point(counted(fd)) ? -1 : real(fd);
}

int rename(const char *old, const char *new) {
    static int (*real)(const char *, const char *);
    if (!real) real = dlsym(RTLD_NEXT, "rename");
    return point(counted_path(new)) ? -1 : real(old, new);
}

__attribute__((destructor)) static void report(void) {
    const char *out = getenv("FAULT_COUNT");
    if (out == NULL) return;
    FILE *f = fopen(out, "w");
    if (f) { fprintf(f, "%ld\n", count); fclose(f); }
}
