/*
 * corral-nsexec: run a program (crun) in a fresh, private mount namespace.
 *
 * Why: a sandbox's overlay root must never appear in the host's mount table
 * (a crashed agent would leak it). Mounting it here, in a namespace created
 * for this one crun invocation, means the container's own mount namespace
 * (copied from this one) is the only thing holding it: the mount disappears
 * when the sandbox's last process exits, whatever happens to the agent.
 *
 * On hosts with cgroup v1 controllers plus a cgroup2 mount at
 * /sys/fs/cgroup/unified ("hybrid"), crun 1.8 refuses to run; unmounting
 * that cgroup2 mount inside this private namespace makes it choose v1.
 *
 * usage: corral-nsexec [--hybrid] [--overlay LOWER UPPER WORK TARGET]
 *                      [--listen-fd N] [--log FILE] -- PROGRAM ARGS...
 * Exit status 125 means corral-nsexec itself failed (message on stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <unistd.h>

static void die(const char *what, const char *obj) {
    fprintf(stderr, "corral-nsexec: %s %s: %s\n", what, obj, strerror(errno));
    exit(125);
}

int main(int argc, char **argv) {
    int hybrid = 0, listen_fd = -1;
    const char *lower = NULL, *upper = NULL, *work = NULL, *target = NULL, *log = NULL;
    int i = 1;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (!strcmp(argv[i], "--hybrid")) hybrid = 1;
        else if (!strcmp(argv[i], "--overlay") && i + 4 < argc) {
            lower = argv[++i]; upper = argv[++i]; work = argv[++i]; target = argv[++i];
        } else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) listen_fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--log") && i + 1 < argc) log = argv[++i];
        else { fprintf(stderr, "corral-nsexec: unknown option %s\n", argv[i]); return 125; }
    }
    if (i >= argc) { fprintf(stderr, "corral-nsexec: no program given\n"); return 125; }

    /* If the agent dies while crun works, crun dies too: a restarted agent
     * must never race a crun still creating a container it is reclaiming.
     * (The container's own init is not affected: the setting is not
     * inherited across fork.) */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) die("prctl", "PDEATHSIG");
    const char *agent = getenv("CORRAL_AGENT_PID");
    if (agent && getppid() != (pid_t)atoi(agent)) {
        fprintf(stderr, "corral-nsexec: the agent exited before we started\n");
        return 125;
    }

    if (unshare(CLONE_NEWNS) < 0) die("unshare", "mount namespace");
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("making private", "/");
    if (hybrid && umount2("/sys/fs/cgroup/unified", MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
        die("unmounting", "/sys/fs/cgroup/unified");
    if (target) {
        char opts[4096];
        int n = snprintf(opts, sizeof opts,
                         "lowerdir=%s,upperdir=%s,workdir=%s,redirect_dir=off,metacopy=off,volatile",
                         lower, upper, work);
        if (n < 0 || (size_t)n >= sizeof opts) { errno = E2BIG; die("overlay options for", target); }
        if (mount("overlay", target, "overlay", MS_NODEV, opts) < 0) die("mounting overlay on", target);
    }
    if (listen_fd >= 0 && listen_fd != 3) {
        if (dup2(listen_fd, 3) < 0) die("dup2", "listen fd");
        close(listen_fd);
    }
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0) die("opening", "/dev/null");
    dup2(null, 0);
    if (log) {
        int lf = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (lf < 0) die("opening", log);
        dup2(lf, 1);
        dup2(lf, 2);
    }
    execv(argv[i], argv + i);
    die("executing", argv[i]);
    return 125;
}
