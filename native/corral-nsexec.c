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
 * With --unified DIR, DIR is bound where it was (see below).
 *
 * With --idmap HOSTID:SIZE the sandbox runs in a user namespace whose root
 * is host uid/gid HOSTID: every lower layer is then mounted here again
 * through an idmapped mount (mount_setattr), so files that are root's in a
 * layer are root's inside the sandbox. (The upper is not idmapped: overlay
 * works in it with the mounter's credentials, which an idmapping of the
 * sandbox's ids cannot express; what the sandbox writes is stored with its
 * host ids, and a commit reads it back through --view.) Staging mounts go
 * under STAGE.
 *
 * --view SRC DST MAP mounts SRC at DST through an idmapping with the uid/gid
 * map line MAP ("inside outside count") before running the program: how a
 * committed layer reads a sandbox's upper with its ids shifted back.
 *
 * --limits PID NAME=VALUE... enters the user namespace of process PID (a
 * sandbox's init) and writes each /proc/sys/user/NAME there: limits of the
 * kernel's per-user-namespace counters (inotify instances and watches,
 * fanotify groups and marks). Without them every sandbox's charge lands on
 * one account, the host root's that created its namespace, and one sandbox
 * could exhaust it for all the others and for the host's own services.
 * The values show only from inside that namespace, hence the setns.
 *
 * With --limits-of PIDFILE [--limit NAME=VALUE]... the program runs as a
 * child; when it has exited 0, the same limits are set in the namespace of
 * the process whose pid it wrote to PIDFILE (crun run --detach --pid-file).
 *
 * --exec-fd N runs the program from the executable open at fd N (execveat)
 * rather than from argv[0]'s path: the agent hands crun as a sealed memfd,
 * which crun takes as its own clone (CVE-2019-5736) instead of copying
 * itself, re-executing and bind-mounting on every call (docs/container-runtime.md).
 *
 * usage: corral-nsexec --limits PID NAME=VALUE...
 *        corral-nsexec [--hybrid [--unified DIR]] [--overlay LOWER UPPER WORK TARGET]
 *                      [--idmap HOSTID:SIZE --stage DIR] [--view SRC DST MAP]
 *                      [--listen-fd N] [--log FILE] [--exec-fd N]
 *                      [--limits-of PIDFILE [--limit NAME=VALUE]...]
 *                      -- PROGRAM ARGS...
 * Exit status 125 means corral-nsexec itself failed (message on stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/mount.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((noreturn)) static void die(const char *what, const char *obj) {
    fprintf(stderr, "corral-nsexec: %s %s: %s\n", what, obj, strerror(errno));
    exit(125);
}

/* A user namespace with the uid_map/gid_map line `map` ("inside outside
 * count"), kept alive by a child until its fd is open; returns the fd. */
static int make_userns(const char *map) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) die("pipe", "userns");
    pid_t parent = getpid();
    pid_t c = fork();
    if (c < 0) die("fork", "userns");
    if (c == 0) {
        char x = 0;
        /* It waits to be killed by us: if we end first (an error, or the
         * agent killing a create it gave up on), it goes too, instead of
         * pausing forever with its namespace (one was found an hour on). */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != parent) _exit(1);
        if (unshare(CLONE_NEWUSER) < 0) _exit(1);
        if (write(p[1], &x, 1) < 0) _exit(1);
        pause();
        _exit(0);
    }
    close(p[1]);
    char x;
    if (read(p[0], &x, 1) != 1) die("creating", "user namespace");
    close(p[0]);
    char path[64];
    int n = (int)strlen(map);
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "/proc/%d/%s", c, i ? "gid_map" : "uid_map");
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, map, (size_t)n) != n) die("writing", path);
        close(fd);
    }
    snprintf(path, sizeof path, "/proc/%d/ns/user", c);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die("opening", path);
    kill(c, SIGKILL);
    waitpid(c, NULL, 0);
    return ns;
}

/* Mount `src` again at `dst` through the user namespace's id mapping. */
static void idmapped(int userns, const char *src, const char *dst) {
    int t = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (t < 0) die("open_tree", src);
    struct mount_attr attr = {0};
    attr.attr_set = MOUNT_ATTR_IDMAP;
    attr.userns_fd = (unsigned long long)userns;
    if (syscall(SYS_mount_setattr, t, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
        die("idmapping", src);
    if (mkdir(dst, 0700) < 0 && errno != EEXIST) die("mkdir", dst);
    if (syscall(SYS_move_mount, t, "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) < 0)
        die("move_mount to", dst);
    close(t);
}


static void exec_program(const char *log, char **argv) __attribute__((noreturn));
static int exec_fd = -1;

static int limits(const char *pid, int argc, char **argv) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/ns/user", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) die("opening", path);
    if (setns(ns, CLONE_NEWUSER) < 0) die("entering", path);
    for (int i = 0; i < argc; i++) {
        char name[64], file[128];
        const char *eq = strchr(argv[i], '=');
        if (!eq || eq == argv[i] || (size_t)(eq - argv[i]) >= sizeof name || strchr(argv[i], '/')) {
            fprintf(stderr, "corral-nsexec: --limits takes NAME=VALUE, not %s\n", argv[i]);
            return 125;
        }
        memcpy(name, argv[i], (size_t)(eq - argv[i]));
        name[eq - argv[i]] = 0;
        snprintf(file, sizeof file, "/proc/sys/user/%s", name);
        int fd = open(file, O_WRONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT) continue; /* this kernel does not count it */
            die("opening", file);
        }
        size_t n = strlen(eq + 1);
        if (write(fd, eq + 1, n) != (ssize_t)n) die("writing", file);
        close(fd);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "--limits")) return limits(argv[2], argc - 3, argv + 3);
    int hybrid = 0, listen_fd = -1, nlimits = 0;
    const char *lower = NULL, *upper = NULL, *work = NULL, *target = NULL, *log = NULL;
    const char *limits_of = NULL, *unified = NULL;
    char *limit[16];
    const char *idmap = NULL, *stage = NULL, *view_src = NULL, *view_dst = NULL, *view_map = NULL;
    int i = 1;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (!strcmp(argv[i], "--hybrid")) hybrid = 1;
        else if (!strcmp(argv[i], "--unified") && i + 1 < argc) unified = argv[++i];
        else if (!strcmp(argv[i], "--overlay") && i + 4 < argc) {
            lower = argv[++i]; upper = argv[++i]; work = argv[++i]; target = argv[++i];
        } else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) listen_fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--log") && i + 1 < argc) log = argv[++i];
        else if (!strcmp(argv[i], "--exec-fd") && i + 1 < argc) {
            /* Moved out of the way of fd 3 (the listener's place) and closed
             * on exec: the program runs from it, and keeps none of it. */
            int fd = atoi(argv[++i]);
            exec_fd = fcntl(fd, F_DUPFD_CLOEXEC, 10);
            if (exec_fd < 0) die("--exec-fd", argv[i]);
            close(fd);
        }
        else if (!strcmp(argv[i], "--idmap") && i + 1 < argc) idmap = argv[++i];
        else if (!strcmp(argv[i], "--stage") && i + 1 < argc) stage = argv[++i];
        else if (!strcmp(argv[i], "--limits-of") && i + 1 < argc) limits_of = argv[++i];
        else if (!strcmp(argv[i], "--limit") && i + 1 < argc && nlimits < 16) limit[nlimits++] = argv[++i];
        else if (!strcmp(argv[i], "--view") && i + 3 < argc) {
            view_src = argv[++i]; view_dst = argv[++i]; view_map = argv[++i];
        }
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
    /* What the unmount leaves at that path is a directory of the host's
     * tmpfs at /sys/fs/cgroup: crun (taking it for the cgroup2 hierarchy of
     * /proc/self/cgroup's "0::" line) makes each container's cgroup there as
     * a directory holding a cgroup.procs file, which no delete removes: two
     * inodes of host kernel memory for good per container. The node's own
     * directory, bound over it, takes them instead, and the node removes
     * them with the container. (Read-only would not do: crun 1.8 means to
     * skip a hierarchy it gets EROFS on, but reports the errno of the stat
     * it makes after the failed mkdir.) */
    if (hybrid && unified && mount(unified, "/sys/fs/cgroup/unified", NULL, MS_BIND, NULL) < 0)
        die("binding over /sys/fs/cgroup/unified", unified);
    char lowers[4096];
    if (target && idmap) {
        unsigned long base, size;
        if (!stage || sscanf(idmap, "%lu:%lu", &base, &size) != 2) {
            fprintf(stderr, "corral-nsexec: --idmap needs HOSTID:SIZE and --stage\n");
            return 125;
        }
        char map[64];
        snprintf(map, sizeof map, "0 %lu %lu\n", base, size);
        int ns = make_userns(map);
        char *copy = strdup(lower), *save = NULL, *out = lowers;
        size_t left = sizeof lowers;
        int k = 0;
        for (char *l = strtok_r(copy, ":", &save); l; l = strtok_r(NULL, ":", &save), k++) {
            char dst[1024];
            snprintf(dst, sizeof dst, "%s/l%d", stage, k);
            idmapped(ns, l, dst);
            int w = snprintf(out, left, "%s%s", k ? ":" : "", dst);
            if (w < 0 || (size_t)w >= left) { errno = E2BIG; die("lower list for", target); }
            out += w;
            left -= (size_t)w;
        }
        free(copy);
        lower = lowers;
        close(ns);
    }
    if (view_src) {
        char map[128];
        snprintf(map, sizeof map, "%s\n", view_map);
        int ns = make_userns(map);
        idmapped(ns, view_src, view_dst);
        close(ns);
    }
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
    if (limits_of) {
        /* The program (crun run --detach) runs as our child; once it has
         * started the container, its init's pid is in limits_of and its
         * namespace gets the limits before anything else runs there (the
         * agent sends no command until the create returns). One process
         * fewer per create than a second corral-nsexec --limits. Our
         * stderr stays the caller's, for what goes wrong here. */
        pid_t child = fork();
        if (child < 0) die("fork", argv[i]);
        if (child == 0) {
            if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) die("prctl", "PDEATHSIG");
            exec_program(log, argv + i);
        }
        if (listen_fd >= 0) close(3);
        int status;
        while (waitpid(child, &status, 0) < 0)
            if (errno != EINTR) die("waiting for", argv[i]);
        if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
        if (WEXITSTATUS(status) != 0) return WEXITSTATUS(status);
        char pid[32] = {0};
        int pf = open(limits_of, O_RDONLY | O_CLOEXEC);
        if (pf < 0) die("opening", limits_of);
        ssize_t got = read(pf, pid, sizeof pid - 1);
        if (got <= 0) die("reading", limits_of);
        close(pf);
        pid[strcspn(pid, "\n")] = 0;
        return limits(pid, nlimits, limit);
    }
    exec_program(log, argv + i);
    return 125;
}

/* stdout and stderr to `log` if given, and stdin from it (read-only, at
 * its end), else from /dev/null; then exec. Not the host's /dev/null when
 * a runtime starts a container: crun 1.8 fchowns its stdio to the
 * container's root before it reopens stdin inside, and the host's
 * /dev/null, owned by a sandbox's root, could then be chmod-ed by every
 * sandbox of that id block (found: 0640 from inside broke it for the
 * host's users). The log is the sandbox's own file. */
static void exec_program(const char *log, char **argv) {
    if (log) {
        int lf = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (lf < 0) die("opening", log);
        int in = open(log, O_RDONLY | O_CLOEXEC);
        if (in < 0 || lseek(in, 0, SEEK_END) < 0) die("opening", log);
        dup2(in, 0);
        dup2(lf, 1);
        dup2(lf, 2);
    } else {
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null < 0) die("opening", "/dev/null");
        dup2(null, 0);
    }
    if (exec_fd >= 0) {
        extern char **environ;
        syscall(SYS_execveat, exec_fd, "", argv, environ, AT_EMPTY_PATH);
    } else {
        execvp(argv[0], argv);
    }
    die("executing", argv[0]);
}
