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
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "init.h"

extern char **environ;

/* A request: u32 argc, u32 envc, then cwd, argv and env, each NUL-ended,
 * in one datagram, with the caller's fds 0, 1 and 2. */
#define SUDO_REQ_MAX (128 * 1024)
#define SUDO_USERS_MAX 64
#define SUDO_FILE_MAX (64 * 1024)
#define SECURE_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
/* Answers: 'S' then the command's i32 wait status, or 'E' then why not. */
#define ANSWER_STATUS 'S'
#define ANSWER_REFUSED 'E'

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
        if (n_sudoers < SUDO_USERS_MAX) sudoers[n_sudoers++] = uid;
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

void sudo_serve(int conn) {
    char *buf = malloc(SUDO_REQ_MAX);
    char ctl[CMSG_SPACE(3 * sizeof(int))];
    struct iovec iov = {buf, SUDO_REQ_MAX};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
    struct pollfd first = {conn, POLLIN, 0};
    if (!buf || poll(&first, 1, 10000) != 1) return;
    ssize_t n = recvmsg(conn, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    struct cmsghdr *h = n > 0 ? CMSG_FIRSTHDR(&m) : NULL;
    if (!h || h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS ||
        h->cmsg_len != CMSG_LEN(3 * sizeof(int)) || (m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || n < 9) {
        refuse(conn, "malformed request");
        return;
    }
    int fds[3];
    memcpy(fds, CMSG_DATA(h), sizeof fds);
    uint32_t argc, envc;
    memcpy(&argc, buf, 4);
    memcpy(&envc, buf + 4, 4);
    char *at = buf + 8, *end = buf + n;
    char **cwd = strings(&at, end, 1);
    char **argv = cwd ? strings(&at, end, argc) : NULL;
    char **env = argv ? strings(&at, end, envc) : NULL;
    if (!env || argc == 0) {
        refuse(conn, "malformed request");
        return;
    }

    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    pid_t pid = fork();
    if (pid < 0) {
        refuse(conn, "fork failed");
        return;
    }
    if (pid == 0) {
        setsid();
        for (int i = 0; i < 3; i++) dup2(fds[i], i);
        syscall(SYS_close_range, 3, ~0U, 0);
        command_child_defaults();
        struct ident root = {.uid = 0, .gid = 0, .home = "/root"};
        if (become(&root) < 0) {
            dprintf(2, "sudo: becoming root: %s\n", strerror(errno));
            _exit(1);
        }
        if (chdir(cwd[0]) < 0) {
            dprintf(2, "sudo: unable to change directory to %s: %s\n", cwd[0], strerror(errno));
            _exit(1);
        }
        environ = env;
        execvp(argv[0], argv);
        if (errno == ENOENT) dprintf(2, "sudo: %s: command not found\n", argv[0]);
        else dprintf(2, "sudo: %s: %s\n", argv[0], strerror(errno));
        _exit(1);
    }
    for (int i = 0; i < 3; i++) close(fds[i]);

    /* SIGCHLD is blocked here, as in PID 1 this was forked from. */
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    for (;;) {
        struct pollfd p[2] = {{conn, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) break;
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            int32_t s = status;
            answer(conn, ANSWER_STATUS, &s, sizeof s);
            return;
        }
        if (p[0].revents) break; /* the caller is gone (or spoke out of turn) */
        struct signalfd_siginfo si;
        while (read(sfd, &si, sizeof si) > 0) {}
    }
    kill_tree();
}

/* ------------------------------------------------------------- the caller */

static void usage(FILE *to) {
    fprintf(to,
            "usage: sudo [-EHknS] [-u root] [-i | -s] [--] [command [arg ...]]\n"
            "Runs the command as root: this sandbox's image names the users who may\n"
            "(" SUDO_USERS "). There is no password and no sudoers file.\n");
}

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

int sudo_main(int argc, char **argv) {
    int preserve = 0, login = 0, shell = 0, i = 1;
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
            printf("sudo (Corral's, for sandboxes under no_new_privs)\n");
            return 0;
        }
        const char *user = NULL;
        if (strncmp(a, "--user=", 7) == 0) user = a + 7;
        else if (strcmp(a, "--preserve-env") == 0) preserve = 1;
        else if (strcmp(a, "--login") == 0) login = 1;
        else if (strcmp(a, "--shell") == 0) shell = 1;
        else if (strcmp(a, "--non-interactive") == 0) {}
        else if (a[1] == '-') {
            fprintf(stderr, "sudo: unknown option %s\n", a);
            usage(stderr);
            return 1;
        } else {
            for (const char *c = a + 1; *c && !user; c++) {
                switch (*c) {
                case 'E': preserve = 1; break;
                case 'i': login = 1; break;
                case 's': shell = 1; break;
                case 'H': case 'n': case 'S': case 'k': case 'K': break;
                case 'h': usage(stdout); return 0;
                case 'V': printf("sudo (Corral's, for sandboxes under no_new_privs)\n"); return 0;
                case 'u':
                    user = c[1] ? c + 1 : (i + 1 < argc ? argv[++i] : NULL);
                    if (!user) {
                        fprintf(stderr, "sudo: option requires an argument -- 'u'\n");
                        return 1;
                    }
                    break;
                default:
                    fprintf(stderr, "sudo: invalid option -- '%c'\n", *c);
                    usage(stderr);
                    return 1;
                }
            }
        }
        if (user && strcmp(user, "root") != 0 && strcmp(user, "0") != 0 && strcmp(user, "#0") != 0) {
            fprintf(stderr, "sudo: this sandbox's sudo runs commands as root only, not as %s\n", user);
            return 1;
        }
    }
    int nargs = argc - i;
    if (nargs == 0 && !login && !shell) {
        if (argc > 1) return 0; /* -k, -K: nothing is cached to forget */
        usage(stderr);
        return 1;
    }

    /* The command: as given, or through root's shell (-i) or the caller's (-s). */
    /* Copied: getpwuid's answer is overwritten by the next call. */
    char root_shell[PATH_MAX] = "/bin/sh", root_home[PATH_MAX] = "/root", me[64] = "?";
    struct passwd *pw = getpwuid(0);
    if (pw && pw->pw_shell[0]) snprintf(root_shell, sizeof root_shell, "%s", pw->pw_shell);
    if (pw && pw->pw_dir[0]) snprintf(root_home, sizeof root_home, "%s", pw->pw_dir);
    if ((pw = getpwuid(getuid()))) snprintf(me, sizeof me, "%s", pw->pw_name);
    const char *via = login ? root_shell : (getenv("SHELL") ? getenv("SHELL") : root_shell);
    char **cmd = calloc((size_t)nargs + 4, sizeof *cmd);
    int cn = 0;
    if (login || shell) {
        cmd[cn++] = (char *)via;
        if (login) cmd[cn++] = "-l";
        if (nargs) {
            size_t len = 1;
            for (int k = i; k < argc; k++) len += strlen(argv[k]) + 1;
            char *joined = calloc(len, 1);
            for (int k = i; k < argc; k++) {
                if (k > i) strcat(joined, " ");
                strcat(joined, argv[k]);
            }
            cmd[cn++] = "-c";
            cmd[cn++] = joined;
        }
    } else {
        for (int k = i; k < argc; k++) cmd[cn++] = argv[k];
    }

    /* The environment, as sudo's env_reset leaves it (all of it with -E),
     * with root's PATH, HOME and names, and who asked. */
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **env = calloc(ne + 16, sizeof *env);
    size_t en = 0;
    for (size_t k = 0; k < ne; k++)
        if ((preserve && !replaced(environ[k])) || (!preserve && kept(environ[k]))) env[en++] = environ[k];
    char extra[6][300];
    snprintf(extra[0], sizeof extra[0], "SUDO_USER=%s", me);
    snprintf(extra[1], sizeof extra[1], "SUDO_UID=%u", (unsigned)getuid());
    snprintf(extra[2], sizeof extra[2], "SUDO_GID=%u", (unsigned)getgid());
    snprintf(extra[3], sizeof extra[3], "SUDO_COMMAND=%s", cmd[0]);
    snprintf(extra[4], sizeof extra[4], "SHELL=%s", root_shell);
    snprintf(extra[5], sizeof extra[5], "HOME=%s", root_home);
    for (int k = 0; k < 6; k++) env[en++] = extra[k];
    env[en++] = "PATH=" SECURE_PATH;
    env[en++] = "USER=root";
    env[en++] = "LOGNAME=root";
    env[en++] = "MAIL=/var/mail/root";

    char cwd[PATH_MAX];
    if (login) snprintf(cwd, sizeof cwd, "%s", root_home);
    else if (!getcwd(cwd, sizeof cwd)) strcpy(cwd, "/");

    if (getuid() == 0) { /* root already: nothing to ask for */
        if (chdir(cwd) < 0) {}
        environ = env;
        execvp(cmd[0], cmd);
        fprintf(stderr, "sudo: %s: %s\n", cmd[0], errno == ENOENT ? "command not found" : strerror(errno));
        return 1;
    }

    static char req[SUDO_REQ_MAX];
    size_t len = 8;
    uint32_t counts[2] = {(uint32_t)cn, (uint32_t)en};
    memcpy(req, counts, 8);
    const char *parts[2 + 1] = {cwd, NULL, NULL};
    for (int pass = 0; pass < 3; pass++) {
        char **v = pass == 0 ? (char **)parts : pass == 1 ? cmd : env;
        size_t count = pass == 0 ? 1 : pass == 1 ? (size_t)cn : en;
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
    int fds[3] = {0, 1, 2};
    char ctl[CMSG_SPACE(sizeof fds)];
    memset(ctl, 0, sizeof ctl);
    struct iovec iov = {req, len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl};
    struct cmsghdr *h = CMSG_FIRSTHDR(&m);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(h), fds, sizeof fds);
    /* Refused, the broker has answered and closed: its answer is read all the same. */
    int sent = sendmsg(s, &m, MSG_NOSIGNAL) >= 0;
    char ans[512];
    ssize_t n;
    int resets = 0; /* a reset is reported once, before what is queued */
    do n = recv(s, ans, sizeof ans - 1, sent ? 0 : MSG_DONTWAIT);
    while (n < 0 && (errno == EINTR || (errno == ECONNRESET && resets++ == 0)));
    if (n == 5 && ans[0] == ANSWER_STATUS) {
        int32_t status;
        memcpy(&status, ans + 1, 4);
        if (WIFSIGNALED(status)) { /* as the caller's shell would have seen it */
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
    fprintf(stderr, "sudo: you may not run sudo in this sandbox\n");
    return 1;
}
