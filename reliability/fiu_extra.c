/*
 * Extra libfiu failure points, preloaded after libfiu's own POSIX wrappers.
 *
 * Debian's fiu_posix_preload.so wraps open, write, fsync, rename and unlink, but not
 * the calls that Python and the library actually use for directories:
 *
 *   - os.mkdir / os.makedirs        -> mkdir, mkdirat
 *   - renameat2(RENAME_NOREPLACE)   -> the commit rename of LocalStorage (via ctypes)
 *   - shutil.rmtree (fd-based)      -> openat, unlinkat (files and directories)
 *   - os.rmdir                      -> rmdir
 *
 * Each wrapper asks libfiu under the name of the operation it performs, so one
 * enabled point covers every syscall of that kind:
 *
 *   posix/io/dir/mkdir    mkdir, mkdirat                 (a new name: libfiu has none)
 *   posix/io/dir/rename   renameat, renameat2            (libfiu covers rename)
 *   posix/io/dir/unlink   unlinkat, rmdir                (libfiu covers unlink)
 *   posix/io/oc/open      openat                         (libfiu covers open)
 *
 * The errno of a failing call is the point's failinfo (EIO if none was given).
 *
 * This library also interposes fiu_fail() itself, so every failure that any
 * preloaded wrapper (libfiu's or ours) decides on is counted: acfiu_hits(name)
 * tells a campaign whether the fault it armed actually fired.
 *
 * Build: gcc -shared -fPIC -O2 -o fiu_extra.so fiu_extra.c -ldl   (libfiu resolved at
 * run time from the process, where fiu_run_preload.so has loaded it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_POINTS 64
#define NAME_LEN 96

static pthread_mutex_t hits_lock = PTHREAD_MUTEX_INITIALIZER;
static char hit_names[MAX_POINTS][NAME_LEN];
static long hit_counts[MAX_POINTS];
static int n_hits;

/* Set while one of our wrappers runs: libfiu's own wrappers may be reached from
 * inside the real call (they are not, today, but a recursion must never fail twice). */
static __thread int in_wrapper;

typedef int (*fail_fn)(const char *);
typedef void *(*failinfo_fn)(void);

static fail_fn real_fiu_fail(void) {
    static fail_fn fn;
    if (!fn) fn = (fail_fn)dlsym(RTLD_NEXT, "fiu_fail");
    return fn;
}

static failinfo_fn real_fiu_failinfo(void) {
    static failinfo_fn fn;
    if (!fn) fn = (failinfo_fn)dlsym(RTLD_NEXT, "fiu_failinfo");
    return fn;
}

static void record_hit(const char *name) {
    pthread_mutex_lock(&hits_lock);
    for (int i = 0; i < n_hits; i++) {
        if (strncmp(hit_names[i], name, NAME_LEN) == 0) {
            hit_counts[i]++;
            pthread_mutex_unlock(&hits_lock);
            return;
        }
    }
    if (n_hits < MAX_POINTS) {
        strncpy(hit_names[n_hits], name, NAME_LEN - 1);
        hit_counts[n_hits] = 1;
        n_hits++;
    }
    pthread_mutex_unlock(&hits_lock);
}

/* Interposes libfiu's fiu_fail: same answer, but failures are counted. */
int fiu_fail(const char *name) {
    fail_fn fn = real_fiu_fail();
    int r = fn ? fn(name) : 0;
    if (r) record_hit(name);
    return r;
}

/* How often point `name` failed a call since the last acfiu_reset(). */
long acfiu_hits(const char *name) {
    long n = 0;
    pthread_mutex_lock(&hits_lock);
    for (int i = 0; i < n_hits; i++)
        if (strncmp(hit_names[i], name, NAME_LEN) == 0) n = hit_counts[i];
    pthread_mutex_unlock(&hits_lock);
    return n;
}

void acfiu_reset(void) {
    pthread_mutex_lock(&hits_lock);
    n_hits = 0;
    pthread_mutex_unlock(&hits_lock);
}

/* 1 when the call must fail now (errno is set), else 0. */
static int should_fail(const char *name) {
    if (in_wrapper) return 0;
    if (!fiu_fail(name)) return 0;
    failinfo_fn info = real_fiu_failinfo();
    long code = info ? (long)info() : 0;
    errno = code ? (int)code : EIO;
    return 1;
}

#define REAL(ret, name, ...)                                      \
    static ret (*real_##name)(__VA_ARGS__);                       \
    if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name);

/* The body of a wrapper: fail as libfiu point `point` decides, else return what the
 * real call `call` returns (with in_wrapper set while it runs). */
#define FAIL_OR_CALL(point, call)                                 \
    do {                                                          \
        if (should_fail(point)) return -1;                        \
        in_wrapper++;                                             \
        int r_ = (call);                                          \
        in_wrapper--;                                             \
        return r_;                                                \
    } while (0)

int mkdir(const char *path, mode_t mode) {
    REAL(int, mkdir, const char *, mode_t);
    FAIL_OR_CALL("posix/io/dir/mkdir", real_mkdir(path, mode));
}

int mkdirat(int dirfd, const char *path, mode_t mode) {
    REAL(int, mkdirat, int, const char *, mode_t);
    FAIL_OR_CALL("posix/io/dir/mkdir", real_mkdirat(dirfd, path, mode));
}

int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    REAL(int, renameat, int, const char *, int, const char *);
    FAIL_OR_CALL("posix/io/dir/rename", real_renameat(olddirfd, oldpath, newdirfd, newpath));
}

int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath,
              unsigned int flags) {
    REAL(int, renameat2, int, const char *, int, const char *, unsigned int);
    FAIL_OR_CALL("posix/io/dir/rename",
                 real_renameat2(olddirfd, oldpath, newdirfd, newpath, flags));
}

int unlinkat(int dirfd, const char *path, int flags) {
    REAL(int, unlinkat, int, const char *, int);
    FAIL_OR_CALL("posix/io/dir/unlink", real_unlinkat(dirfd, path, flags));
}

int rmdir(const char *path) {
    REAL(int, rmdir, const char *);
    FAIL_OR_CALL("posix/io/dir/unlink", real_rmdir(path));
}

static int openat_impl(int (*real)(int, const char *, int, ...), int dirfd, const char *path,
                       int flags, va_list ap) {
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) mode = (mode_t)va_arg(ap, int);
    FAIL_OR_CALL("posix/io/oc/open", real(dirfd, path, flags, mode));
}

/* openat and openat64: the mode argument is there only with O_CREAT or O_TMPFILE. */
#define OPENAT(name)                                                  \
    int name(int dirfd, const char *path, int flags, ...) {           \
        REAL(int, name, int, const char *, int, ...);                 \
        va_list ap;                                                   \
        va_start(ap, flags);                                          \
        int r = openat_impl(real_##name, dirfd, path, flags, ap);     \
        va_end(ap);                                                   \
        return r;                                                     \
    }

OPENAT(openat)
OPENAT(openat64)
