/* sudo without a setuid bit: the broker in corral-init and the caller's
 * side (sudo.h says why and what holds). */
#define _GNU_SOURCE
#include "sudo.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "init.h"

extern char **environ;

/* A request: u32 argc, u32 envc, u32 flags, then the user to run as, cwd,
 * argv and env, each NUL-ended, in one datagram, with the caller's fds 0,
 * 1 and 2.
 * The user is the caller's choice (a sudo user may become root, so any
 * user); who may ask at all is the kernel's word. */
#define SUDO_REQ_MAX (128 * 1024)
#define SUDO_USERS_MAX 64
#define SUDO_FILE_MAX (64 * 1024)
#define SECURE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
/* Answers: 'S' then the command's i32 wait status, or 'E' then why not.
 * While it runs the caller may send a signal's number (i32) for the
 * command's process group: what its own terminal or killer sent it. */
#define ANSWER_STATUS 'S'
#define ANSWER_REFUSED 'E'
/* The caller runs in the foreground of the terminal its stdin and stdout
 * are: the command gets a terminal of its own (below). */
#define REQ_TERMINAL 1u
#define REQ_HEADER 12

/* A control buffer aligned for struct cmsghdr. */
union fds_ctl {
    char buf[CMSG_SPACE(3 * sizeof(int))];
    struct cmsghdr align;
};

/* What a caller may pass on: the signals a terminal or a kill sends. */
static int forwarded(int sig) {
    return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT || sig == SIGUSR1 ||
           sig == SIGUSR2 || sig == SIGWINCH;
}

static uid_t sudoers[SUDO_USERS_MAX];
static int n_sudoers;

static int read_users(int (*uid_of)(const char *name, uid_t *uid)) {
    int fd = open(SUDO_USERS, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return 0;
    struct stat st;
    char *buf = NULL;
    ssize_t n = -1;
    /* The image's file: read only, bounded, and only a name list. */
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size <= SUDO_FILE_MAX) {
        buf = malloc((size_t)st.st_size + 1);
        if (buf) n = read(fd, buf, (size_t)st.st_size);
    }
    close(fd);
    if (n < 0) {
        free(buf);
        return 0;
    }
    buf[n] = 0;
    n_sudoers = 0;
    char *save = NULL;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        line += strspn(line, " \t");
        line[strcspn(line, " \t\r#")] = 0;
        uid_t uid;
        if (!*line || uid_of(line, &uid) < 0 || uid == 0) continue;
        sudoers[n_sudoers++] = uid;
        if (n_sudoers == SUDO_USERS_MAX) break; /* the rest would each read /etc/passwd */
    }
    free(buf);
    return n_sudoers;
}

int sudo_listen(int (*uid_of)(const char *name, uid_t *uid)) {
    if (!read_users(uid_of)) return -1;
    if (mkdir("/run", 0755) < 0 && errno != EEXIST) return -1;
    /* Root's own directory: no sandbox user can put a socket of theirs at
     * this path (a caller would hand it its fds and take its answer). */
    struct stat st;
    if (lstat("/run", &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != 0 || (st.st_mode & 0022)) {
        logmsg("sudo: /run must be root's directory, not writable by others: no sudo");
        return -1;
    }
    unlink(SUDO_SOCKET);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", SUDO_SOCKET);
    mode_t old = umask(0111); /* 0666: anyone may ask; SO_PEERCRED decides */
    int ok = s >= 0 && bind(s, (struct sockaddr *)&a, sizeof a) == 0 && listen(s, 64) == 0;
    umask(old);
    if (!ok) {
        logmsg("sudo: listening at %s: %s", SUDO_SOCKET, strerror(errno));
        if (s >= 0) close(s);
        return -1;
    }
    return s;
}

void sudo_close(int fd) {
    if (fd < 0) return;
    close(fd);
    unlink(SUDO_SOCKET);
}

int sudo_allowed(int conn) {
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) return 0;
    if (cred.uid == 0) return 1;
    for (int i = 0; i < n_sudoers; i++)
        if (sudoers[i] == cred.uid) return 1;
    return 0;
}

static void answer(int conn, char kind, const void *body, size_t len) {
    char b[512];
    if (len > sizeof b - 1) len = sizeof b - 1;
    b[0] = kind;
    memcpy(b + 1, body, len);
    if (send(conn, b, len + 1, MSG_NOSIGNAL) < 0) { /* the caller is gone */ }
}

static void refuse(int conn, const char *why) {
    answer(conn, ANSWER_REFUSED, why, strlen(why));
}

/* The request's strings, each checked to end inside the datagram. */
static char **strings(char **at, const char *end, uint32_t n) {
    if (n > SUDO_REQ_MAX / 2) return NULL;
    char **v = calloc((size_t)n + 1, sizeof *v);
    if (!v) return NULL;
    for (uint32_t i = 0; i < n; i++) {
        char *nul = memchr(*at, 0, (size_t)(end - *at));
        if (!nul) {
            free(v);
            return NULL;
        }
        v[i] = *at;
        *at = nul + 1;
    }
    return v;
}

/* A command's own terminal, as sudo's use_pty: the caller's terminal is
 * set raw and relayed both ways to a new pty whose slave is the command's
 * controlling terminal, so the command is its foreground (job control,
 * /dev/tty, a Ctrl-C typed reaches it through the pty's line discipline).
 * The caller's terminal is given back as it was when the command ends or
 * the caller goes. Suspend (^Z) is passed as a byte: a command stopped
 * under the broker would hold its caller with nothing to resume it. */
struct terminal {
    int master, slave, in, out; /* in, out: the caller's terminal */
    int master_open, in_open, raw;
    struct termios saved;
    char pending[4096]; /* typed, not yet taken by the pty */
    size_t pending_len;
};

static void write_all(int fd, const char *b, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w > 0) {
            b += w;
            n -= (size_t)w;
        } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            struct pollfd p = {fd, POLLOUT, 0};
            if (poll(&p, 1, 1000) == 0) return; /* nobody reads the caller's terminal */
        } else {
            return;
        }
    }
}

static int terminal_open(struct terminal *t, const int fds[3]) {
    if (!isatty(fds[0]) || !isatty(fds[1]) || tcgetattr(fds[0], &t->saved) < 0) return -1;
    t->master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (t->master < 0) return -1;
    if (grantpt(t->master) < 0 || unlockpt(t->master) < 0 ||
        (t->slave = open(ptsname(t->master), O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
        close(t->master);
        return -1;
    }
    struct termios mine = t->saved;
    mine.c_cc[VSUSP] = _POSIX_VDISABLE;
    tcsetattr(t->slave, TCSANOW, &mine);
    struct winsize ws;
    if (ioctl(fds[0], TIOCGWINSZ, &ws) == 0) ioctl(t->master, TIOCSWINSZ, &ws);
    struct termios raw = t->saved;
    cfmakeraw(&raw);
    t->raw = tcsetattr(fds[0], TCSADRAIN, &raw) == 0;
    t->in = fds[0];
    t->out = fds[1];
    t->master_open = t->in_open = 1;
    t->pending_len = 0;
    return 0;
}

/* One round of the relay, after poll said what is ready. */
static void terminal_relay(struct terminal *t, short master_ev, short in_ev) {
    char b[4096];
    if (master_ev & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t n = read(t->master, b, sizeof b);
        if (n > 0) write_all(t->out, b, (size_t)n);
        else if (n == 0 || (errno != EAGAIN && errno != EINTR)) t->master_open = 0; /* EIO: no slave left */
    }
    if (in_ev & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t n = read(t->in, t->pending, sizeof t->pending);
        if (n > 0) t->pending_len = (size_t)n;
        else if (n == 0 || (errno != EAGAIN && errno != EINTR)) t->in_open = 0;
    }
    if (!t->master_open) t->pending_len = 0; /* no one left to read it */
    if (t->pending_len) { /* the pty takes what its input buffer holds; the rest waits */
        ssize_t w = write(t->master, t->pending, t->pending_len);
        if (w > 0) {
            memmove(t->pending, t->pending + w, t->pending_len - (size_t)w);
            t->pending_len -= (size_t)w;
        } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
            t->pending_len = 0;
        }
    }
}

/* What the command wrote before it ended, which the pty may still be
 * passing to its master (the kernel hands it over from a work queue):
 * read until no slave is left (EIO), or nothing came for 50 ms, or for
 * half a second at most (descendants that keep the terminal and write on
 * are not waited for, as with the exec server's pipes). */
static void terminal_drain(struct terminal *t) {
    char b[4096];
    struct timespec now, end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_nsec += 500000000L;
    if (end.tv_nsec >= 1000000000L) end.tv_sec++, end.tv_nsec -= 1000000000L;
    while (t->master >= 0 && t->master_open) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec >= end.tv_nsec)) break;
        struct pollfd p = {t->master, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) break;
        ssize_t n = read(t->master, b, sizeof b);
        if (n <= 0) break;
        write_all(t->out, b, (size_t)n);
    }
}

static void terminal_resize(struct terminal *t) {
    struct winsize ws;
    if (ioctl(t->in, TIOCGWINSZ, &ws) == 0) ioctl(t->master, TIOCSWINSZ, &ws);
}

static void terminal_end(struct terminal *t) {
    if (t->master < 0) return;
    if (t->raw) tcsetattr(t->in, TCSADRAIN, &t->saved);
    close(t->master);
    close(t->in);
    close(t->out);
    t->master = -1;
}

void sudo_serve(int conn) {
    char *buf = malloc(SUDO_REQ_MAX);
    union fds_ctl ctl;
    struct iovec iov = {buf, SUDO_REQ_MAX};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
    struct pollfd first = {conn, POLLIN, 0};
    if (!buf || poll(&first, 1, 10000) != 1) return;
    ssize_t n = recvmsg(conn, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    struct cmsghdr *h = n > 0 ? CMSG_FIRSTHDR(&m) : NULL;
    if (!h || h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS ||
        h->cmsg_len != CMSG_LEN(3 * sizeof(int)) || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n < REQ_HEADER + 1) {
        refuse(conn, "malformed request");
        return;
    }
    int fds[3];
    memcpy(fds, CMSG_DATA(h), sizeof fds);
    uint32_t argc, envc, flags;
    memcpy(&argc, buf, 4);
    memcpy(&envc, buf + 4, 4);
    memcpy(&flags, buf + 8, 4);
    char *at = buf + REQ_HEADER, *end = buf + n;
    char **head = strings(&at, end, 2); /* the user, the cwd */
    char **argv = head ? strings(&at, end, argc) : NULL;
    char **env = argv ? strings(&at, end, envc) : NULL;
    if (!env || argc == 0) {
        refuse(conn, "malformed request");
        return;
    }
    struct ident target;
    if (resolve_user(head[0], &target) < 0) {
        refuse(conn, "unknown user");
        return;
    }
    const char *cwd = head[1];

    struct terminal t = {.master = -1};
    if ((flags & REQ_TERMINAL) && terminal_open(&t, fds) < 0) t.master = -1;
    int stdio[3] = {t.master >= 0 ? t.slave : fds[0], t.master >= 0 ? t.slave : fds[1],
                    t.master >= 0 && isatty(fds[2]) ? t.slave : fds[2]};

    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    pid_t pid = fork();
    if (pid < 0) {
        terminal_end(&t);
        refuse(conn, "fork failed");
        return;
    }
    if (pid == 0) {
        setsid();
        for (int i = 0; i < 3; i++) dup2(stdio[i], i);
        if (t.master >= 0) ioctl(0, TIOCSCTTY, 0); /* its controlling terminal */
        syscall(SYS_close_range, 3, ~0U, 0);
        command_child_defaults();
        if (become(&target) < 0) {
            dprintf(2, "sudo: becoming uid %u: %s\n", (unsigned)target.uid, strerror(errno));
            _exit(1);
        }
        if (chdir(cwd) < 0) {
            dprintf(2, "sudo: unable to change directory to %s: %s\n", cwd, strerror(errno));
            _exit(1);
        }
        environ = env;
        execvp(argv[0], argv);
        if (errno == ENOENT) dprintf(2, "sudo: %s: command not found\n", argv[0]);
        else dprintf(2, "sudo: %s: %s\n", argv[0], strerror(errno));
        _exit(1);
    }
    if (t.master >= 0) close(t.slave);
    for (int i = 0; i < 3; i++)
        if (t.master < 0 || i == 2) close(fds[i]); /* the relay keeps the caller's stdin, stdout */

    /* SIGCHLD is blocked here, as in PID 1 this was forked from. Orphans
     * of the command re-parent here (a subreaper): each is reaped too. */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    for (;;) {
        struct pollfd p[4] = {{conn, POLLIN, 0}, {sfd, POLLIN, 0}, {-1, 0, 0}, {-1, 0, 0}};
        if (t.master >= 0) {
            /* A negative fd is skipped by poll: a side that ended is. */
            p[2] = (struct pollfd){t.master_open ? t.master : -1, POLLIN | (t.pending_len ? POLLOUT : 0), 0};
            p[3] = (struct pollfd){t.in_open && !t.pending_len ? t.in : -1, POLLIN, 0};
        }
        /* Without a signalfd, a look at the children every 100 ms. */
        if (poll(p, 4, sfd >= 0 ? -1 : 100) < 0 && errno != EINTR) break;
        /* Drained before the children are looked at, never after: a
         * SIGCHLD read after the look (the command dying of a signal just
         * passed on) would be lost, and this loop would wait forever. */
        struct signalfd_siginfo si;
        while (sfd >= 0 && read(sfd, &si, sizeof si) > 0) {}
        int status;
        pid_t w;
        while ((w = waitpid(-1, &status, WNOHANG)) > 0) {
            if (w != pid) continue;
            terminal_drain(&t);
            terminal_end(&t);
            int32_t st = status;
            answer(conn, ANSWER_STATUS, &st, sizeof st);
            return; /* its orphans, if any, go on under PID 1 */
        }
        if (t.master >= 0) terminal_relay(&t, p[2].revents, p[3].revents);
        if (p[0].revents) {
            int32_t sig;
            ssize_t got = recv(conn, &sig, sizeof sig, MSG_DONTWAIT);
            if (got == (ssize_t)sizeof sig && forwarded(sig)) {
                /* A terminal of its own tells its foreground of a resize. */
                if (sig == SIGWINCH && t.master >= 0) terminal_resize(&t);
                else kill(-pid, sig);
            } else if (got != -1 || (errno != EAGAIN && errno != EINTR)) break; /* gone */
        }
    }
    terminal_end(&t);
    kill_tree(); /* the caller is gone (or spoke out of turn): so is its command */
}

/* ------------------------------------------------------------- the caller */

static void usage(FILE *to) {
    fprintf(to,
            "usage: sudo [-EHknSv] [-p prompt] [-u user] [-i | -s] [VAR=value] [--] [command [arg ...]]\n"
            "       sudo -l | -V | -h\n"
            "Runs the command as root (or -u user): this sandbox's image names the users who may\n"
            "(" SUDO_USERS "). There is no password and no sudoers file.\n");
}

#define VERSION_LINE "sudo (Corral's, for sandboxes under no_new_privs; docs/sudo.md)\n"

/* What sudo's env_reset keeps of the caller's environment. */
static int kept(const char *e) {
    static const char *keep[] = {"TERM=", "COLORTERM=", "DISPLAY=", "LANG=", "LANGUAGE=", "LC_",
                                 "TZ=", "XAUTHORITY=", "LS_COLORS=", NULL};
    for (int i = 0; keep[i]; i++)
        if (strncmp(e, keep[i], strlen(keep[i])) == 0) return 1;
    return 0;
}

static int replaced(const char *e) {
    static const char *ours[] = {"PATH=", "HOME=", "USER=", "LOGNAME=", "SHELL=", "MAIL=",
                                 "SUDO_", NULL};
    for (int i = 0; ours[i]; i++)
        if (strncmp(e, ours[i], strlen(ours[i])) == 0) return 1;
    return 0;
}

/* --preserve-env=A,B: whether `e` is one of the names listed. */
static int listed(const char *e, const char *list) {
    size_t n = strcspn(e, "=");
    for (const char *p = list; *p;) {
        size_t k = strcspn(p, ",");
        if (k == n && strncmp(p, e, n) == 0) return 1;
        p += k + (p[k] == ',');
    }
    return 0;
}

/* NAME=value before the command: a variable for it, as sudo takes one. */
static int assignment(const char *a) {
    const char *eq = strchr(a, '=');
    if (!eq || eq == a) return 0;
    for (const char *c = a; c < eq; c++)
        if (!(*c == '_' || (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') ||
              (c > a && *c >= '0' && *c <= '9')))
            return 0;
    return 1;
}

static void *need(void *p) {
    if (!p) {
        fprintf(stderr, "sudo: out of memory\n");
        exit(1);
    }
    return p;
}

/* -s and -i hand the command to a shell as one string: each character but
 * letters, digits, '_', '-' and '$' escaped, as sudo does. */
static char *shell_words(char **words, int n) {
    size_t len = 1;
    for (int k = 0; k < n; k++) len += 2 * strlen(words[k]) + 1;
    char *out = need(calloc(len, 1)), *o = out;
    for (int k = 0; k < n; k++) {
        if (k) *o++ = ' ';
        for (const char *c = words[k]; *c; c++) {
            int plain = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                        (*c >= '0' && *c <= '9') || *c == '_' || *c == '-' || *c == '$';
            if (!plain) *o++ = '\\';
            *o++ = *c;
        }
    }
    return out;
}

/* The caller's side once the request is sent: what the caller's terminal
 * or killer sends it goes to the command, and the answer is its status. */
static void forwarded_set(sigset_t *fw) {
    sigemptyset(fw);
    for (int sig = 1; sig < NSIG; sig++)
        if (forwarded(sig)) sigaddset(fw, sig);
}

static int wait_answer(int s) {
    sigset_t fw; /* blocked since sudo_main began */
    forwarded_set(&fw);
    int sfd = signalfd(-1, &fw, SFD_CLOEXEC | SFD_NONBLOCK);
    char ans[512];
    ssize_t n = -1;
    int resets = 0; /* a reset is reported once, before what is queued */
    for (;;) {
        struct pollfd p[2] = {{s, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(p, sfd >= 0 ? 2 : 1, -1) < 0 && errno != EINTR) break;
        struct signalfd_siginfo si;
        while (sfd >= 0 && read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
            int32_t sig = (int32_t)si.ssi_signo;
            if (send(s, &sig, sizeof sig, MSG_NOSIGNAL) < 0) {}
        }
        if (!p[0].revents) continue;
        n = recv(s, ans, sizeof ans - 1, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR || (errno == ECONNRESET && resets++ == 0)))
            continue;
        break;
    }
    if (n == 5 && ans[0] == ANSWER_STATUS) {
        int32_t status;
        memcpy(&status, ans + 1, 4);
        if (WIFSIGNALED(status)) { /* as the caller's shell would have seen it */
            sigprocmask(SIG_UNBLOCK, &fw, NULL);
            signal(WTERMSIG(status), SIG_DFL);
            raise(WTERMSIG(status));
            return 128 + WTERMSIG(status);
        }
        return WEXITSTATUS(status);
    }
    if (n > 1 && ans[0] == ANSWER_REFUSED) {
        ans[n] = 0;
        fprintf(stderr, "sudo: %s\n", ans + 1);
        return 1;
    }
    fprintf(stderr, "sudo: the sandbox's init ended the request without an answer\n");
    return 1;
}

static int request(int argc, char **argv);
static sigset_t caller_mask; /* what the command execs with, as the caller had it */

int sudo_main(int argc, char **argv) {
    /* Blocked from the start, not from the request's sending: a signal
     * sent once the caller saw the command begin (the command starts
     * before this process reaches its wait) killed this process and never
     * reached the command. wait_answer reads and passes on what came; one
     * that comes outside it is delivered once unblocked, as to any process. */
    sigset_t fw;
    forwarded_set(&fw);
    sigprocmask(SIG_BLOCK, &fw, &caller_mask);
    int rc = request(argc, argv);
    sigprocmask(SIG_SETMASK, &caller_mask, NULL);
    return rc;
}

static int request(int argc, char **argv) {
    /* A closed stdin, stdout or stderr becomes /dev/null before any other
     * fd is made (the socket would take its number, and the command's
     * output would go to the broker). */
    for (int k = 0; k < 3; k++)
        if (fcntl(k, F_GETFD) < 0 && open("/dev/null", O_RDWR) != k) return 1;
    int preserve = 0, login = 0, shell = 0, validate = 0, list = 0, i = 1;
    const char *keep_list = NULL, *runas = "root";
    for (; i < argc && argv[i][0] == '-' && argv[i][1]; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            printf(VERSION_LINE);
            return 0;
        }
        const char *user = NULL;
        if (strncmp(a, "--user=", 7) == 0) user = a + 7;
        else if (strcmp(a, "--user") == 0 && i + 1 < argc) user = argv[++i];
        else if (strcmp(a, "--preserve-env") == 0) preserve = 1;
        else if (strncmp(a, "--preserve-env=", 15) == 0) keep_list = a + 15;
        else if (strcmp(a, "--login") == 0) login = 1;
        else if (strcmp(a, "--shell") == 0) shell = 1;
        else if (strcmp(a, "--non-interactive") == 0 || strcmp(a, "--stdin") == 0) {}
        else if (strncmp(a, "--prompt=", 9) == 0) {}
        else if (strcmp(a, "--prompt") == 0 && i + 1 < argc) i++;
        else if (a[1] == '-') {
            fprintf(stderr, "sudo: unknown option %s\n", a);
            usage(stderr);
            return 1;
        } else {
            for (const char *c = a + 1; *c; c++) {
                int takes = *c == 'u' || *c == 'p';
                const char *arg = takes ? (c[1] ? c + 1 : (i + 1 < argc ? argv[++i] : NULL)) : NULL;
                if (takes && !arg) {
                    fprintf(stderr, "sudo: option requires an argument -- '%c'\n", *c);
                    return 1;
                }
                switch (*c) {
                case 'E': preserve = 1; break;
                case 'i': login = 1; break;
                case 's': shell = 1; break;
                case 'v': validate = 1; break;
                case 'l': list = 1; break;
                case 'H': case 'n': case 'S': case 'k': case 'K': case 'p': break;
                case 'u': user = arg; break;
                case 'h': usage(stdout); return 0;
                case 'V': printf(VERSION_LINE); return 0;
                default:
                    fprintf(stderr, "sudo: invalid option -- '%c'\n", *c);
                    usage(stderr);
                    return 1;
                }
                if (takes) break; /* the rest of this word was its argument */
            }
        }
        if (user) runas = user;
    }
    int first_var = i;
    while (i < argc && assignment(argv[i])) i++;
    int nvars = i - first_var, nargs = argc - i;
    if (list) { /* what the broker would allow is only known by asking it */
        printf("(ALL) NOPASSWD: ALL, where " SUDO_USERS " names you\n");
        return 0;
    }
    if (nargs == 0 && !login && !shell) {
        if (validate || (argc == 2 && (strcmp(argv[1], "-k") == 0 || strcmp(argv[1], "-K") == 0)))
            return 0; /* no credentials are cached: nothing to validate or forget */
        usage(stderr);
        return 1;
    }

    /* Who to run as: a name, or #uid, in the image's /etc/passwd (root
     * needs no entry). Copied: getpw*'s answer is overwritten by the next
     * call. */
    char to_shell[PATH_MAX] = "/bin/sh", to_home[PATH_MAX] = "/root", to_name[64] = "root",
         me[64] = "?";
    uid_t to_uid = 0;
    struct passwd *pw = NULL;
    if (runas[0] == '#') {
        char *e = NULL;
        unsigned long u = strtoul(runas + 1, &e, 10);
        if (runas[1] && !*e) pw = getpwuid((uid_t)u);
    } else {
        pw = getpwnam(runas);
    }
    if (!pw && strcmp(runas, "root") != 0 && strcmp(runas, "#0") != 0) {
        fprintf(stderr, "sudo: unknown user %s\n", runas);
        return 1;
    }
    if (pw) {
        to_uid = pw->pw_uid;
        snprintf(to_name, sizeof to_name, "%s", pw->pw_name);
        if (pw->pw_shell[0]) snprintf(to_shell, sizeof to_shell, "%s", pw->pw_shell);
        if (pw->pw_dir[0]) snprintf(to_home, sizeof to_home, "%s", pw->pw_dir);
    }
    if ((pw = getpwuid(getuid()))) snprintf(me, sizeof me, "%s", pw->pw_name);

    /* The command: as given, or through the target's shell (-i) or the caller's (-s). */
    const char *via = login ? to_shell : (getenv("SHELL") ? getenv("SHELL") : to_shell);
    char **cmd = need(calloc((size_t)nargs + 5, sizeof *cmd));
    int cn = 0;
    if (login || shell) {
        cmd[cn++] = (char *)via;
        if (login) cmd[cn++] = "-l";
        if (nargs) {
            cmd[cn++] = "-c";
            cmd[cn++] = shell_words(argv + i, nargs);
        }
    } else {
        for (int k = i; k < argc; k++) cmd[cn++] = argv[k];
    }

    /* The environment, as sudo's env_reset leaves it (all of it with -E,
     * what --preserve-env= names), with the secure PATH, the target's HOME
     * and names, who asked, and the command line's own variables last. */
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **env = need(calloc(ne + (size_t)nvars + 16, sizeof *env));
    size_t en = 0;
    for (size_t k = 0; k < ne; k++) {
        int keep = preserve ? !replaced(environ[k])
                            : kept(environ[k]) || (keep_list && listed(environ[k], keep_list));
        if (keep) env[en++] = environ[k];
    }
    char *command = shell_words(cmd, cn);
    char extra[8][PATH_MAX + 16];
    snprintf(extra[0], sizeof extra[0], "SUDO_USER=%s", me);
    snprintf(extra[1], sizeof extra[1], "SUDO_UID=%u", (unsigned)getuid());
    snprintf(extra[2], sizeof extra[2], "SUDO_GID=%u", (unsigned)getgid());
    snprintf(extra[3], sizeof extra[3], "SHELL=%s", to_shell);
    snprintf(extra[4], sizeof extra[4], "HOME=%s", to_home);
    snprintf(extra[5], sizeof extra[5], "USER=%s", to_name);
    snprintf(extra[6], sizeof extra[6], "LOGNAME=%s", to_name);
    snprintf(extra[7], sizeof extra[7], "MAIL=/var/mail/%s", to_name);
    for (int k = 0; k < 8; k++) env[en++] = extra[k];
    size_t clen = strlen(command) + 14;
    env[en] = need(malloc(clen));
    snprintf(env[en++], clen, "SUDO_COMMAND=%s", command);
    env[en++] = "PATH=" SECURE_PATH;
    for (int k = 0; k < nvars; k++) env[en++] = argv[first_var + k];

    char cwd[PATH_MAX];
    if (login) snprintf(cwd, sizeof cwd, "%s", to_home);
    else if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "/");

    if (getuid() == 0 && to_uid == 0) { /* root already: nothing to ask for */
        if (chdir(cwd) < 0) {}
        environ = env;
        sigprocmask(SIG_SETMASK, &caller_mask, NULL);
        execvp(cmd[0], cmd);
        fprintf(stderr, "sudo: %s: %s\n", cmd[0], errno == ENOENT ? "command not found" : strerror(errno));
        return 1;
    }

    static char req[SUDO_REQ_MAX];
    size_t len = REQ_HEADER;
    /* Only in the terminal's foreground: a backgrounded sudo must not take
     * the keystrokes meant for the shell in front. */
    uint32_t head_words[3] = {(uint32_t)cn, (uint32_t)en,
                              isatty(0) && isatty(1) && tcgetpgrp(0) == getpgrp() ? REQ_TERMINAL : 0};
    memcpy(req, head_words, REQ_HEADER);
    char uid_text[16];
    snprintf(uid_text, sizeof uid_text, "%u", (unsigned)to_uid);
    char *head[2] = {uid_text, cwd};
    for (int pass = 0; pass < 3; pass++) {
        char **v = pass == 0 ? head : pass == 1 ? cmd : env;
        size_t count = pass == 0 ? 2 : pass == 1 ? (size_t)cn : en;
        for (size_t k = 0; k < count; k++) {
            size_t l = strlen(v[k]) + 1;
            if (len + l > sizeof req) {
                fprintf(stderr, "sudo: argument list too long\n");
                return 1;
            }
            memcpy(req + len, v[k], l);
            len += l;
        }
    }

    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", SUDO_SOCKET);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) < 0) {
        fprintf(stderr, "sudo: this sandbox has no sudo: its image names no sudo users (%s)\n",
                SUDO_USERS);
        return 1;
    }
    /* Only root's socket is the broker: anything else would take the
     * caller's descriptors and make up an answer. */
    struct ucred peer;
    socklen_t plen = sizeof peer;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &peer, &plen) < 0 || peer.uid != 0) {
        fprintf(stderr, "sudo: %s is not root's: refused\n", SUDO_SOCKET);
        return 1;
    }
    int fds[3] = {0, 1, 2};
    union fds_ctl ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {req, len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(h), fds, sizeof fds);
    if (sendmsg(s, &m, MSG_NOSIGNAL) < 0 && errno != EPIPE && errno != ECONNRESET) {
        fprintf(stderr, "sudo: sending the request: %s\n", strerror(errno));
        return 1;
    }
    /* Refused, the broker has answered and closed: its answer is read all the same. */
    return wait_answer(s);
}
