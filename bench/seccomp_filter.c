/* What a seccomp filter costs the kernel, by layout (bench/seccomp_filter.py).
 *
 *   seccomp_filter attach FILTER ROUNDS   fork, attach FILTER (with a
 *       notification listener, as a sandbox's is), exit; ROUNDS times.
 *       FILTER "-" forks and exits only. Prints microseconds per round, each.
 *   seccomp_filter calls FILTER N         attach FILTER, then N getppid
 *       (answered from the kernel's action cache), N ioctl TCGETS and N
 *       socket(AF_UNIX)+close (which run the filter, their rules read
 *       arguments). Prints nanoseconds per call of each.
 */
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static struct sock_filter insns[8192];
static struct sock_fprog prog;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static void load(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(2); }
    prog.len = fread(insns, sizeof insns[0], 8192, f);
    prog.filter = insns;
    fclose(f);
}

static int attach(void) {
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    return syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s attach|calls FILTER N\n", argv[0]); return 2; }
    int none = !strcmp(argv[2], "-"), n = atoi(argv[3]);
    if (!none) load(argv[2]);
    if (!strcmp(argv[1], "attach")) {
        for (int i = 0; i < n; i++) {
            double t0 = now_ns();
            pid_t p = fork();
            if (p == 0) _exit(none ? 0 : attach() < 0);
            int st;
            waitpid(p, &st, 0);
            if (!WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "attach failed\n"); return 1; }
            printf("%.1f\n", (now_ns() - t0) / 1000.0);
        }
        return 0;
    }
    if (!none && attach() < 0) { perror("seccomp"); return 1; }
    struct termios t;
    double a = now_ns();
    for (int i = 0; i < n; i++) syscall(SYS_getppid);
    double b = now_ns();
    for (int i = 0; i < n; i++) ioctl(99, TCGETS, &t);
    double c = now_ns();
    for (int i = 0; i < n; i++) close(socket(AF_UNIX, SOCK_STREAM, 0));
    double d = now_ns();
    printf("%.1f %.1f %.1f\n", (b - a) / n, (c - b) / n, (d - c) / n);
    return 0;
}
