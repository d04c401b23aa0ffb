/*
 * corral-run: start one Corral container from a plan, in place of `crun run
 * --detach` (docs/container-runtime.md, "Corral's own runtime").
 *
 * crun spends most of a create on being crun: starting (ten shared
 * libraries), reading JSON, forking itself, exiting. Corral asks for one
 * shape of container only; runtimes/container/runplan.py turns its OCI
 * config into a plan of the few operations that shape needs, refusing any
 * field it does not translate, and this program carries them out.
 *
 * Run by corral-nsexec (after `--`), in the private mount namespace where
 * the sandbox's overlay is mounted at the plan's root; the cgroups are made
 * and limited beforehand by the agent (host/cgroups.py Cgroups.create).
 *
 * The plan is a file of NUL-terminated tokens: a directive, then its
 * arguments (runplan.py lists them). Order of work:
 *   parent  clone(2) the child into new namespaces (not the cgroup one);
 *           write its uid/gid maps; move it into its cgroups; let it go
 *   child   become root of its user namespace; unshare the cgroup
 *           namespace (rooted at its own cgroups); mount /proc, /dev, /sys
 *           and the binds, each target resolved inside the root
 *           (openat2 RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS: a symlink
 *           in the image on a target's path fails the start, as runc
 *           refuses one, rather than moving a mount, say /proc, where
 *           the masks would not find it); masks and read-only paths; pivot_root;
 *           hostname, loopback up, rlimits; capabilities and no_new_privs;
 *           close every fd but 0-3; the seccomp filter, its listener sent
 *           to corral-seccompd; exec the init
 *   parent  waits for the exec (a close-on-exec pipe reaches EOF) or an
 *           error (the child's message on the same pipe), writes the pid
 *           file and exits 0: the init is left detached, as crun leaves it.
 * No code of the sandbox runs before the exec: the init is Corral's own.
 * Exit status 1 with a message on stderr if anything fails; the child is
 * killed then, and the caller removes the cgroups.
 *
 * usage: corral-run PLAN
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/close_range.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_TOKENS 4096
/* Namespaces the child makes itself (below); the others come with clone. */
#define LATE_NS (CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET)
#define MAX_LIST 256

static int err_fd = 2; /* the child reports on the pipe to its parent */

__attribute__((noreturn, format(printf, 1, 2))) static void fail(const char *fmt, ...) {
    int e = errno;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof msg) n = sizeof msg - 1;
    n += snprintf(msg + n, sizeof msg - (size_t)n, ": %s\n", e ? strerror(e) : "invalid");
    if ((size_t)n >= sizeof msg) n = sizeof msg - 1;
    if (write(err_fd, "corral-run: ", 12) < 0 || write(err_fd, msg, (size_t)n) < 0) {}
    _exit(1);
}

/* ------------------------------------------------------------------ plan */

/* What is done inside the root, in the plan's order. */
enum kind { MOUNT, BIND, DEV, SYMLINK, DIR_, MASK, READONLY };
struct op {
    enum kind kind;
    const char *a, *b, *c;   /* MOUNT type dest data; BIND src dest; DEV name;
                                SYMLINK target path; DIR_ path mode; MASK/READONLY path */
    unsigned long long n;    /* MOUNT MS_* flags; BIND MOUNT_ATTR_* */
    int recursive;           /* BIND */
};
struct rlim { int res; rlim_t soft, hard; };

static struct plan {
    const char *root, *hostname, *cwd, *pidfile, *seccomp, *listener, *metadata;
    int readonly_root, oom_set, oom, lo_up;
    unsigned long ns;
    unsigned long host_id, id_size;
    unsigned long long caps;
    int has_caps;
    const char *cgroups[16]; int ncgroups;
    struct op ops[MAX_LIST * 2]; int nops;
    struct rlim rlims[16]; int nrlims;
    char *env[MAX_LIST + 1]; int nenv;
    char *args[64]; int nargs;
} P;

static unsigned long long num(const char *s, const char *what) {
    char *end;
    if (*s == '-' || *s == '+' || *s == ' ') { errno = EINVAL; fail("plan: %s is not a number: %s", what, s); }
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end) { errno = EINVAL; fail("plan: %s is not a number: %s", what, s); }
    return v;
}

static void read_plan(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("opening plan %s", path);
    struct stat st;
    if (fstat(fd, &st) < 0) fail("stat %s", path);
    char *buf = malloc((size_t)st.st_size + 1);
    if (!buf) fail("plan of %lld bytes", (long long)st.st_size);
    ssize_t got = 0;
    while (got < st.st_size) {
        ssize_t n = read(fd, buf + got, (size_t)(st.st_size - got));
        if (n <= 0) fail("reading %s", path);
        got += n;
    }
    close(fd);
    buf[got] = 0;
    char *tok[MAX_TOKENS];
    int nt = 0;
    for (char *p = buf; p < buf + got; p += strlen(p) + 1) {
        if (nt == MAX_TOKENS) { errno = E2BIG; fail("plan %s", path); }
        tok[nt++] = p;
    }
    if (got == 0 || buf[got - 1] != 0) { errno = EINVAL; fail("plan %s: not NUL-terminated", path); }
#define NEED(k) do { if (i + (k) >= nt) { errno = EINVAL; fail("plan: %s takes %d arguments", d, k); } } while (0)
#define ROOM(n, cap) do { if ((n) >= (int)(cap)) { errno = E2BIG; fail("plan: too many %s", d); } } while (0)
    for (int i = 0; i < nt; i++) {
        const char *d = tok[i];
        if (!strcmp(d, "root")) { NEED(1); P.root = tok[++i]; }
        else if (!strcmp(d, "readonly-root")) P.readonly_root = 1;
        else if (!strcmp(d, "ns")) { NEED(1); P.ns = (unsigned long)num(tok[++i], d); }
        else if (!strcmp(d, "idmap")) {
            NEED(2); P.host_id = (unsigned long)num(tok[++i], d); P.id_size = (unsigned long)num(tok[++i], d);
        }
        else if (!strcmp(d, "hostname")) { NEED(1); P.hostname = tok[++i]; }
        else if (!strcmp(d, "loopback")) P.lo_up = 1;
        else if (!strcmp(d, "cgroup")) { NEED(1); ROOM(P.ncgroups, 16); P.cgroups[P.ncgroups++] = tok[++i]; }
        else if (!strcmp(d, "mount")) {
            NEED(4); ROOM(P.nops, MAX_LIST * 2);
            struct op *o = &P.ops[P.nops++];
            o->kind = MOUNT; o->a = tok[++i]; o->b = tok[++i]; o->n = num(tok[++i], d); o->c = tok[++i];
        }
        else if (!strcmp(d, "bind")) {
            NEED(4); ROOM(P.nops, MAX_LIST * 2);
            struct op *o = &P.ops[P.nops++];
            o->kind = BIND; o->a = tok[++i]; o->b = tok[++i]; o->n = num(tok[++i], d);
            o->recursive = (int)num(tok[++i], d);
        }
        else if (!strcmp(d, "symlink") || !strcmp(d, "dir")) {
            NEED(2); ROOM(P.nops, MAX_LIST * 2);
            struct op *o = &P.ops[P.nops++];
            o->kind = d[0] == 's' ? SYMLINK : DIR_; o->a = tok[++i]; o->b = tok[++i];
        }
        else if (!strcmp(d, "dev") || !strcmp(d, "mask") || !strcmp(d, "readonly")) {
            NEED(1); ROOM(P.nops, MAX_LIST * 2);
            struct op *o = &P.ops[P.nops++];
            o->kind = d[0] == 'd' ? DEV : d[0] == 'm' ? MASK : READONLY; o->a = tok[++i];
        }
        else if (!strcmp(d, "rlimit")) {
            NEED(3); ROOM(P.nrlims, 16);
            struct rlim *r = &P.rlims[P.nrlims++];
            r->res = (int)num(tok[++i], d); r->soft = (rlim_t)num(tok[++i], d); r->hard = (rlim_t)num(tok[++i], d);
        }
        else if (!strcmp(d, "caps")) { NEED(1); P.caps = num(tok[++i], d); P.has_caps = 1; }
        else if (!strcmp(d, "oom")) {
            NEED(1);
            char *end;
            errno = 0;
            long v = strtol(tok[++i], &end, 10);
            if (errno || *end || end == tok[i] || v < -1000 || v > 1000) { errno = EINVAL; fail("plan: oom %s", tok[i]); }
            P.oom = (int)v;
            P.oom_set = 1;
        }
        else if (!strcmp(d, "seccomp")) { NEED(1); P.seccomp = tok[++i]; }
        else if (!strcmp(d, "listener")) { NEED(2); P.listener = tok[++i]; P.metadata = tok[++i]; }
        else if (!strcmp(d, "cwd")) { NEED(1); P.cwd = tok[++i]; }
        else if (!strcmp(d, "env")) { NEED(1); ROOM(P.nenv, MAX_LIST); P.env[P.nenv++] = tok[++i]; }
        else if (!strcmp(d, "arg")) { NEED(1); ROOM(P.nargs, 63); P.args[P.nargs++] = tok[++i]; }
        else if (!strcmp(d, "pidfile")) { NEED(1); P.pidfile = tok[++i]; }
        else { errno = EINVAL; fail("plan: unknown directive %s", d); }
    }
    if (!P.root || !P.nargs || !P.pidfile || !P.cwd) { errno = EINVAL; fail("plan %s: needs root, arg, cwd and pidfile", path); }
}

/* ------------------------------------------------------------ in the root */

#define IN_ROOT (RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)

/* An O_PATH fd of `path` inside the root, resolved as if the root were /,
 * through no symlink at all (an image's /proc -> /x would move the proc
 * mount from under the masks that follow it: ELOOP fails the start). Missing
 * components are made: directories, or with `file` an empty regular file
 * as the last one (a bind target for a device or a masked file). */
static int in_root(int rootfd, const char *path, int file) {
    struct open_how how = {.flags = O_PATH | O_CLOEXEC, .resolve = IN_ROOT};
    int fd = (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
    if (fd >= 0 || errno != ENOENT) return fd;
    char parent[4096];
    size_t len = strlen(path);
    if (len >= sizeof parent) { errno = ENAMETOOLONG; return -1; }
    memcpy(parent, path, len + 1);
    char *slash = strrchr(parent, '/');
    if (!slash || slash[1] == 0 || !strcmp(slash + 1, "..") || !strcmp(slash + 1, ".")) {
        errno = EINVAL;
        return -1;
    }
    const char *base = path + (slash - parent) + 1; /* one plain name */
    if (slash == parent) strcpy(parent, "/");
    else *slash = 0;
    int pfd = in_root(rootfd, parent, 0);
    if (pfd < 0) return -1;
    /* The parent was resolved inside the root; `base` is one plain name. */
    int dfd = openat(pfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    close(pfd);
    if (dfd < 0) return -1;
    if (file) {
        int f = openat(dfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (f >= 0) close(f);
        else if (errno != EEXIST) { close(dfd); return -1; }
    } else if (mkdirat(dfd, base, 0755) < 0 && errno != EEXIST) {
        close(dfd);
        return -1;
    }
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    fd = (int)syscall(SYS_openat2, dfd, base, &how, sizeof how);
    close(dfd);
    return fd;
}

__attribute__((noreturn)) static void bad_target(const char *path) {
    if (errno == ELOOP) fail("target %s: the image has a symlink on its path (mount targets follow none)", path);
    fail("target %s", path);
}

static void fd_path(char *out, size_t n, int fd) { snprintf(out, n, "/proc/self/fd/%d", fd); }

/* A new file system of `type` on `dest` (inside the root). */
static void mount_new(int rootfd, const char *type, const char *dest, unsigned long flags,
                      const char *data) {
    int t = in_root(rootfd, dest, 0);
    if (t < 0) bad_target(dest);
    char at[64];
    fd_path(at, sizeof at, t);
    if (mount(type, at, type, flags, data[0] ? data : NULL) < 0) fail("mounting %s on %s", type, dest);
    close(t);
}

/* A copy of the mount tree at `srcfd` (or `src`) onto `dest` inside the
 * root, with `attrs` (MOUNT_ATTR_*) set on every mount of it. */
static void bind_tree(int srcdir, const char *src, int rootfd, const char *dest,
                      unsigned long long attrs, int recursive, int file) {
    unsigned flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (recursive ? AT_RECURSIVE : 0);
    if (srcdir >= 0 && !src[0]) flags |= AT_EMPTY_PATH;
    int tree = (int)syscall(SYS_open_tree, srcdir, src, flags);
    if (tree < 0) fail("open_tree %s", src[0] ? src : dest);
    if (attrs) {
        struct mount_attr a = {.attr_set = attrs};
        if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | (recursive ? AT_RECURSIVE : 0),
                    &a, sizeof a) < 0)
            fail("setting attributes of %s", dest);
    }
    int t = in_root(rootfd, dest, file);
    if (t < 0) bad_target(dest);
    if (syscall(SYS_move_mount, tree, "", t, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
        fail("binding onto %s", dest);
    close(t);
    close(tree);
}

/* `path` inside the root, if it exists there (else -1, errno ENOENT). */
static int existing(int rootfd, const char *path) {
    struct open_how how = {.flags = O_PATH | O_CLOEXEC, .resolve = IN_ROOT};
    return (int)syscall(SYS_openat2, rootfd, path, &how, sizeof how);
}

static void make_symlink(int rootfd, const char *target, const char *path) {
    char dir[4096];
    if ((size_t)snprintf(dir, sizeof dir, "%s", path) >= sizeof dir) { errno = ENAMETOOLONG; fail("symlink %s", path); }
    char *slash = strrchr(dir, '/');
    if (!slash || !slash[1]) { errno = EINVAL; fail("symlink %s", path); }
    *slash = 0;
    int d = in_root(rootfd, dir[0] ? dir : "/", 0);
    if (d < 0) bad_target(dir);
    int dd = openat(d, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dd < 0 || (symlinkat(target, dd, slash + 1) < 0 && errno != EEXIST)) fail("symlink %s", path);
    close(dd);
    close(d);
}

static void setup_root(void) {
    /* The overlay came with the namespace's copy, locked to it (a mount a
     * user namespace inherits); pivot_root refuses a locked new root. Its
     * bind onto itself, made here, is not locked. */
    if (mount(P.root, P.root, NULL, MS_BIND | MS_REC, NULL) < 0) fail("binding %s onto itself", P.root);
    int rootfd = open(P.root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) fail("opening root %s", P.root);
    for (int i = 0; i < P.nops; i++) {
        const struct op *o = &P.ops[i];
        char at[64], path[64];
        int t;
        struct stat st;
        switch (o->kind) {
        case MOUNT:
            mount_new(rootfd, o->a, o->b, (unsigned long)o->n, o->c);
            break;
        case BIND:
            if (stat(o->a, &st) < 0) fail("bind source %s", o->a);
            bind_tree(AT_FDCWD, o->a, rootfd, o->b, o->n, o->recursive, !S_ISDIR(st.st_mode));
            break;
        case DEV: /* a user namespace may not make device nodes: the host's are bound */
            if (strchr(o->a, '/')) { errno = EINVAL; fail("device %s", o->a); }
            snprintf(path, sizeof path, "/dev/%s", o->a);
            bind_tree(AT_FDCWD, path, rootfd, path, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC, 0, 1);
            break;
        case SYMLINK:
            make_symlink(rootfd, o->a, o->b);
            break;
        case DIR_:
            t = in_root(rootfd, o->a, 0);
            if (t < 0) bad_target(o->a);
            fd_path(at, sizeof at, t);
            if (chmod(at, (mode_t)strtoul(o->b, NULL, 8)) < 0) fail("chmod %s", o->a);
            close(t);
            break;
        case MASK: /* /dev/null over a file; one this kernel lacks needs none */
            if ((t = existing(rootfd, o->a)) < 0) {
                if (errno == ENOENT) break;
                bad_target(o->a);
            }
            if (fstat(t, &st) < 0) fail("stat %s", o->a);
            if (S_ISDIR(st.st_mode)) { /* an empty read-only tmpfs over a directory */
                fd_path(at, sizeof at, t);
                if (mount("tmpfs", at, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0") < 0)
                    fail("masking %s", o->a);
                close(t);
                break;
            }
            close(t);
            bind_tree(AT_FDCWD, "/dev/null", rootfd, o->a,
                      MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC, 0, 1);
            break;
        case READONLY: /* bound over itself, read-only */
            if ((t = existing(rootfd, o->a)) < 0) {
                if (errno == ENOENT) break;
                bad_target(o->a);
            }
            bind_tree(t, "", rootfd, o->a, MOUNT_ATTR_RDONLY, 1, 0);
            close(t);
            break;
        }
    }
    close(rootfd);
    if (chdir(P.root) < 0) fail("chdir %s", P.root);
    if (syscall(SYS_pivot_root, ".", ".") < 0) fail("pivot_root %s", P.root);
    if (umount2(".", MNT_DETACH) < 0) fail("detaching the old root");
    if (chdir("/") < 0) fail("chdir /");
    if (P.readonly_root) {
        struct mount_attr a = {.attr_set = MOUNT_ATTR_RDONLY};
        if (syscall(SYS_mount_setattr, AT_FDCWD, "/", 0, &a, sizeof a) < 0) fail("making / read-only");
    }
}

/* --------------------------------------------------------------- process */

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) fail("socket for lo");
    struct ifreq ifr = {0};
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) fail("lo flags");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) fail("bringing lo up");
    close(s);
}

/* Read on the host, before the child leaves its root. */
static int cap_last = -1;

static void read_cap_last(void) {
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (!f || fscanf(f, "%d", &cap_last) != 1 || cap_last < 0 || cap_last > 63) {
        errno = EINVAL;
        fail("reading /proc/sys/kernel/cap_last_cap");
    }
    fclose(f);
}

static void drop_caps(void) {
    for (int c = 0; c <= cap_last; c++)
        if (!(P.caps >> c & 1) && prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0) fail("dropping cap %d", c);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        fail("clearing ambient caps");
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2] = {0};
    for (int k = 0; k < 2; k++) {
        d[k].effective = d[k].permitted = (unsigned)(P.caps >> (32 * k));
        d[k].inheritable = 0;
    }
    if (syscall(SYS_capset, &h, d) < 0) fail("capset");
}

/* The seccomp filter (compiled BPF, struct sock_filter[]) and the
 * connection to corral-seccompd: both host paths, so read and connected by
 * the parent, before the child leaves the host's root. */
static struct sock_filter prog[BPF_MAXINSNS];
static struct sock_fprog fprog;
static int listener_conn = -1;

static void prepare_seccomp(void) {
    int fd = open(P.seccomp, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("opening filter %s", P.seccomp);
    struct stat st;
    if (fstat(fd, &st) < 0 || st.st_size <= 0 || (size_t)st.st_size > sizeof prog) {
        errno = EFBIG;
        fail("filter %s", P.seccomp);
    }
    ssize_t n = read(fd, prog, sizeof prog);
    close(fd);
    if (n != st.st_size || n % (ssize_t)sizeof prog[0]) { errno = EINVAL; fail("filter %s", P.seccomp); }
    fprog.len = (unsigned short)(n / (ssize_t)sizeof prog[0]);
    fprog.filter = prog;
    if (!P.listener) return;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(P.listener) >= sizeof a.sun_path) { errno = ENAMETOOLONG; fail("listener %s", P.listener); }
    strcpy(a.sun_path, P.listener);
    listener_conn = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listener_conn < 0 || connect(listener_conn, (struct sockaddr *)&a, sizeof a) < 0)
        fail("connecting to %s", P.listener);
}

/* Loaded last; with a listener, its notification fd goes to
 * corral-seccompd with the sandbox id as metadata (the message crun
 * sends: seccompd reads "metadata"). */
static void load_seccomp(void) {
    int lfd = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                           P.listener ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0, &fprog);
    if (lfd < 0) fail("loading the seccomp filter");
    if (!P.listener) return;
    char msg[512];
    int len = snprintf(msg, sizeof msg,
                       "{\"ociVersion\":\"1.0.2\",\"fds\":[\"seccompFd\"],\"pid\":%d,\"metadata\":\"%s\"}",
                       (int)getpid(), P.metadata);
    if (len < 0 || (size_t)len >= sizeof msg) { errno = E2BIG; fail("listener message"); }
    char cbuf[CMSG_SPACE(sizeof(int))] = {0};
    struct iovec iov = {msg, (size_t)len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &lfd, sizeof(int));
    if (sendmsg(listener_conn, &mh, MSG_NOSIGNAL) != len) fail("sending the listener to %s", P.listener);
    close(listener_conn);
    close(lfd);
}

__attribute__((noreturn)) static void child(int go, int report) {
    err_fd = report;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) fail("prctl PDEATHSIG");
    char x;
    if (read(go, &x, 1) != 1) { errno = EPIPE; fail("waiting for the parent"); }
    close(go);
    if (P.ns & CLONE_NEWUSER) {
        if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) fail("becoming root of the user namespace");
        if (setgroups(0, NULL) < 0) fail("setgroups");
        /* A change of uid clears it: set again, so that the child still
         * dies with a corral-run killed before the exec. */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0) fail("prctl PDEATHSIG");
    }
    /* Made now, by the user namespace's root, not at clone: an IPC
     * namespace's mqueue root is owned by its maker (before the id map
     * it is nobody's); the cgroup one is rooted at the cgroups the
     * parent moved us into. */
    if (unshare((int)(P.ns & LATE_NS) | CLONE_NEWCGROUP) < 0) fail("unshare namespaces");
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) fail("making / a slave");
    umask(022);
    setup_root();
    /* Its own session (no way to signal the agent's process group or
     * reach a terminal of it) and session keyring (as crun: the host's
     * keys are not the sandbox's even where seccomp is off). */
    if (setsid() < 0) fail("setsid");
    if (syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, 0) < 0) fail("new session keyring");
    if (P.hostname && sethostname(P.hostname, strlen(P.hostname)) < 0) fail("sethostname");
    if (P.lo_up) loopback_up();
    for (int i = 0; i < P.nrlims; i++) {
        struct rlimit r = {P.rlims[i].soft, P.rlims[i].hard};
        if (setrlimit(P.rlims[i].res, &r) < 0) fail("setrlimit %d", P.rlims[i].res);
    }
    if (chdir(P.cwd) < 0) fail("chdir %s", P.cwd);
    /* stdin: the sandbox's own /dev/null, not the host's that nsexec
     * opened (a file on a mount outside the sandbox's namespace, which
     * CRIU cannot dump). stdout and stderr stay the host's log file, as
     * with crun (criu.py passes it as an external file). */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0) fail("stdin from /dev/null");
    close(null);
    /* Signals as a fresh process has them: the agent's ignored ones
     * (SIGPIPE in Python) would otherwise carry into the sandbox. */
    sigset_t none;
    sigemptyset(&none);
    for (int s = 1; s < 65; s++) if (s != SIGKILL && s != SIGSTOP) signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (P.has_caps) drop_caps();
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no_new_privs");
    /* Nothing of the host's but the listener (fd 3) and stdio crosses. */
    if (syscall(SYS_close_range, 4, ~0U, CLOSE_RANGE_CLOEXEC) < 0) fail("close_range");
    if (fcntl(report, F_SETFD, FD_CLOEXEC) < 0) fail("cloexec");
    /* Before the filter, which need not allow it. */
    if (prctl(PR_SET_PDEATHSIG, 0) < 0) fail("prctl PDEATHSIG");
    if (P.seccomp) load_seccomp();
    P.args[P.nargs] = NULL;
    P.env[P.nenv] = NULL;
    execve(P.args[0], P.args, P.env);
    fail("exec %s", P.args[0]);
}

static void write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    size_t n = strlen(data);
    if (fd < 0 || write(fd, data, n) != (ssize_t)n) fail("writing %s", path);
    close(fd);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: corral-run PLAN\n");
        return 2;
    }
    read_plan(argv[1]);
    if (P.ns & CLONE_NEWCGROUP) { errno = EINVAL; fail("plan: the cgroup namespace is made by the child"); }
    if ((P.hostname && !(P.ns & CLONE_NEWUTS)) || (P.lo_up && !(P.ns & CLONE_NEWNET)) ||
        !(P.ns & CLONE_NEWNS) || !(P.ns & CLONE_NEWPID)) {
        errno = EINVAL;
        fail("plan: a hostname needs a UTS namespace, loopback a network one, and a root mount and pid ones");
    }
    if (P.has_caps) read_cap_last();
    if (P.oom_set) {
        char v[16];
        snprintf(v, sizeof v, "%d", P.oom);
        write_file("/proc/self/oom_score_adj", v); /* inherited by the child */
    }
    if (P.seccomp) prepare_seccomp();
    int go[2], report[2];
    if (pipe2(go, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0) fail("pipe");
    pid_t pid = (pid_t)syscall(SYS_clone, (P.ns & ~(unsigned long)LATE_NS) | SIGCHLD, 0, 0, 0, 0);
    if (pid < 0) fail("clone");
    if (pid == 0) {
        close(go[1]);
        close(report[0]);
        /* Not close-on-exec until the end: the child's messages go here. */
        if (fcntl(report[1], F_SETFD, 0) < 0) _exit(1);
        child(go[0], report[1]);
    }
    close(go[0]);
    close(report[1]);
    char path[4200], line[64];
    if (P.ns & CLONE_NEWUSER) {
        snprintf(line, sizeof line, "0 %lu %lu\n", P.host_id, P.id_size);
        snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
        write_file(path, line);
        snprintf(path, sizeof path, "/proc/%d/gid_map", (int)pid);
        write_file(path, line);
    }
    snprintf(line, sizeof line, "%d", (int)pid);
    for (int i = 0; i < P.ncgroups; i++) {
        if ((size_t)snprintf(path, sizeof path, "%s/cgroup.procs", P.cgroups[i]) >= sizeof path) {
            errno = ENAMETOOLONG;
            fail("cgroup %s", P.cgroups[i]);
        }
        write_file(path, line);
    }
    if (write(go[1], "g", 1) != 1) fail("starting the child");
    close(go[1]);
    char said[1200];
    ssize_t n, got = 0;
    while ((n = read(report[0], said + got, sizeof said - 1 - (size_t)got)) > 0) got += n;
    if (got > 0) {
        said[got] = 0;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fputs(said, stderr);
        return 1;
    }
    /* EOF and nothing said: exec'd, unless it died first (killed before
     * the exec: an OOM in its cgroup). Our child, it keeps its pid until we
     * reap it or exit, so the check is not fooled by a reused pid. */
    int status;
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) {
        errno = ECHILD;
        fail("the sandbox's init ended before it started (status %d)", w == pid ? status : -1);
    }
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", P.pidfile) >= sizeof tmp) {
        kill(pid, SIGKILL);
        errno = ENAMETOOLONG;
        fail("pid file %s", P.pidfile);
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int wrote = dprintf(fd, "%d", (int)pid);
    if (fd < 0 || wrote <= 0 || close(fd) < 0 || rename(tmp, P.pidfile) < 0) {
        kill(pid, SIGKILL);
        fail("writing %s", P.pidfile);
    }
    return 0;
}
