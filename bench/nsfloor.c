/* nsfloor: how many sandboxes per second this kernel can make and unmake
 * with no runtime at all: the floor under crun, and under any zygote that
 * Corral could build. Each stage adds one thing a Corral container has.
 *
 *   nsfloor STAGE N ROOT CGROUP_PARENT
 *
 * stage 0  fork, exit                                 (a process)
 * stage 1  + user (ids mapped), mount, pid, ipc, uts, cgroup namespaces
 * stage 2  + a network namespace (lo only; no veth)
 * stage 3  + its own root: ROOT bound, /proc mounted, pivot_root, exec ROOT/true
 * stage 4  + a cgroup per sandbox in memory, pids and cpu (v1: made, joined,
 *            removed after the exit)
 * stage 5  + a writable root: an overlay of ROOT under a tmpfs (in place of
 *            the bind)
 *
 * Prints the wall seconds of N sequential make+unmake rounds. Errors exit 1
 * naming the step. Run as root. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int stage;
static const char *root;
static const char *cg_parent;
static const char *controllers[] = {"memory", "pids", "cpu"};

static void die(const char *what) {
    fprintf(stderr, "nsfloor: %s: %s\n", what, strerror(errno));
    _exit(1);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) die(path);
    close(fd);
}

static int sync_pipe[2];

static int child(void *arg) {
    (void)arg;
    char ok;
    /* The parent maps our ids (and joins us to our cgroups) first. */
    if (read(sync_pipe[0], &ok, 1) != 1) die("sync read");
    /* Root of its namespace by id too (host root maps to no id there: what
     * it made would be owned by the overflow id, and a tmpfs refuses that). */
    if (stage >= 1 && (setresgid(0, 0, 0) || setresuid(0, 0, 0))) die("become root");
    if (stage >= 3) {
        char proc[4096], top[4096], opts[8192];
        const char *new_root = root;
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("make / private");
        if (stage >= 5) {
            /* Its own writable root: ROOT read-only below, a tmpfs above. */
            snprintf(top, sizeof top, "%s/u", root);
            if (mount("tmpfs", top, "tmpfs", 0, "size=1m")) die("mount tmpfs");
            snprintf(proc, sizeof proc, "%s/up", top);
            if (mkdir(proc, 0755)) die("mkdir upper");
            snprintf(proc, sizeof proc, "%s/wk", top);
            if (mkdir(proc, 0755)) die("mkdir work");
            snprintf(proc, sizeof proc, "%s/m", top);
            if (mkdir(proc, 0755)) die("mkdir merged");
            snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=%s/up,workdir=%s/wk", root, top, top);
            if (mount("overlay", proc, "overlay", 0, opts)) die("mount overlay");
            new_root = strdup(proc);
        } else if (mount(root, root, NULL, MS_BIND, NULL)) {
            die("bind root");
        }
        snprintf(proc, sizeof proc, "%s/proc", new_root);
        if (mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) die("mount proc");
        if (chdir(new_root)) die("chdir root");
        if (syscall(SYS_pivot_root, ".", ".")) die("pivot_root");
        if (umount2(".", MNT_DETACH)) die("detach old root");
        execl("/true", "true", (char *)NULL);
        die("exec /true");
    }
    _exit(0);
}

static void one(int round) {
    static char stack[64 * 1024];
    int flags = SIGCHLD;
    char cg[3][512];
    if (stage >= 1)
        flags |= CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
                 CLONE_NEWCGROUP;
    if (stage >= 2) flags |= CLONE_NEWNET;
    if (stage >= 4)
        for (int i = 0; i < 3; i++) {
            snprintf(cg[i], sizeof cg[i], "/sys/fs/cgroup/%s/%s/r%d-%d", controllers[i],
                     cg_parent, getpid(), round);
            if (mkdir(cg[i], 0755)) die(cg[i]);
        }
    if (pipe2(sync_pipe, O_CLOEXEC)) die("pipe");
    pid_t pid = clone(child, stack + sizeof stack, flags, NULL);
    if (pid < 0) die("clone");
    if (stage >= 1) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/uid_map", pid);
        write_file(path, "0 200000 65536\n");
        snprintf(path, sizeof path, "/proc/%d/gid_map", pid);
        write_file(path, "0 200000 65536\n");
    }
    if (stage >= 4)
        for (int i = 0; i < 3; i++) {
            char path[1600], text[32];
            snprintf(path, sizeof path, "%s/cgroup.procs", cg[i]);
            snprintf(text, sizeof text, "%d\n", pid);
            write_file(path, text);
        }
    if (write(sync_pipe[1], "x", 1) != 1) die("sync write");
    close(sync_pipe[0]);
    close(sync_pipe[1]);
    int status;
    if (waitpid(pid, &status, 0) != pid) die("waitpid");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "nsfloor: round %d: child failed (status %d)\n", round, status);
        _exit(1);
    }
    if (stage >= 4)
        for (int i = 0; i < 3; i++)
            if (rmdir(cg[i])) die(cg[i]);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: nsfloor STAGE N ROOT CGROUP_PARENT\n");
        return 2;
    }
    stage = atoi(argv[1]);
    int n = atoi(argv[2]);
    root = argv[3];
    if (strlen(root) > 1000) {
        fprintf(stderr, "nsfloor: ROOT: at most 1000 characters\n");
        return 2;
    }
    cg_parent = argv[4];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n; i++) one(i);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6f\n", (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
