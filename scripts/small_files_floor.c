/* The store layout's floor for many small files, compiled: the same system calls per file as FLOOR in
 * scripts/bench_prefetch.py (read the source in one preadv, sha256 it, write it to an O_TMPFILE in its blob
 * directory, name it with linkat, hard-link it into the snapshot tree; one syncfs at the end), with no
 * interpreter. It answers what a compiled helper could give: the Python floor minus this is the interpreter's
 * share of the system-call path, the fetch minus the Python floor is everything else (planning, checks, records).
 *   cc -O2 -o floor scripts/small_files_floor.c -lcrypto && ./floor SRC DST   -> "wall_s cpu_s" */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static double cpu(void) {
    struct rusage r; getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}
static void die(const char *what) { perror(what); exit(1); }
static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s SRC DST\n", argv[0]); return 2; }
    double c0 = cpu(), t0 = now();
    char path[4096], hex[65];
    static unsigned char buf[1 << 20];
    int subs[256]; for (int i = 0; i < 256; i++) subs[i] = -1;
    snprintf(path, sizeof path, "%s/blobs", argv[2]); mkdir(argv[2], 0755);
    if (mkdir(path, 0755)) die("mkdir blobs");
    int blobs = open(path, O_RDONLY | O_DIRECTORY);
    snprintf(path, sizeof path, "%s/tree", argv[2]);
    if (mkdir(path, 0755)) die("mkdir tree");
    int tree = open(path, O_RDONLY | O_DIRECTORY);
    DIR *top = opendir(argv[1]); if (!top) die("opendir");
    char *dirs[4096]; int nd = 0; struct dirent *e;
    while ((e = readdir(top))) if (e->d_name[0] != '.') dirs[nd++] = strdup(e->d_name);
    qsort(dirs, nd, sizeof *dirs, cmp);
    for (int i = 0; i < nd; i++) {
        if (mkdirat(tree, dirs[i], 0755)) die("mkdir tree dir");
        int out = openat(tree, dirs[i], O_RDONLY | O_DIRECTORY);
        snprintf(path, sizeof path, "%s/%s", argv[1], dirs[i]);
        DIR *d = opendir(path); if (!d) die("opendir dir");
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
            struct iovec v = {buf, sizeof buf};
            ssize_t n = preadv(fd, &v, 1, 0);
            struct stat st; fstat(fd, &st); close(fd);
            if (n < 0) die("preadv");
            unsigned char md[32]; SHA256(buf, n, md);
            for (int k = 0; k < 32; k++) sprintf(hex + 2 * k, "%02x", md[k]);
            int *sub = &subs[md[0]];
            if (*sub < 0) {
                char two[3] = {hex[0], hex[1], 0};
                mkdirat(blobs, two, 0755);
                *sub = openat(blobs, two, O_RDONLY | O_DIRECTORY);
            }
            int tmp = openat(*sub, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0444);
            if (tmp < 0 || write(tmp, buf, n) != n) die("tmpfile");
            if (linkat(tmp, "", *sub, hex, AT_EMPTY_PATH)) die("linkat");
            close(tmp);
            if (linkat(*sub, hex, out, e->d_name, 0)) die("link into tree");
        }
        closedir(d); close(out);
    }
    syncfs(blobs);
    printf("%f %f\n", now() - t0, cpu() - c0);
    return 0;
}
