/*
 * corral-init: PID 1 of every container sandbox, and its exec server.
 *
 * Why it exists: an agent loop runs thousands of short commands; paying a
 * `crun exec` (~9 ms) for each is the dominant cost. corral-init stays in the
 * sandbox, accepts requests on a listening socket that the node agent created
 * on the host and handed over as fd 3, and forks one handler per request.
 *
 * Invariants the platform's security rests on:
 *  - The control socket is never in the sandbox's file system: its path lives
 *    on the host, and the only copy of the fd inside is held by PID 1 (and its
 *    handlers), which are not dumpable, so no sandbox process can open
 *    /proc/1/fd, ptrace PID 1 or pidfd_getfd() the socket (that needs
 *    CAP_SYS_PTRACE, which sandboxes never have).
 *  - Every command's child closes every inherited fd (close_range) before
 *    execve, so the connection to the agent never leaks into user code.
 *  - The binary itself comes from the read-only platform layer (/.corral), so
 *    an agent that replaces /bin/sh or /bin/bash changes nothing we run.
 *  - PID 1 of a PID namespace ignores signals it has no handler for when they
 *    come from inside the namespace, so sandbox code cannot kill it.
 *
 * Each handler is a child subreaper: descendants of a command that are
 * orphaned re-parent to the handler, so a timeout or kill can reach the whole
 * tree even when the command's children called setsid().
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/prctl.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <termios.h>
#include <grp.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "init.h"
#include "proto.h"
#include "sudo.h"

#define LISTEN_FD 3
#define IO_CHUNK (64 * 1024)
#define STDIN_MAX (256u << 20)
#define LIST_MAX 100000
#define PASSWD_MAX (4u << 20)

extern char **environ;

void logmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "corral-init[%d]: ", getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ------------------------------------------------------------------ I/O */

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pfd = {.fd = fd, .events = POLLOUT};
                poll(&pfd, 1, -1);
                continue;
            }
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_full(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) return -1; /* EOF inside a frame */
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static void put_u32(unsigned char *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}
static uint32_t get_u32le(const unsigned char *b) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static int send_frame(int fd, uint8_t type, const void *payload, uint32_t len) {
    unsigned char hdr[FRAME_HEADER];
    put_u32(hdr, len);
    put_u32(hdr + 4, 0);
    hdr[8] = type;
    if (write_full(fd, hdr, sizeof hdr) < 0) return -1;
    if (len && write_full(fd, payload, len) < 0) return -1;
    return 0;
}

static int vsend_error(int fd, int err, uint32_t stage, const char *fmt, va_list ap) {
    char msg[1024];
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof msg) n = sizeof msg - 1;
    unsigned char buf[8 + sizeof msg];
    put_u32(buf, (uint32_t)err);
    put_u32(buf + 4, stage);
    memcpy(buf + 8, msg, (size_t)n);
    return send_frame(fd, RSP_ERROR, buf, 8 + (uint32_t)n);
}

static int send_error(int fd, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = vsend_error(fd, err, ERR_GENERIC, fmt, ap);
    va_end(ap);
    return r;
}

static int send_error_stage(int fd, int err, uint32_t stage, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = vsend_error(fd, err, stage, fmt, ap);
    va_end(ap);
    return r;
}

struct frame {
    uint8_t type;
    uint32_t len;
    unsigned char *data; /* malloc'd, len bytes, NUL appended */
};

static int recv_frame(int fd, struct frame *f) {
    unsigned char hdr[FRAME_HEADER];
    if (read_full(fd, hdr, sizeof hdr) < 0) return -1;
    f->len = get_u32le(hdr);
    f->type = hdr[8];
    if (f->len > FRAME_MAX_PAYLOAD) return -1;
    f->data = malloc(f->len + 1);
    if (!f->data) return -1;
    if (f->len && read_full(fd, f->data, f->len) < 0) {
        free(f->data);
        return -1;
    }
    f->data[f->len] = 0;
    return 0;
}

/* A cursor over a request payload. Any malformed field sets bad. */
struct cursor {
    const unsigned char *p;
    size_t left;
    int bad;
};

static uint32_t cur_u32(struct cursor *c) {
    if (c->left < 4) { c->bad = 1; return 0; }
    uint32_t v = get_u32le(c->p);
    c->p += 4;
    c->left -= 4;
    return v;
}
static uint64_t cur_u64(struct cursor *c) {
    uint64_t lo = cur_u32(c), hi = cur_u32(c);
    return lo | (hi << 32);
}
/* Strings are u32 length + bytes; an embedded NUL is refused. */
static char *cur_str(struct cursor *c) {
    uint32_t n = cur_u32(c);
    if (c->bad || n > c->left) { c->bad = 1; return NULL; }
    if (memchr(c->p, 0, n)) { c->bad = 1; return NULL; }
    char *s = malloc(n + 1);
    if (!s) { c->bad = 1; return NULL; }
    memcpy(s, c->p, n);
    s[n] = 0;
    c->p += n;
    c->left -= n;
    return s;
}
static char **cur_strv(struct cursor *c) {
    uint32_t n = cur_u32(c);
    if (c->bad || n > 65536) { c->bad = 1; return NULL; }
    char **v = calloc((size_t)n + 2, sizeof(char *));
    if (!v) { c->bad = 1; return NULL; }
    for (uint32_t i = 0; i < n && !c->bad; i++) v[i] = cur_str(c);
    return v;
}

/* ------------------------------------------------------------------ users */

static int all_digits(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

/* A uid or gid in decimal: 0 and the value, or -1 for anything else,
 * including values past what an id holds ((uid_t)-1 means "none" to the
 * kernel): a number must never wrap round to root. */
static int parse_id(const char *s, uint32_t *out) {
    if (!all_digits(s) || strlen(s) > 10) return -1;
    unsigned long long v = strtoull(s, NULL, 10);
    if (v >= UINT32_MAX) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* An image's small text file (/etc/passwd, /etc/group), NUL-terminated, or
 * NULL: absent, not a regular file, or larger than PASSWD_MAX. */
static char *read_image_file(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return NULL;
    struct stat st;
    char *buf = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size <= PASSWD_MAX) {
        buf = malloc((size_t)st.st_size + 1);
        ssize_t n = buf ? read(fd, buf, (size_t)st.st_size) : -1;
        if (n >= 0) {
            buf[n] = 0;
        } else {
            free(buf);
            buf = NULL;
        }
    }
    close(fd);
    return buf;
}

/* Split a line into `want` colon-separated fields in place: 0 if it has
 * fewer. */
static int fields(char *line, char **f, int want) {
    int k = 0;
    char *s = line;
    f[k++] = s;
    while (k < want && (s = strchr(s, ':'))) {
        *s++ = 0;
        f[k++] = s;
    }
    return k == want;
}

/* The groups /etc/group lists `name` in, after the primary gid, as login(1)
 * and runc's exec do. Duplicates and malformed lines are left out. */
static void add_member_groups(const char *name, struct ident *id) {
    char *buf = read_image_file("/etc/group");
    if (!buf) return;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line && id->ngroups < IDENT_GROUPS;
         line = strtok_r(NULL, "\n", &save)) {
        char *f[4];
        uint32_t parsed;
        if (!fields(line, f, 4) || parse_id(f[2], &parsed) < 0) continue;
        gid_t gid = (gid_t)parsed;
        int member = 0;
        char *msave = NULL;
        for (char *m = strtok_r(f[3], ",", &msave); m && !member; m = strtok_r(NULL, ",", &msave))
            member = strcmp(m, name) == 0;
        if (!member) continue;
        int seen = 0;
        for (int i = 0; i < id->ngroups && !seen; i++) seen = id->groups[i] == gid;
        if (!seen) id->groups[id->ngroups++] = gid;
    }
    free(buf);
}

/*
 * Resolve "root", "name", "1000" or "1000:1000" against the image's
 * /etc/passwd and, with `groups`, /etc/group. The files belong to the
 * (untrusted) image: they are only read, bounded in size, and never
 * executed; they can only choose the ids of a user the caller asked for by
 * name, and ids are all the sandbox's own (its user namespace maps nothing
 * else). As runc's exec: an explicit group ("uid:gid") is the only group;
 * otherwise the primary one, then those whose member lists name the user.
 */
static int lookup_user(const char *spec, struct ident *id, int groups) {
    id->uid = 0;
    id->gid = 0;
    id->ngroups = 0;
    strcpy(id->home, "/");
    const char *colon = strchr(spec, ':');
    char name[256], pwname[256] = "";
    size_t nlen = colon ? (size_t)(colon - spec) : strlen(spec);
    if (nlen == 0 || nlen >= sizeof name) return -1;
    memcpy(name, spec, nlen);
    name[nlen] = 0;
    uint32_t num = 0;
    int numeric = all_digits(name);
    if (numeric && parse_id(name, &num) < 0) return -1;
    int found = 0;

    char *buf = read_image_file("/etc/passwd");
    if (buf) {
        char *save = NULL;
        for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            char *f[7];
            uint32_t uid, gid;
            if (!fields(line, f, 7)) continue;
            int match = numeric ? strcmp(f[2], name) == 0 : strcmp(f[0], name) == 0;
            if (!match || parse_id(f[2], &uid) < 0 || parse_id(f[3], &gid) < 0) continue;
            id->uid = (uid_t)uid;
            id->gid = (gid_t)gid;
            snprintf(id->home, sizeof id->home, "%s", f[5][0] ? f[5] : "/");
            /* A name too long to keep whole is not matched against groups. */
            if (strlen(f[0]) < sizeof pwname) strcpy(pwname, f[0]);
            found = 1;
            break;
        }
        free(buf);
    }

    if (!found) {
        if (numeric) {
            id->uid = (uid_t)num;
            id->gid = (gid_t)num;
        } else if (strcmp(name, "root") == 0) {
            strcpy(id->home, "/root");
            strcpy(pwname, "root");
        } else {
            return -1;
        }
    }
    if (colon) {
        uint32_t gid;
        if (parse_id(colon + 1, &gid) < 0) return -1;
        id->gid = (gid_t)gid;
    }
    id->groups[id->ngroups++] = id->gid;
    if (groups && !colon && pwname[0]) add_member_groups(pwname, id);
    return 0;
}

int resolve_user(const char *spec, struct ident *id) {
    return lookup_user(spec, id, 1);
}

/* setgroups(2) refuses the whole list (EINVAL) if one gid is not mapped in
 * the sandbox's user namespace (an image's /etc/group may name any): then
 * the mapped ones, so one stray line does not stop every command. */
static int set_groups(const struct ident *id) {
    if (setgroups((size_t)id->ngroups, id->groups) == 0) return 0;
    if (errno != EINVAL) return -1;
    gid_t ok[IDENT_GROUPS];
    size_t n = 0;
    for (int i = 0; i < id->ngroups; i++)
        if (setgroups(1, &id->groups[i]) == 0) ok[n++] = id->groups[i];
    return setgroups(n, ok);
}

int become(const struct ident *id) {
    if (set_groups(id) < 0) return -1;
    if (setresgid(id->gid, id->gid, id->gid) < 0) return -1;
    if (setresuid(id->uid, id->uid, id->uid) < 0) return -1;
    return 0;
}

/* ------------------------------------------------------------------ exec */

void command_child_defaults(void) {
    sigset_t none;
    sigemptyset(&none);
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* User code, not corral-init, must be what the memory cgroup's OOM
     * killer picks: raise the command's score (raising needs no
     * capability; corral-init itself stays at 0, or -1000 where the
     * agent could set it). */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
        if (write(oom, "300", 3) < 0) { /* best effort */ }
        close(oom);
    }
}

struct outstream {
    int fd;          /* read end, non-blocking; -1 once closed */
    uint8_t type;    /* RSP_STDOUT / RSP_STDERR */
    uint64_t cap;    /* bytes forwarded at most */
    uint64_t total;  /* bytes produced */
};

struct exec_state {
    int conn;
    int conn_open;
    pid_t pid;
    struct outstream out, err;
};

/* Move what the pipe holds towards the agent, keeping at most the cap.
 * Unless drain is set, yield after one full chunk so that a flood cannot
 * starve the timer or the other stream. */
static void forward(struct exec_state *st, struct outstream *o, int drain) {
    static char buf[IO_CHUNK];
    /* A background descendant may hold the pipe and write forever: a final
     * drain takes what the exited command left, bounded. */
    uint64_t budget = 16u << 20;
    for (;;) {
        if (drain && budget < sizeof buf) return;
        ssize_t n = read(o->fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return;
        if (n <= 0) {
            close(o->fd);
            o->fd = -1;
            return;
        }
        budget -= (uint64_t)n;
        uint64_t before = o->total;
        o->total += (uint64_t)n;
        if (st->conn_open && before < o->cap) {
            uint64_t keep = o->cap - before;
            if (keep > (uint64_t)n) keep = (uint64_t)n;
            if (send_frame(st->conn, o->type, buf, (uint32_t)keep) < 0) st->conn_open = 0;
        }
        if (!drain && (size_t)n == sizeof buf) return;
    }
}

/* Kill every process left below this handler, including orphans that
 * re-parented to it (it is their subreaper), until none remain. */
void kill_tree(void) {
    for (int round = 0; round < 2000; round++) {
        int any = 0;
        DIR *d = opendir("/proc");
        if (d) {
            struct dirent *e;
            pid_t self = getpid();
            while ((e = readdir(d))) {
                if (!all_digits(e->d_name)) continue;
                char path[300], buf[512];
                snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
                int fd = open(path, O_RDONLY | O_CLOEXEC);
                if (fd < 0) continue;
                ssize_t n = read(fd, buf, sizeof buf - 1);
                close(fd);
                if (n <= 0) continue;
                buf[n] = 0;
                char *rp = strrchr(buf, ')');
                if (!rp) continue;
                char state;
                int ppid;
                if (sscanf(rp + 1, " %c %d", &state, &ppid) != 2) continue;
                if (ppid != self) continue;
                pid_t p = (pid_t)atoi(e->d_name);
                kill(-p, SIGKILL);
                kill(p, SIGKILL);
                any = 1;
            }
            closedir(d);
        }
        while (waitpid(-1, NULL, WNOHANG) > 0) any = 1;
        if (!any) {
            if (waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD) return;
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static void send_exit(int conn, int status, int timed_out, const struct exec_state *st,
                      const struct rusage *ru) {
    unsigned char b[4 + 4 + 1 + 8 * 5];
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    put_u32(b, (uint32_t)code);
    put_u32(b + 4, (uint32_t)sig);
    b[8] = (unsigned char)timed_out;
    put_u64(b + 9, st->out.total);
    put_u64(b + 17, st->err.total);
    put_u64(b + 25, (uint64_t)ru->ru_utime.tv_sec * 1000000u + (uint64_t)ru->ru_utime.tv_usec);
    put_u64(b + 33, (uint64_t)ru->ru_stime.tv_sec * 1000000u + (uint64_t)ru->ru_stime.tv_usec);
    put_u64(b + 41, (uint64_t)ru->ru_maxrss);
    send_frame(conn, RSP_EXIT, b, sizeof b);
}

/* The program execvp would run for `file` under the command's PATH, found
 * before the command may start (see handle_exec): 0 with `out` filled, or
 * the errno execvp would fail with. Runs as the command's user, so access()
 * answers for that user. */
static int resolve_program(const char *file, char **env, char *out, size_t cap) {
    if (!*file) return ENOENT;
    if (strchr(file, '/')) {
        if (strlen(file) >= cap) return ENAMETOOLONG;
        strcpy(out, file);
        struct stat sb;
        if (stat(out, &sb) < 0) return errno;
        if (!S_ISREG(sb.st_mode) || access(out, X_OK) < 0) return EACCES;
        return 0;
    }
    size_t flen = strlen(file);
    if (flen > NAME_MAX) return ENAMETOOLONG;
    const char *path = NULL;
    for (char **e = env; *e && !path; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5; /* the first, as getenv */
    if (!path) path = "/usr/local/bin:/bin:/usr/bin"; /* musl's default */
    int seen = ENOENT;
    for (const char *dir = path;; dir++) {
        const char *end = strchrnul(dir, ':');
        size_t dlen = (size_t)(end - dir);
        if (dlen + 1 + flen < cap) {
            /* An empty entry is the working directory, as execvp reads it. */
            snprintf(out, cap, "%.*s%s%s", (int)dlen, dir, dlen ? "/" : "", file);
            struct stat sb;
            if (stat(out, &sb) == 0) {
                if (S_ISREG(sb.st_mode) && access(out, X_OK) == 0) return 0;
                seen = EACCES;
            } else if (errno == EACCES) {
                seen = EACCES; /* a directory it may not search */
            } else if (errno != ENOENT && errno != ENOTDIR) {
                return errno; /* execvp stops at such an entry (ELOOP, EIO) */
            }
        }
        if (!*end) return seen;
        dir = end;
    }
}

static int has_env(char **env, const char *key) {
    size_t k = strlen(key);
    for (; *env; env++)
        if (strncmp(*env, key, k) == 0 && (*env)[k] == '=') return 1;
    return 0;
}

/* The request streams input (stdin, a file body) whose end is not read yet. */
static int input_open;

static int handle_exec(int conn, struct cursor *c) {
    uint32_t flags = cur_u32(c);
    input_open = (flags & EXEC_STDIN_STREAM) != 0;
    int64_t timeout_ms = (int64_t)cur_u64(c);
    uint64_t out_cap = cur_u64(c), err_cap = cur_u64(c);
    char *user = cur_str(c);
    char *cwd = cur_str(c);
    char **argv = cur_strv(c);
    char **env = cur_strv(c);
    struct winsize ws = {0};
    if (flags & EXEC_PTY) {
        ws.ws_row = (unsigned short)cur_u32(c);
        ws.ws_col = (unsigned short)cur_u32(c);
        flags |= EXEC_STDIN_STREAM; /* a terminal's input is its master side */
        input_open = 1;
    }
    if (c->bad || !argv || !argv[0]) return send_error(conn, EINVAL, "malformed exec request");

    struct ident id;
    if (resolve_user(user, &id) < 0) return send_error_stage(conn, ESRCH, ERR_USER, "no such user: %s", user);
    if (!has_env(env, "HOME")) {
        size_t n = 0;
        while (env[n]) n++;
        char *h = malloc(strlen(id.home) + 6);
        sprintf(h, "HOME=%s", id.home);
        env[n] = h; /* cur_strv left room for one more entry */
        env[n + 1] = NULL;
    }

    int in[2] = {-1, -1}, out[2], err[2], report[2], master = -1, slave = -1;
    if (flags & EXEC_PTY) {
        /* The command's stdio is a terminal's slave; the master side is the
         * stream both ways (output has no separate stderr, as with a TTY). */
        master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0)
            return send_error(conn, errno, "a terminal: %m");
        slave = open(ptsname(master), O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0) return send_error(conn, errno, "a terminal's slave: %m");
        ioctl(master, TIOCSWINSZ, &ws);
        in[0] = slave;
        in[1] = fcntl(master, F_DUPFD_CLOEXEC, 0);
        out[0] = master;
        out[1] = slave;
        if (pipe2(err, O_CLOEXEC) < 0) return send_error(conn, errno, "pipe: %m");
    } else if ((flags & EXEC_STDIN_STREAM) && pipe2(in, O_CLOEXEC) < 0) {
        return send_error(conn, errno, "pipe: %m");
    }
    /* The command runs only once the handler has said it started (`go`):
     * the command runs as the handler's user and may stop it
     * (kill -STOP -1), and a handler stopped before its "started" would
     * look to the agent like a dead exec server instead of a command to
     * time out. So every failure the answer must carry (user, directory,
     * program) is found before "started"; an exec that still fails after
     * it is reported the shell's way, on stderr with exit 127. */
    int go[2];
    if ((!(flags & EXEC_PTY) && (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0)) ||
        pipe2(report, O_CLOEXEC) < 0 || pipe2(go, O_CLOEXEC) < 0)
        return send_error(conn, errno, "pipe: %m");

    pid_t pid = fork();
    if (pid < 0) return send_error(conn, errno, "fork: %m");
    if (pid == 0) {
        int stage_err[2];
        setsid();
        int devnull = (flags & EXEC_STDIN_STREAM) ? -1 : open("/dev/null", O_RDONLY | O_CLOEXEC);
        dup2((flags & EXEC_STDIN_STREAM) ? in[0] : devnull, 0);
        dup2(out[1], 1);
        dup2((flags & EXEC_PTY) ? slave : err[1], 2);
        if (flags & EXEC_PTY) ioctl(0, TIOCSCTTY, 0); /* its controlling terminal */
        command_child_defaults();
        if (flags & EXEC_IDLE) {
            /* Best effort: the cgroup's idle class is what holds a background
             * sandbox back from its neighbours; this orders the commands of
             * one sandbox among themselves. */
            struct sched_param sp = {0};
            /* The system call, not the libc wrapper: musl's is a stub
             * answering ENOSYS (it holds that a thread, not a process, has
             * a policy); the kernel's applies to this thread, the
             * command's only one until it execs. */
            if (syscall(SYS_sched_setscheduler, 0, SCHED_IDLE, &sp) < 0) { /* an old kernel */ }
        }
        /* Keep only stdio, the report pipe and the go pipe. */
        int rfd = report[1], gfd = go[0];
        int lo = rfd < gfd ? rfd : gfd, hi = rfd < gfd ? gfd : rfd;
        if (lo > 3) syscall(SYS_close_range, 3, lo - 1, 0);
        if (hi > lo + 1) syscall(SYS_close_range, lo + 1, hi - 1, 0);
        syscall(SYS_close_range, hi + 1, ~0U, 0);
        if (become(&id) < 0) {
            stage_err[0] = 1;
            stage_err[1] = errno;
            if (write(rfd, stage_err, sizeof stage_err) < 0) {}
            _exit(127);
        }
        if (chdir(cwd) < 0) {
            stage_err[0] = 2;
            stage_err[1] = errno;
            if (write(rfd, stage_err, sizeof stage_err) < 0) {}
            _exit(127);
        }
        static char program[PATH_MAX];
        int e = resolve_program(argv[0], env, program, sizeof program);
        stage_err[0] = e ? 3 : 0;
        stage_err[1] = e;
        if (write(rfd, stage_err, sizeof stage_err) < 0 || e) _exit(127);
        /* One byte: the agent has the answer. End of file instead: the
         * handler died or could not answer, and no one would watch this
         * command, so it never runs. */
        char token;
        ssize_t got;
        do got = read(gfd, &token, 1);
        while (got < 0 && errno == EINTR);
        if (got != 1) _exit(127);
        execve(program, argv, env);
        dprintf(2, "corral: executing %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }

    if (!(flags & EXEC_PTY)) close(out[1]); /* a PTY's slave is in[0], closed below */
    close(err[1]);
    close(report[1]);
    close(go[0]);
    if (in[0] >= 0) close(in[0]);
    int stage_err[2];
    ssize_t rn;
    do rn = read(report[0], stage_err, sizeof stage_err);
    while (rn < 0 && errno == EINTR);
    close(report[0]);
    if (rn == (ssize_t)sizeof stage_err && stage_err[0] != 0) {
        close(go[1]);
        waitpid(pid, NULL, 0);
        static const char *what[] = {"", "switching to user", "changing directory to", "executing"};
        const char *obj = stage_err[0] == 1 ? user : stage_err[0] == 2 ? cwd : argv[0];
        return send_error_stage(conn, stage_err[1], (uint32_t)stage_err[0], "%s %s: %s", what[stage_err[0]], obj,
                                strerror(stage_err[1]));
    }

    unsigned char pb[4];
    put_u32(pb, (uint32_t)pid);
    struct exec_state st = {
        .conn = conn, .conn_open = 1, .pid = pid,
        .out = {.fd = out[0], .type = RSP_STDOUT, .cap = out_cap},
        .err = {.fd = err[0], .type = RSP_STDERR, .cap = err_cap},
    };
    if (send_frame(conn, RSP_STARTED, pb, 4) < 0) {
        st.conn_open = 0; /* no one knows of it: it never runs (go is closed unwritten) */
    } else if (write(go[1], "", 1) != 1) {
        /* the child is gone: its exit is reported below */
    }
    close(go[1]);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    int in_fd = in[1];
    if (in_fd >= 0) fcntl(in_fd, F_SETFL, O_NONBLOCK);

    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    int tfd = -1;
    if (timeout_ms > 0) {
        tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
        struct itimerspec its = {0};
        its.it_value.tv_sec = timeout_ms / 1000;
        its.it_value.tv_nsec = (timeout_ms % 1000) * 1000000;
        timerfd_settime(tfd, 0, &its, NULL);
    }

    char *inbuf = NULL;
    size_t in_len = 0, in_off = 0, in_capacity = 0;
    int in_eof = 0, timed_out = 0, killed = 0, exited = 0, status = 0;
    struct rusage ru = {0};

    while (!exited) {
        struct pollfd p[6];
        int n = 0, i_conn = -1, i_out = -1, i_err = -1, i_in = -1, i_sig, i_t = -1;
        if (st.conn_open) { p[n] = (struct pollfd){st.conn, POLLIN, 0}; i_conn = n++; }
        if (st.out.fd >= 0) { p[n] = (struct pollfd){st.out.fd, POLLIN, 0}; i_out = n++; }
        if (st.err.fd >= 0) { p[n] = (struct pollfd){st.err.fd, POLLIN, 0}; i_err = n++; }
        if (in_fd >= 0 && in_off < in_len) { p[n] = (struct pollfd){in_fd, POLLOUT, 0}; i_in = n++; }
        p[n] = (struct pollfd){sfd, POLLIN, 0};
        i_sig = n++;
        if (tfd >= 0) { p[n] = (struct pollfd){tfd, POLLIN, 0}; i_t = n++; }
        if (poll(p, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (i_out >= 0 && p[i_out].revents) forward(&st, &st.out, 0);
        if (i_err >= 0 && p[i_err].revents) forward(&st, &st.err, 0);
        if (i_conn >= 0 && p[i_conn].revents) {
            struct frame f;
            if (recv_frame(st.conn, &f) < 0) {
                /* The agent went away: the command keeps running to its end
                 * (or its timeout); output is drained and dropped. */
                st.conn_open = 0;
            } else {
                if (f.type == REQ_STDIN && in_fd >= 0 && !in_eof) {
                    if (in_len - in_off + f.len > STDIN_MAX) {
                        kill(-pid, SIGKILL);
                        killed = 1;
                    } else {
                        if (in_len + f.len > in_capacity) {
                            memmove(inbuf, inbuf + in_off, in_len - in_off);
                            in_len -= in_off;
                            in_off = 0;
                            if (in_len + f.len > in_capacity) {
                                in_capacity = (in_len + f.len) * 2;
                                inbuf = realloc(inbuf, in_capacity);
                            }
                        }
                        memcpy(inbuf + in_len, f.data, f.len);
                        in_len += f.len;
                    }
                } else if (f.type == REQ_STDIN_EOF) {
                    in_eof = 1;
                    input_open = 0;
                } else if (f.type == REQ_RESIZE && f.len == 8 && master >= 0) {
                    struct winsize w = {.ws_row = (unsigned short)get_u32le(f.data),
                                        .ws_col = (unsigned short)get_u32le(f.data + 4)};
                    ioctl(master, TIOCSWINSZ, &w);
                } else if (f.type == REQ_SIGNAL && f.len == 4) {
                    int sig = (int)get_u32le(f.data);
                    if (sig > 0 && sig < NSIG) {
                        kill(-pid, sig);
                        if (sig == SIGKILL) killed = 1;
                    }
                }
                free(f.data);
            }
        }
        if (i_in >= 0 && p[i_in].revents) {
            ssize_t w = write(in_fd, inbuf + in_off, in_len - in_off);
            if (w > 0) in_off += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR) { close(in_fd); in_fd = -1; }
        }
        if (in_fd >= 0 && in_eof && in_off == in_len) {
            close(in_fd);
            in_fd = -1;
        }
        if (i_t >= 0 && p[i_t].revents) {
            uint64_t x;
            if (read(tfd, &x, sizeof x) < 0) {}
            timed_out = 1;
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
        }
        if (p[i_sig].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            pid_t w;
            int s;
            struct rusage r;
            while ((w = wait4(-1, &s, WNOHANG, &r)) > 0) {
                if (w == pid) {
                    exited = 1;
                    status = s;
                    ru = r;
                }
            }
        }
    }
    /* The command's own output is complete in the pipes once it exited;
     * take what is there but do not wait for descendants holding them. */
    if (st.out.fd >= 0) forward(&st, &st.out, 1);
    if (st.err.fd >= 0) forward(&st, &st.err, 1);
    if (timed_out || killed) kill_tree();
    if (st.conn_open) send_exit(conn, status, timed_out, &st, &ru);
    return 0;
}

/* ------------------------------------------------------------------ files */

static int mkdirs(const char *path, mode_t mode) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, mode) < 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(tmp, mode) < 0 && errno != EEXIST) return -1;
    return 0;
}

static int mkdir_parent(const char *path) {
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    char *slash = strrchr(tmp, '/');
    if (!slash || slash == tmp) return 0;
    *slash = 0;
    return mkdirs(tmp, 0755);
}

/* The parents of `path`, made without following a symbolic link: each
 * component is made in, then opened from, the directory before it with
 * O_NOFOLLOW, so a link an agent planted is refused (ELOOP), never walked. */
static int mkdir_parent_nofollow(const char *path) {
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    char *last = strrchr(tmp, '/');
    if (!last || last == tmp) return 0;
    *last = 0;
    int dfd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return -1;
    char *save = NULL;
    for (char *comp = strtok_r(tmp + 1, "/", &save); comp; comp = strtok_r(NULL, "/", &save)) {
        if (mkdirat(dfd, comp, 0755) < 0 && errno != EEXIST) break;
        int next = openat(dfd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int e = errno;
        struct stat lst;
        if (next < 0 && e == ENOTDIR && fstatat(dfd, comp, &lst, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(lst.st_mode))
            e = ELOOP; /* a link, refused as one (O_DIRECTORY says ENOTDIR first) */
        close(dfd);
        if (next < 0) {
            errno = e;
            return -1;
        }
        dfd = next;
    }
    int e = errno;
    close(dfd);
    errno = e;
    return 0;
}

/* open(2), or with FILE_NOFOLLOW openat2 refusing a link in any component. */
static int open_file(const char *path, int oflags, mode_t mode, uint32_t flags) {
    if (!(flags & FILE_NOFOLLOW)) return open(path, oflags, mode);
    struct {
        uint64_t flags, mode, resolve;
    } how = {(uint64_t)oflags, (oflags & O_CREAT) ? (uint64_t)mode : 0, 0x04 /* RESOLVE_NO_SYMLINKS */};
    return (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
}

/* The user.* extended attributes of `path` (not of a link: Linux keeps
 * none there), at most XATTR_MAX of them, each value at most XATTR_VALUE
 * bytes: appended to b as u32 count, then (string key, string value). */
#define XATTR_MAX 32
#define XATTR_VALUE 4096
static size_t put_xattrs(unsigned char *b, const char *path, const struct stat *st) {
    uint32_t count = 0;
    size_t off = 4;
    char names[8192];
    ssize_t n = S_ISLNK(st->st_mode) ? 0 : llistxattr(path, names, sizeof names);
    for (ssize_t i = 0; i < n && count < XATTR_MAX; i += (ssize_t)strlen(names + i) + 1) {
        const char *k = names + i;
        if (strncmp(k, "user.", 5)) continue;
        char value[XATTR_VALUE];
        ssize_t vl = lgetxattr(path, k, value, sizeof value);
        if (vl < 0) continue;
        size_t kl = strlen(k);
        put_u32(b + off, (uint32_t)kl);
        memcpy(b + off + 4, k, kl);
        off += 4 + kl;
        put_u32(b + off, (uint32_t)vl);
        memcpy(b + off + 4, value, (size_t)vl);
        off += 4 + (size_t)vl;
        count++;
    }
    put_u32(b, count);
    return off;
}

/* RSP_ENTRY2: the entry with its owner, a link's target (read relative to
 * dirfd, the directory the entry is in, or AT_FDCWD) and its user.*
 * extended attributes (read at `full`, the entry's path). */
static int send_entry(int conn, int dirfd, const char *name, const char *full, const struct stat *st) {
    size_t nl = strlen(name);
    char target[PATH_MAX];
    ssize_t tl = S_ISLNK(st->st_mode) ? readlinkat(dirfd, name, target, sizeof target - 1) : 0;
    if (tl < 0) tl = 0;
    size_t room = 21 + 12 + nl + 4 + (size_t)tl + 4 + XATTR_MAX * (8 + 256 + XATTR_VALUE);
    unsigned char *b = malloc(room);
    if (!b) return send_error(conn, ENOMEM, "out of memory");
    uint8_t t = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    b[0] = t;
    put_u32(b + 1, (uint32_t)st->st_mode);
    put_u64(b + 5, (uint64_t)st->st_size);
    put_u64(b + 13, (uint64_t)st->st_mtim.tv_sec * 1000000000ull + (uint64_t)st->st_mtim.tv_nsec);
    put_u32(b + 21, (uint32_t)st->st_uid);
    put_u32(b + 25, (uint32_t)st->st_gid);
    put_u32(b + 29, (uint32_t)nl);
    memcpy(b + 33, name, nl);
    size_t off = 33 + nl;
    put_u32(b + off, (uint32_t)tl);
    memcpy(b + off + 4, target, (size_t)tl);
    off += 4 + (size_t)tl;
    off += put_xattrs(b + off, full, st);
    int r = send_frame(conn, RSP_ENTRY2, b, (uint32_t)off);
    free(b);
    return r;
}

static int send_ok(int conn, uint64_t n);

/* REQ_XATTR: remove every user.* attribute of `path` whose name starts
 * with `clear` (none if empty), then set the pairs given (user.* only). */
static int handle_xattr(int conn, const char *path, struct cursor *c) {
    char *clear = cur_str(c);
    uint32_t n = cur_u32(c);
    if (c->bad || n > XATTR_MAX) return send_error(conn, EINVAL, "malformed xattr request");
    size_t cl = strlen(clear);
    if (cl) {
        char names[8192];
        ssize_t got = llistxattr(path, names, sizeof names);
        if (got < 0) return send_error(conn, errno, "%s: %s", path, strerror(errno));
        for (ssize_t i = 0; i < got; i += (ssize_t)strlen(names + i) + 1)
            if (!strncmp(names + i, "user.", 5) && !strncmp(names + i, clear, cl))
                lremovexattr(path, names + i);
    }
    for (uint32_t i = 0; i < n; i++) {
        char *k = cur_str(c), *v = cur_str(c);
        if (c->bad || strncmp(k, "user.", 5) || strlen(v) > XATTR_VALUE)
            return send_error(conn, EINVAL, "xattr %u: a user.* name and at most %d bytes", i, XATTR_VALUE);
        if (lsetxattr(path, k, v, strlen(v), 0) < 0)
            return send_error(conn, errno, "%s: %s: %s", path, k, strerror(errno));
    }
    return send_ok(conn, n);
}

static int send_ok(int conn, uint64_t n) {
    unsigned char b[8];
    put_u64(b, n);
    return send_frame(conn, RSP_OK, b, 8);
}

static int handle_read(int conn, const char *path, uint64_t max, uint32_t flags) {
    int fd = open_file(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0, flags);
    if (fd < 0) return send_error(conn, errno, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        int e = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
        close(fd);
        return send_error(conn, e, "%s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > max) {
        close(fd);
        return send_error(conn, EFBIG, "%s: %llu bytes, more than the %llu allowed", path,
                          (unsigned long long)st.st_size, (unsigned long long)max);
    }
    static char buf[256 * 1024];
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int e = errno;
            close(fd);
            return send_error(conn, e, "%s: %s", path, strerror(e));
        }
        if (n == 0) break;
        total += (uint64_t)n;
        if (total > max) {
            close(fd);
            return send_error(conn, EFBIG, "%s: grew past the %llu bytes allowed", path, (unsigned long long)max);
        }
        if (send_frame(conn, RSP_DATA, buf, (uint32_t)n) < 0) break;
    }
    close(fd);
    return send_ok(conn, total);
}

static int handle_write(int conn, const char *path, uint32_t mode, uint32_t flags, uint64_t max) {
    int err = 0;
    char errmsg[512] = "";
    if ((flags & FILE_MKDIRS) &&
        ((flags & FILE_NOFOLLOW) ? mkdir_parent_nofollow(path) : mkdir_parent(path)) < 0) {
        err = errno;
        snprintf(errmsg, sizeof errmsg, "creating parents of %s: %s", path, strerror(err));
    }
    int fd = -1;
    if (!err) {
        int of = O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | ((flags & FILE_APPEND) ? O_APPEND : 0);
        struct stat before;
        int created = lstat(path, &before) < 0 && errno == ENOENT;
        fd = open_file(path, of, (mode_t)(mode & 07777), flags);
        /* A new file has the mode asked for, whatever the umask; it is
         * empty, so there is nothing to truncate. */
        if (fd >= 0 && created) fchmod(fd, (mode_t)(mode & 07777));
        struct stat st;
        if (fd < 0) {
            err = errno;
            snprintf(errmsg, sizeof errmsg, "%s: %s", path, strerror(err));
        } else if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
            err = EINVAL;
            snprintf(errmsg, sizeof errmsg, "%s: not a regular file", path);
        } else {
            fcntl(fd, F_SETFL, (flags & FILE_APPEND) ? O_APPEND : 0);
            if (!(flags & FILE_APPEND) && !created && ftruncate(fd, 0) < 0) {
                err = errno;
                snprintf(errmsg, sizeof errmsg, "%s: %s", path, strerror(err));
            }
        }
    }
    uint64_t total = 0;
    /* Always consume the data frames so the agent's stream stays in step. */
    for (;;) {
        struct frame f;
        if (recv_frame(conn, &f) < 0) {
            if (fd >= 0) close(fd);
            return -1;
        }
        if (f.type == REQ_END) {
            free(f.data);
            input_open = 0;
            break;
        }
        if (f.type == REQ_DATA && !err) {
            total += f.len;
            if (total > max) {
                err = EFBIG;
                snprintf(errmsg, sizeof errmsg, "%s: more than the %llu bytes allowed", path, (unsigned long long)max);
            } else if (write_full(fd, f.data, f.len) < 0) {
                err = errno;
                snprintf(errmsg, sizeof errmsg, "%s: %s", path, strerror(err));
            }
        }
        free(f.data);
    }
    if (fd >= 0 && close(fd) < 0 && !err) {
        err = errno;
        snprintf(errmsg, sizeof errmsg, "%s: %s", path, strerror(err));
    }
    if (err) return send_error(conn, err, "%s", errmsg);
    return send_ok(conn, total);
}

static int handle_list(int conn, const char *path) {
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return send_error(conn, errno, "%s: %s", path, strerror(errno));
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return send_error(conn, errno, "%s: %s", path, strerror(errno));
    }
    struct dirent *e;
    uint64_t count = 0;
    while ((e = readdir(d)) && count < LIST_MAX) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        char full[PATH_MAX];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (send_entry(conn, dfd, e->d_name, full, &st) < 0) break;
        count++;
    }
    closedir(d);
    return send_ok(conn, count);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)ftw;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) < 0 ? -1 : 0;
}

static int handle_remove(int conn, const char *path, uint32_t flags) {
    struct stat st;
    if (lstat(path, &st) < 0) return send_error(conn, errno, "%s: %s", path, strerror(errno));
    int r;
    if (S_ISDIR(st.st_mode)) {
        if (flags & FILE_RECURSIVE)
            r = nftw(path, rm_cb, 64, FTW_DEPTH | FTW_PHYS);
        else
            r = rmdir(path);
    } else {
        r = unlink(path);
    }
    if (r < 0) return send_error(conn, errno, "%s: %s", path, strerror(errno));
    return send_ok(conn, 0);
}

static int handle_kill(int conn, struct cursor *c) {
    pid_t pid = (pid_t)cur_u32(c);
    int sig = (int)cur_u32(c);
    if (c->bad || pid == 1 || sig <= 0 || sig >= NSIG) return send_error(conn, EINVAL, "bad kill request");
    if (pid == 0) {
        /* Every process of the sandbox but PID 1 (kill(-1) from the
         * namespace's init spares the caller). */
        if (kill(-1, sig) < 0 && errno != ESRCH) return send_error(conn, errno, "kill all: %s", strerror(errno));
        return send_ok(conn, 0);
    }
    /* Only a command's process group (commands start with setsid()). */
    if (getpgid(pid) != pid) return send_error(conn, ESRCH, "no command with pid %d", pid);
    if (kill(-pid, sig) < 0) return send_error(conn, errno, "kill %d: %s", pid, strerror(errno));
    return send_ok(conn, 0);
}

/* ------------------------------------------------------------------ reset */

/* Processes of the sandbox other than PID 1 and the caller that are not
 * already dead (zombies wait for PID 1 to reap them). */
static int others_alive(void) {
    DIR *d = opendir("/proc");
    if (!d) return -1;
    int n = 0;
    pid_t self = getpid();
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1 || pid == self) continue;
        char path[64], stat[256];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t r = read(fd, stat, sizeof stat - 1);
        close(fd);
        if (r <= 0) continue;
        stat[r] = 0;
        char *paren = strrchr(stat, ')');
        if (paren && paren[1] == ' ' && paren[2] == 'Z') continue;
        n++;
    }
    closedir(d);
    return n;
}

/* Remove everything under the directory open at dfd, never following a
 * link (the sandbox wrote these names). Returns the number removed. */
static long empty_dir(int dfd) {
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    long n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (unlinkat(dfd, e->d_name, 0) == 0) {
            n++;
            continue;
        }
        int sub = openat(dfd, e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sub < 0) continue;
        n += empty_dir(sub);
        if (unlinkat(dfd, e->d_name, AT_REMOVEDIR) == 0) n++;
    }
    closedir(d);
    return n;
}

/* Removing an object takes its owner's euid (sandboxes lack CAP_IPC_OWNER
 * and CAP_SYS_ADMIN): become each owner in turn. `uid_col` is the uid
 * column of the /proc table. */
static void drop_sysv(const char *table, int kind, int uid_col) {
    FILE *f = fopen(table, "re");
    if (!f) return;
    char line[512];
    if (!fgets(line, sizeof line, f)) {
        fclose(f);
        return;
    }
    while (fgets(line, sizeof line, f)) {
        long col[16];
        int n = 0;
        char *p = line, *end;
        while (n < 16) {
            col[n] = strtol(p, &end, 10);
            if (end == p) break;
            n++;
            p = end;
        }
        if (n <= uid_col) continue;
        int id = (int)col[1];
        if (seteuid((uid_t)col[uid_col]) < 0) continue;
        if (kind == 0) shmctl(id, IPC_RMID, NULL);
        else if (kind == 1) msgctl(id, IPC_RMID, NULL);
        else semctl(id, 0, IPC_RMID);
        if (seteuid(0) < 0) _exit(1); /* cannot happen: the saved uid is 0 */
    }
    fclose(f);
}

/* A function-call worker between two calls: nothing of the last call may
 * reach the next. Every process but PID 1 dies (repeatedly: a fork bomb
 * may still be forking), the given directories (the only writable places
 * of a worker) are emptied, and System V IPC objects are removed. */
/* A copy (a fork, a restore) wakes with its source's kernel random state
 * when that kernel is its own (a VM's guest): the node sends fresh bytes,
 * credited to the pool, and the CRNG is re-keyed from it at once, so no two
 * copies draw the same numbers from the kernel. In a container the ioctls
 * need CAP_SYS_ADMIN of the host's user namespace and fail with EPERM: its
 * kernel is the host's, which the node reseeds itself. */
static int handle_reseed(int conn, struct cursor *c) {
    if (c->left < 32 || c->left > 512)
        return send_error(conn, EINVAL, "reseed: 32 to 512 bytes of entropy, not %u", c->left);
    struct {
        struct rand_pool_info info;
        unsigned char buf[512];
    } pool;
    pool.info.entropy_count = (int)(c->left * 8);
    pool.info.buf_size = (int)c->left;
    memcpy(pool.buf, c->p, c->left);
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (fd < 0) return send_error(conn, errno, "reseed: /dev/urandom: %s", strerror(errno));
    int r = ioctl(fd, RNDADDENTROPY, &pool.info);
    if (r == 0) r = ioctl(fd, RNDRESEEDCRNG);
    int err = errno;
    close(fd);
    explicit_bzero(&pool, sizeof pool);
    if (r < 0) return send_error(conn, err, "reseed: %s", strerror(err));
    return send_ok(conn, 0);
}

/* A guest loaded from a saved state (a resume, a fork, a template) wakes
 * with the wall clock it was saved with: the node sends the time. Only a
 * VM's guest may set it; in a container clock_settime fails with EPERM
 * (the clock is the host's). The monotonic clocks carry on untouched. */
static int handle_settime(int conn, struct cursor *c) {
    uint64_t ns = cur_u64(c);
    if (c->bad || c->left != 0) return send_error(conn, EINVAL, "settime: a u64 of nanoseconds");
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    if (clock_settime(CLOCK_REALTIME, &ts) < 0)
        return send_error(conn, errno, "settime: %s", strerror(errno));
    return send_ok(conn, 0);
}

static int handle_reset(int conn, struct cursor *c) {
    char **dirs = cur_strv(c);
    if (c->bad) return send_error(conn, EINVAL, "malformed reset request");
    int left = -1;
    for (int round = 0; round < 2000; round++) {
        kill(-1, SIGKILL);
        left = others_alive();
        if (left == 0) break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (left != 0) return send_error(conn, EBUSY, "%d processes survived the reset", left);
    long removed = 0;
    for (char **dir = dirs; *dir; dir++) {
        int dfd = open(*dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (dfd < 0) return send_error(conn, errno, "%s: %s", *dir, strerror(errno));
        removed += empty_dir(dfd);
        /* What could not be removed (a tree deeper than the fds we may
         * open, say) must not reach the next call: say so, and the worker
         * is discarded instead of reused. */
        DIR *d = opendir(*dir);
        struct dirent *e;
        int left = 0;
        while (d && (e = readdir(d)))
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) left++;
        if (d) closedir(d);
        if (left) return send_error(conn, ENOTEMPTY, "%s: %d entries survived the reset", *dir, left);
    }
    drop_sysv("/proc/sysvipc/shm", 0, 7);
    drop_sysv("/proc/sysvipc/msg", 1, 7);
    drop_sysv("/proc/sysvipc/sem", 2, 4);
    return send_ok(conn, (uint64_t)removed);
}

/* ------------------------------------------------------------------ dispatch */

/* The agent may still be sending when an answer is final: stdin for a
 * command that exited without reading it, a file body after an error.
 * Closing with unread input would reset the connection, and the agent would
 * lose the answer already sent. So: stop writing, read and drop until the
 * agent closes (it does once it has the answer), for a bounded time. */
static void linger_input(int conn) {
    if (!input_open) return;
    shutdown(conn, SHUT_WR);
    static char sink[65536];
    struct pollfd p = {conn, POLLIN, 0};
    for (int rounds = 0; rounds < 8192 && poll(&p, 1, 2000) > 0; rounds++) {
        if (read(conn, sink, sizeof sink) <= 0) break;
    }
}

static void serve_connection(int conn) {
    struct frame f;
    if (recv_frame(conn, &f) < 0) return;
    struct cursor c = {.p = f.data, .left = f.len, .bad = 0};
    input_open = f.type == REQ_WRITE;
    if (f.type == REQ_PING) {
        unsigned char b[8];
        put_u32(b, CORRAL_PROTO_VERSION);
        put_u32(b + 4, (uint32_t)getpid());
        send_frame(conn, RSP_PONG, b, 8);
        return;
    }
    if (f.type == REQ_EXEC) {
        handle_exec(conn, &c);
        return;
    }
    if (f.type == REQ_KILL) {
        handle_kill(conn, &c);
        return;
    }
    if (f.type == REQ_RESET) {
        handle_reset(conn, &c);
        return;
    }
    if (f.type == REQ_RESEED) {
        handle_reseed(conn, &c);
        return;
    }
    if (f.type == REQ_SETTIME) {
        handle_settime(conn, &c);
        return;
    }
    if (f.type == REQ_PARK) {
        /* Only PID 1 can park its listener: this request reached a handler
         * because it had not fully arrived when PID 1 looked. */
        send_error(conn, EAGAIN, "park: not whole on arrival; ask again");
        return;
    }
    /* File operations: user, path, then per-operation fields. */
    char *user = cur_str(&c);
    char *path = cur_str(&c);
    if (c.bad || path[0] != '/') {
        send_error(conn, EINVAL, "malformed file request");
        return;
    }
    struct ident id;
    if (resolve_user(user, &id) < 0) {
        send_error_stage(conn, ESRCH, ERR_USER, "no such user: %s", user);
        return;
    }
    if (become(&id) < 0) {
        send_error(conn, errno, "switching to user %s: %s", user, strerror(errno));
        return;
    }
    switch (f.type) {
    case REQ_READ: {
        uint64_t max = cur_u64(&c);
        /* Flags came later: a request without them follows links. */
        uint32_t flags = c.left >= 4 ? cur_u32(&c) : 0;
        handle_read(conn, path, max, flags);
        break;
    }
    case REQ_WRITE: {
        uint32_t mode = cur_u32(&c), flags = cur_u32(&c);
        uint64_t max = cur_u64(&c);
        handle_write(conn, path, mode, flags, max);
        break;
    }
    case REQ_LIST:
        handle_list(conn, path);
        break;
    case REQ_XATTR:
        handle_xattr(conn, path, &c);
        break;
    case REQ_STAT: {
        struct stat st;
        if (lstat(path, &st) < 0)
            send_error(conn, errno, "%s: %s", path, strerror(errno));
        else
            send_entry(conn, AT_FDCWD, path, path, &st);
        break;
    }
    case REQ_MKDIR: {
        uint32_t mode = cur_u32(&c), flags = cur_u32(&c);
        int r = (flags & FILE_MKDIRS) ? mkdirs(path, (mode_t)mode) : mkdir(path, (mode_t)mode);
        if (r < 0)
            send_error(conn, errno, "%s: %s", path, strerror(errno));
        else
            send_ok(conn, 0);
        break;
    }
    case REQ_REMOVE:
        handle_remove(conn, path, cur_u32(&c));
        break;
    default:
        send_error(conn, EINVAL, "unknown request type 0x%x", f.type);
    }
}

/* ------------------------------------------------------------ VM serial */

/*
 * In a VM guest the agent has one channel, a virtio-serial port, instead of
 * a listening socket. A multiplexer process owns the port: each stream id
 * the host opens becomes a socketpair whose one end is handed to PID 1 (over
 * `fds`, SCM_RIGHTS) exactly as if accept() had returned it, so every
 * request is served by the same code as in a container. Frames keep their
 * shape: the stream id is rewritten between the port (its id) and the pair
 * (0). No path in the guest reaches the agent: the pairs are anonymous.
 */
#define MUX_STREAMS 1024

struct stream {
    uint32_t id;
    int fd;         /* the multiplexer's end of the pair; -1 when free */
    int host_done;  /* the host closed its direction */
    int guest_done; /* the handler closed its direction */
    unsigned char *in;
    size_t in_len;
};

static struct stream streams[MUX_STREAMS];

static struct stream *stream_find(uint32_t id) {
    for (int i = 0; i < MUX_STREAMS; i++)
        if (streams[i].fd >= 0 && streams[i].id == id) return &streams[i];
    return NULL;
}

static void stream_free(struct stream *st) {
    close(st->fd);
    free(st->in);
    memset(st, 0, sizeof *st);
    st->fd = -1;
}

static int send_fd(int sock, int fd) {
    char byte = 0;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    return sendmsg(sock, &m, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock) {
    char byte;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                       .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof(int));
    return fd;
}

static int port_frame(int port, uint32_t id, uint8_t type, const unsigned char *p, uint32_t len) {
    unsigned char hdr[FRAME_HEADER];
    put_u32(hdr, len);
    put_u32(hdr + 4, id);
    hdr[8] = type;
    if (write_full(port, hdr, sizeof hdr) < 0) return -1;
    return len ? write_full(port, p, len) : 0;
}

static void stream_guest_eof(int port, struct stream *st) {
    port_frame(port, st->id, FRAME_CLOSE, NULL, 0);
    st->guest_done = 1;
    if (st->host_done) stream_free(st);
}

static void close_all_streams(void) {
    for (int i = 0; i < MUX_STREAMS; i++)
        if (streams[i].fd >= 0) stream_free(&streams[i]);
}

/* Frames from the host: open streams, deliver, close. */
static void mux_from_port(int port, int fds, unsigned char *buf, size_t *len) {
    size_t off = 0;
    while (*len - off >= FRAME_HEADER) {
        uint32_t plen = get_u32le(buf + off), id = get_u32le(buf + off + 4);
        uint8_t type = buf[off + 8];
        if (plen > FRAME_MAX_PAYLOAD) { /* a broken host: drop everything */
            *len = 0;
            return;
        }
        if (*len - off < FRAME_HEADER + plen) break;
        struct stream *st = stream_find(id);
        if (type == FRAME_CLOSE && id == 0) {
            /* A new host (a resumed or forked guest's new channel, which
             * numbers its streams from 1 again): every stream of the old
             * one is void, its ids must not reach the old handlers. */
            close_all_streams();
        } else if (type == FRAME_CLOSE) {
            if (st) {
                shutdown(st->fd, SHUT_WR);
                st->host_done = 1;
                if (st->guest_done) stream_free(st);
            }
        } else if (id != 0) {
            if (!st) {
                int pair[2];
                struct stream *slot = NULL;
                for (int i = 0; i < MUX_STREAMS && !slot; i++)
                    if (streams[i].fd < 0) slot = &streams[i];
                if (slot && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0) {
                    int big = 4 << 20;
                    setsockopt(pair[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
                    setsockopt(pair[1], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
                    if (send_fd(fds, pair[1]) == 0) {
                        close(pair[1]);
                        slot->id = id;
                        slot->fd = pair[0];
                        st = slot;
                    } else { /* PID 1 cannot take it: the stream is refused */
                        close(pair[0]);
                        close(pair[1]);
                        port_frame(port, id, FRAME_CLOSE, NULL, 0);
                    }
                } else {
                    port_frame(port, id, FRAME_CLOSE, NULL, 0);
                }
            }
            if (st && !st->host_done) {
                unsigned char *f = buf + off;
                put_u32(f + 4, 0);
                if (write_full(st->fd, f, FRAME_HEADER + plen) < 0) stream_guest_eof(port, st);
            }
        }
        off += FRAME_HEADER + plen;
    }
    memmove(buf, buf + off, *len - off);
    *len -= off;
}

/* Bytes from a handler: forwarded as whole frames, tagged with the stream. */
static void mux_from_stream(int port, struct stream *st) {
    unsigned char chunk[IO_CHUNK];
    ssize_t r = read(st->fd, chunk, sizeof chunk);
    if (r <= 0) {
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) return;
        stream_guest_eof(port, st);
        return;
    }
    unsigned char *grown = realloc(st->in, st->in_len + (size_t)r);
    if (!grown) return;
    st->in = grown;
    memcpy(st->in + st->in_len, chunk, (size_t)r);
    st->in_len += (size_t)r;
    size_t off = 0;
    while (st->in_len - off >= FRAME_HEADER) {
        uint32_t plen = get_u32le(st->in + off);
        if (st->in_len - off < FRAME_HEADER + plen) break;
        put_u32(st->in + off + 4, st->id);
        write_full(port, st->in + off, FRAME_HEADER + plen);
        off += FRAME_HEADER + plen;
    }
    memmove(st->in, st->in + off, st->in_len - off);
    st->in_len -= off;
}

static void run_mux(const char *path, int fds) {
    /* A handler that went away must cost its stream (EPIPE), not the mux. */
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < MUX_STREAMS; i++) streams[i].fd = -1;
    static unsigned char buf[2 * (FRAME_MAX_PAYLOAD + FRAME_HEADER)];
    size_t len = 0;
    int port = -1;
    for (;;) {
        if (port < 0) {
            if ((port = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY)) < 0) {
                logmsg("open %s: %s", path, strerror(errno));
                sleep(1);
                continue;
            }
            /* A terminal (the host tests the channel over a pty) must pass
             * bytes through untouched. A virtio port is not a terminal. */
            struct termios t;
            if (isatty(port) && tcgetattr(port, &t) == 0) {
                cfmakeraw(&t);
                tcsetattr(port, TCSANOW, &t);
            }
        }
        struct pollfd p[MUX_STREAMS + 1];
        struct stream *who[MUX_STREAMS + 1];
        int n = 0;
        p[n++] = (struct pollfd){port, POLLIN, 0};
        for (int i = 0; i < MUX_STREAMS; i++)
            if (streams[i].fd >= 0 && !streams[i].guest_done) {
                who[n] = &streams[i];
                p[n++] = (struct pollfd){streams[i].fd, POLLIN, 0};
            }
        if (poll(p, (nfds_t)n, -1) < 0) continue;
        if (p[0].revents & POLLIN) {
            ssize_t r = read(port, buf + len, sizeof buf - len);
            if (r > 0) {
                len += (size_t)r;
                mux_from_port(port, fds, buf, &len);
            } else if (r == 0) {
                p[0].revents |= POLLHUP;
            }
        }
        if ((p[0].revents & POLLHUP) && !(p[0].revents & POLLIN)) {
            /* No host on the other end (not yet, or it went away): whatever
             * was in flight is void; wait for the next host. */
            close_all_streams();
            len = 0;
            struct timespec t = {0, 100 * 1000 * 1000};
            nanosleep(&t, NULL);
        }
        for (int i = 1; i < n; i++)
            if (p[i].revents && who[i]->fd >= 0) mux_from_stream(port, who[i]);
    }
}

/* ------------------------------------------------------------------ main */

static int listen_on_path(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
    unlink(path);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 512) < 0) {
        logmsg("listen %s: %s", path, strerror(errno));
        exit(1);
    }
    return fd;
}

/* Closing the listener would reset the connections queued on it without a
 * word, and the node could not tell that nothing of their requests ran. So
 * new connections are refused from here (the node's client waits for the
 * change and connects again), and each queued one is told ERR_PARKED. Its
 * request is read first where it has arrived: a peer whose unread bytes
 * are dropped gets a reset before it can read the answer. */
static void refuse_queued(int lfd) {
    fcntl(lfd, F_SETFL, fcntl(lfd, F_GETFL) | O_NONBLOCK); /* never waits, whatever the kernel */
    shutdown(lfd, SHUT_RD);
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) break;
        char sink[4096];
        while (recv(c, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
        send_error_stage(c, EAGAIN, ERR_PARKED, "the exec server was parked: ask again");
        close(c);
    }
}

/* REQ_PARK: the listener becomes a memfd placeholder (see proto.h); returns
 * the abstract socket to wait on, or -1 (the listener is kept). Closes conn:
 * the node freezes the sandbox once it sees conn end, and no socket of the
 * host's may be left in PID 1 then. */
static int park(int conn, int lfd, const unsigned char *nonce) {
    char name[64];
    for (int i = 0; i < 16; i++)
        if (!((nonce[i] >= '0' && nonce[i] <= '9') || (nonce[i] >= 'a' && nonce[i] <= 'f'))) {
            send_error(conn, EINVAL, "park: the nonce must be 16 hex digits");
            close(conn);
            return -1;
        }
    snprintf(name, sizeof name, "corral-ctl-%.16s", (const char *)nonce);
    int mfd = (int)syscall(SYS_memfd_create, name, MFD_CLOEXEC);
    int pk = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int len = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "corral-park-%.16s", (const char *)nonce);
    socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len);
    if (mfd < 0 || pk < 0 || bind(pk, (struct sockaddr *)&a, alen) < 0 || listen(pk, 4) < 0) {
        send_error(conn, errno, "park: %s", strerror(errno));
        close(conn);
        if (mfd >= 0) close(mfd);
        if (pk >= 0) close(pk);
        return -1;
    }
    refuse_queued(lfd);
    /* Swapped before the answer: the node freezes the sandbox on hearing it. */
    dup3(mfd, lfd, O_CLOEXEC);
    close(mfd);
    send_frame(conn, RSP_OK, NULL, 0);
    close(conn);
    return pk;
}

/* A parked init's way back: only a peer outside the sandbox's pid namespace
 * (its pid reads as 0 here) may hand it a listener. Returns 1 when unparked
 * (init then execs itself), 0 to go on waiting. */
static int unpark(int pk, int lfd) {
    int c = accept4(pk, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) return 0;
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl) < 0 || cred.pid != 0) {
        close(c);
        return 0;
    }
    char byte;
    char ctl[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                       .msg_controllen = sizeof ctl};
    ssize_t n = recvmsg(c, &m, MSG_CMSG_CLOEXEC);
    close(c);
    if (n != 1) return 0;
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    if (h && h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
        int fd;
        memcpy(&fd, CMSG_DATA(h), sizeof fd);
        dup3(fd, lfd, O_CLOEXEC);
        close(fd);
    }
    return 1;
}

static int uid_of(const char *name, uid_t *uid) {
    struct ident id;
    if (lookup_user(name, &id, 0) < 0) return -1; /* the uid alone: no /etc/group */
    *uid = id.uid;
    return 0;
}

/* A sudo request: the broker runs in a handler of its own. */
static void accept_sudo(int sudo_fd, int lfd, int sfd) {
    int c = accept4(sudo_fd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
        /* Out of fds or memory (a full memory cgroup): the connection
         * stays queued and the listener readable; a pause, not a spin. */
        if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, NULL);
        }
        return;
    }
    if (!sudo_allowed(c)) {
        static const char no[] = "Eyou may not run sudo in this sandbox (" SUDO_USERS " does not name you)";
        if (send(c, no, sizeof no - 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {}
        close(c);
        return;
    }
    pid_t h = fork();
    if (h == 0) {
        close(lfd);
        close(sfd);
        close(sudo_fd);
        sudo_serve(c);
        _exit(0);
    }
    close(c);
}

int main(int argc, char **argv) {
    if (argc < 1) return 2; /* run with no argv[0] at all: by no one of ours */
    const char *called = strrchr(argv[0], '/');
    if (strcmp(called ? called + 1 : argv[0], "sudo") == 0) return sudo_main(argc, argv);
    int lfd = LISTEN_FD, serial = 0, parked = -1, sudo_fd = -1;
    /* `--listen PATH` serves on a path: used by tests outside a container. */
    if (argc == 3 && strcmp(argv[1], "--listen") == 0) lfd = listen_on_path(argv[2]);
    else if (argc == 3 && strcmp(argv[1], "--serial") == 0) {
        /* A VM guest: requests arrive as fds from the port's multiplexer. */
        int pair[2];
        if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) {
            logmsg("socketpair: %s", strerror(errno));
            return 1;
        }
        pid_t mux = fork();
        if (mux == 0) {
            close(pair[0]);
            prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
            run_mux(argv[2], pair[1]);
            _exit(1);
        }
        close(pair[1]);
        lfd = pair[0];
        serial = 1;
    } else if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        printf("corral-init %d\n", CORRAL_PROTO_VERSION);
        return 0;
    }

    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    fcntl(lfd, F_SETFD, FD_CLOEXEC);
    /* Nothing but stdio and the listening socket stays open. */
    if (lfd == LISTEN_FD && !serial) {
        syscall(SYS_close_range, LISTEN_FD + 1, ~0U, 0);
        /* /dev/shm is a directory of the sandbox's /dev tmpfs, not a tmpfs
         * of its own: every superblock on the host costs every memory
         * cgroup a shrinker slot (docs/memory-reclaim.md). Only a directory
         * this call created is chmod-ed (after a restore's re-exec it is
         * there already, and whatever is there is the sandbox's own). */
        if (mkdir("/dev/shm", 01777) == 0) chmod("/dev/shm", 01777);
    }

    /* Not for `--listen` (tests on the host): it would listen on the host's /run. */
    if (lfd == LISTEN_FD || serial) sudo_fd = sudo_listen(uid_of);

    signal(SIGPIPE, SIG_IGN);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);

    for (;;) {
        /* Parked: the listener is a placeholder (always "readable"). */
        struct pollfd p[3] = {{parked >= 0 ? parked : lfd, POLLIN, 0}, {sfd, POLLIN, 0},
                              {sudo_fd, POLLIN, 0}};
        if (poll(p, sudo_fd >= 0 ? 3 : 2, -1) < 0) {
            if (errno == EINTR) continue;
            logmsg("poll: %s", strerror(errno));
            return 1;
        }
        if (p[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            while (waitpid(-1, NULL, WNOHANG) > 0) {}
        }
        if (sudo_fd >= 0 && p[2].revents) accept_sudo(sudo_fd, lfd, sfd);
        if (p[0].revents && parked >= 0) {
            if (unpark(parked, lfd)) {
                /* Afresh, as at create: after a restore this process's
                 * memory belongs to the host's user namespace, which would
                 * make the next checkpoint fail; exec resets that. */
                fcntl(lfd, F_SETFD, 0);
                execv(argv[0], argv);
                logmsg("re-exec %s: %s", argv[0], strerror(errno));
                return 1;
            }
            continue;
        }
        if (p[0].revents) {
            int conn = serial ? recv_fd(lfd) : accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (conn < 0) continue;
            /* A ping (readiness check) that has already arrived is answered
             * here, without a handler: it is most of what create waits on.
             * (17 bytes on a fresh socket: the write cannot block.) A kill
             * is too: it must work when the sandbox has no pid left to fork
             * a handler with (a fork bomb against pids.max). */
            unsigned char peek[FRAME_HEADER + 16];
            /* Accepted before its first bytes arrived (a loaded host): wait
             * for them a little, so that what only PID 1 can answer (a park)
             * reaches PID 1. Only the node can connect here. */
            struct pollfd first = {conn, POLLIN, 0};
            if (!serial) poll(&first, 1, 20);
            ssize_t got = recv(conn, peek, sizeof peek, MSG_PEEK | MSG_DONTWAIT);
            if (got >= FRAME_HEADER + 8 && peek[8] == REQ_KILL && get_u32le(peek) == 8) {
                if (recv(conn, peek, FRAME_HEADER + 8, MSG_DONTWAIT) == FRAME_HEADER + 8) {
                    struct cursor kc = {.p = peek + FRAME_HEADER, .left = 8, .bad = 0};
                    handle_kill(conn, &kc);
                }
                close(conn);
                continue;
            }
            if (got >= FRAME_HEADER && peek[8] == REQ_PING && get_u32le(peek) == 0) {
                if (recv(conn, peek, FRAME_HEADER, MSG_DONTWAIT) == FRAME_HEADER) {
                    unsigned char b[8];
                    put_u32(b, CORRAL_PROTO_VERSION);
                    put_u32(b + 4, (uint32_t)getpid());
                    send_frame(conn, RSP_PONG, b, 8);
                }
                close(conn);
                continue;
            }
            if (!serial && got >= FRAME_HEADER + 16 && peek[8] == REQ_PARK &&
                get_u32le(peek) == 16) {
                unsigned char req[FRAME_HEADER + 16];
                if (recv(conn, req, sizeof req, MSG_DONTWAIT) == (ssize_t)sizeof req) {
                    parked = park(conn, lfd, req + FRAME_HEADER);
                    /* Its socket is the sandbox's, but CRIU need not carry
                     * it: init execs itself once unparked and listens again. */
                    if (parked >= 0) {
                        sudo_close(sudo_fd);
                        sudo_fd = -1;
                    }
                } else
                    close(conn);
                continue;
            }
            pid_t h = fork();
            if (h == 0) {
                close(lfd);
                close(sfd);
                /* Root's broker is no handler's: a file request becomes
                 * its user in this process, and a park must close it. */
                if (sudo_fd >= 0) close(sudo_fd);
                prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
                serve_connection(conn);
                linger_input(conn);
                _exit(0);
            }
            if (h < 0) send_error(conn, errno, "fork: %s", strerror(errno));
            close(conn);
        }
    }
}
