/*
 * corral-seccompd: answers and counts the syscalls sandboxes are refused.
 *
 * Every container sandbox runs under a seccomp filter whose refusals are
 * user notifications (SECCOMP_RET_USER_NOTIF). crun hands each sandbox's
 * notification fd to this daemon over a unix socket (the OCI
 * `listenerPath`), with the sandbox id as metadata (after a CRIU restore,
 * corral-relisten hands one per restored task the same way: they share
 * the sandbox's counters and AIO budget). For every notification
 * the daemon answers with the errno the policy file gives for the syscall
 * (EPERM for privileged ones, ENOSYS otherwise) and adds one to the
 * sandbox's counter for that syscall in <audit-dir>/<id>.seccomp (made
 * by its first count): up to 1024 little-endian u64, index = syscall
 * number (x86_64), 1023 = other arches.
 * A 32-bit call (int 0x80, or the x32 ABI) is answered and counted as its
 * x86_64 twin: the policy file maps each i386 number to the x86_64 number
 * of the syscall with the same name, so `mount` through int 0x80 is a
 * refused privileged `mount`, not an anonymous "other".
 *
 * One process per node, apart from the node agent, so counting survives
 * agent restarts. It never executes, reads or trusts anything from a
 * sandbox beyond the notification structure the kernel fills.
 *
 * A sandbox that floods refused syscalls only slows itself: past a budget
 * per second its fd is not polled for a while, and its threads wait.
 *
 * io_setup is the one call the daemon lets through (the filter notifies
 * it, the daemon answers CONTINUE): the kernel's AIO event count is one
 * host-wide pool (fs.aio-max-nr) with no per-user share, so each sandbox
 * gets a budget of events for its life (--aio-events), and a call past it
 * is refused with EAGAIN and counted, as the pool itself would refuse.
 *
 * usage: corral-seccompd --listen PATH --audit-dir DIR --policy FILE --lock FILE
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 1024
#define OTHER_ARCH (SLOTS - 1)
#define MAX_SANDBOXES 65536
#define BUDGET_PER_SEC 2000
#define MUTE_MS 100

struct sandbox {
    int notify_fd;
    char id[64]; /* its counts are in <audit_root>/<id>.seccomp */
    long budget;
    long long window_start_ms;
    long long muted_until_ms;
    unsigned long long aio_events; /* granted to io_setup over its life */
};

#define I386_SLOTS 512
#define X32_BIT 0x40000000
#define NR_IO_SETUP 206
static unsigned long long aio_budget = 65536;

static int errno_for[SLOTS];
static int twin_of_i386[I386_SLOTS]; /* x86_64 number, or -1 */
static struct sandbox *boxes;
static int nboxes;
static volatile sig_atomic_t stop;

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_term(int sig) {
    (void)sig;
    stop = 1;
}

static int valid_id(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 48) return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '-')) return 0;
    return 1;
}

/* The sandbox id from crun's state message: "metadata": "<id>". */
static int metadata(const char *msg, char *out, size_t outlen) {
    const char *p = strstr(msg, "\"metadata\"");
    if (!p) return -1;
    p = strchr(p + 10, '"');
    if (!p) return -1;
    p++;
    const char *q = strchr(p, '"');
    if (!q || (size_t)(q - p) >= outlen) return -1;
    memcpy(out, p, (size_t)(q - p));
    out[q - p] = 0;
    return valid_id(out) ? 0 : -1;
}

static const char *audit_root; /* --audit-dir */

static void adopt(int conn) {
    char buf[16384];
    char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {buf, sizeof buf - 1};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct timeval tv = {2, 0};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ssize_t n = recvmsg(conn, &mh, MSG_CMSG_CLOEXEC);
    if (n <= 0) return;
    buf[n] = 0;
    int fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *fds = (int *)CMSG_DATA(c);
            for (int i = 0; i < nfds; i++) {
                if (fd < 0) fd = fds[i];
                else close(fds[i]);
            }
        }
    }
    if (fd < 0) return;
    struct sandbox sb = {.notify_fd = fd, .budget = BUDGET_PER_SEC};
    if (metadata(buf, sb.id, sizeof sb.id) < 0 || nboxes >= MAX_SANDBOXES) {
        fprintf(stderr, "corral-seccompd: refusing a listener with bad metadata\n");
        close(fd);
        return;
    }
    sb.window_start_ms = now_ms();
    boxes[nboxes++] = sb;
}

/* Refused calls are rare (and muted past a budget): opening the counts
 * file for each costs less than a descriptor held per sandbox (this
 * daemon's open files, the host's hard RLIMIT_NOFILE, would stop a node at
 * half the sandboxes). The file is made by the first count, not at adopt:
 * most sandboxes are refused nothing, and a file each would be an inode
 * made and removed on the data disk per sandbox (ext4 without a journal
 * walks past every recently freed one: docs/container-runtime.md). It
 * grows to the highest slot counted; what is past its end reads as 0. A
 * count that races the close (after the node folded and removed the file)
 * makes it again: the node's gc folds and removes such a file. */
static void count(struct sandbox *sb, int slot) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s.seccomp", audit_root, sb->id);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return;
    uint64_t v = 0;
    off_t off = (off_t)slot * 8;
    if (pread(fd, &v, 8, off) != 8) v = 0;
    v++;
    if (pwrite(fd, &v, 8, off) != 8) {}
    close(fd);
}

/* AIO events granted to the sandbox: a restored one has a listener per
 * task (corral-relisten), all drawing on one budget. */
static unsigned long long aio_granted(const struct sandbox *sb) {
    unsigned long long sum = 0;
    for (int i = 0; i < nboxes; i++)
        if (!strcmp(boxes[i].id, sb->id)) sum += boxes[i].aio_events;
    return sum;
}

/* Handle one notification; 0 if the fd is still good. */
static int answer(struct sandbox *sb) {
    struct seccomp_notif req;
    memset(&req, 0, sizeof req);
    if (ioctl(sb->notify_fd, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0) {
        if (errno == EINTR || errno == ENOENT) return 0; /* target died meanwhile */
        return -1;
    }
    int slot = OTHER_ARCH;
    int err = ENOSYS;
    int nr = req.data.nr;
    if (req.data.arch == AUDIT_ARCH_X86_64 && (nr & X32_BIT)) nr &= ~X32_BIT; /* x32: same numbers below 512 */
    else if (req.data.arch == AUDIT_ARCH_I386) nr = (nr >= 0 && nr < I386_SLOTS) ? twin_of_i386[nr] : -1;
    else if (req.data.arch != AUDIT_ARCH_X86_64) nr = -1;
    if (nr >= 0 && nr < OTHER_ARCH) {
        slot = nr;
        err = errno_for[slot];
    }
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = req.id;
    resp.error = -err;
    if (slot == NR_IO_SETUP) {
        /* The kernel reads nr_events as an unsigned int: charge that. (It
         * reserves about twice as many in the pool; the node sizes the
         * pool, fs.aio-max-nr, for that.) */
        unsigned long long want = (uint32_t)req.data.args[0];
        if (aio_granted(sb) + want <= aio_budget) {
            sb->aio_events += want;
            resp.error = 0;
            resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
            if (ioctl(sb->notify_fd, SECCOMP_IOCTL_NOTIF_SEND, &resp) < 0 && errno != ENOENT) {}
            return 0; /* granted: not a refusal, not counted */
        }
        resp.error = -EAGAIN;
    }
    if (ioctl(sb->notify_fd, SECCOMP_IOCTL_NOTIF_SEND, &resp) < 0 && errno != ENOENT) {}
    count(sb, slot);
    return 0;
}

static void drop(int i) {
    close(boxes[i].notify_fd);
    boxes[i] = boxes[--nboxes];
}

int main(int argc, char **argv) {
    const char *listen_path = NULL, *audit_dir = NULL, *policy = NULL, *lock = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--listen")) listen_path = argv[i + 1];
        else if (!strcmp(argv[i], "--audit-dir")) audit_dir = argv[i + 1];
        else if (!strcmp(argv[i], "--policy")) policy = argv[i + 1];
        else if (!strcmp(argv[i], "--lock")) lock = argv[i + 1];
    }
    if (!listen_path || !audit_dir || !policy || !lock) {
        fprintf(stderr, "usage: corral-seccompd --listen PATH --audit-dir DIR --policy FILE --lock FILE\n");
        return 2;
    }
    int lfd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lfd < 0 || flock(lfd, LOCK_EX | LOCK_NB) < 0) {
        fprintf(stderr, "corral-seccompd: another instance serves this node\n");
        return 1;
    }
    char pid[32];
    int plen = snprintf(pid, sizeof pid, "%d", getpid());
    if (ftruncate(lfd, 0) < 0 || pwrite(lfd, pid, (size_t)plen, 0) < 0) {}

    for (int i = 0; i < SLOTS; i++) errno_for[i] = ENOSYS;
    for (int i = 0; i < I386_SLOTS; i++) twin_of_i386[i] = -1;
    FILE *pf = fopen(policy, "re");
    if (!pf) {
        perror("corral-seccompd: policy");
        return 1;
    }
    /* Lines: "<nr> <errno>" for x86_64, "i386 <nr32> <nr64>" for the twins,
     * "aio <events>" for each sandbox's budget of AIO events. */
    char line[128];
    while (fgets(line, sizeof line, pf)) {
        int a, b;
        unsigned long long events;
        if (sscanf(line, "aio %llu", &events) == 1) {
            aio_budget = events;
        } else if (sscanf(line, "i386 %d %d", &a, &b) == 2) {
            if (a >= 0 && a < I386_SLOTS && b >= 0 && b < OTHER_ARCH) twin_of_i386[a] = b;
        } else if (sscanf(line, "%d %d", &a, &b) == 2) {
            if (a >= 0 && a < OTHER_ARCH) errno_for[a] = b;
        }
    }
    fclose(pf);
    mkdir(audit_dir, 0700);
    audit_root = audit_dir;
    /* One descriptor per sandbox's listener: the soft limit a login shell
     * hands down (1,024 on a stock Debian) would stop the node at ~1,000
     * containers, so take the hard one. The agent reads the result from
     * /proc/<pid>/limits and admits no more containers than it allows. */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < nofile.rlim_max) {
        nofile.rlim_cur = nofile.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &nofile) < 0) perror("corral-seccompd: RLIMIT_NOFILE");
    }

    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", listen_path);
    unlink(listen_path);
    if (sock < 0 || bind(sock, (struct sockaddr *)&a, sizeof a) < 0 || listen(sock, 256) < 0) {
        perror("corral-seccompd: listen");
        return 1;
    }
    chmod(listen_path, 0600);
    boxes = calloc(MAX_SANDBOXES, sizeof *boxes);
    struct pollfd *pfds = calloc(MAX_SANDBOXES + 1, sizeof *pfds);
    int *idx = calloc(MAX_SANDBOXES + 1, sizeof *idx);
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    fprintf(stderr, "corral-seccompd[%d]: listening on %s\n", getpid(), listen_path);

    while (!stop) {
        int n = 0;
        long long now = now_ms();
        int timeout = -1;
        pfds[n] = (struct pollfd){sock, POLLIN, 0};
        idx[n++] = -1;
        for (int i = 0; i < nboxes; i++) {
            struct sandbox *sb = &boxes[i];
            if (now - sb->window_start_ms >= 1000) {
                sb->window_start_ms = now;
                sb->budget = BUDGET_PER_SEC;
            }
            if (sb->muted_until_ms > now) {
                int left = (int)(sb->muted_until_ms - now);
                if (timeout < 0 || left < timeout) timeout = left;
                continue;
            }
            pfds[n] = (struct pollfd){sb->notify_fd, POLLIN, 0};
            idx[n++] = i;
        }
        if (poll(pfds, (nfds_t)n, timeout) < 0) {
            if (errno == EINTR) continue;
            perror("corral-seccompd: poll");
            return 1;
        }
        /* Walk backwards so that drop() (which moves the last box into a
         * freed slot) never skips or repeats an entry seen in this round. */
        for (int k = n - 1; k >= 1; k--) {
            int i = idx[k];
            if (!pfds[k].revents) continue;
            struct sandbox *sb = &boxes[i];
            if (pfds[k].revents & POLLIN) {
                if (answer(sb) < 0) {
                    drop(i);
                    continue;
                }
                if (--sb->budget <= 0) sb->muted_until_ms = now_ms() + MUTE_MS;
            } else if (pfds[k].revents & (POLLHUP | POLLERR | POLLNVAL)) {
                drop(i); /* every process of the sandbox is gone */
            }
        }
        if (pfds[0].revents & POLLIN) {
            int conn = accept4(sock, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0) {
                adopt(conn);
                close(conn);
            }
        }
    }
    unlink(listen_path);
    return 0;
}
