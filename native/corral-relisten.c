/*
 * corral-relisten: gives the tasks of a restored sandbox back a seccomp
 * listener.
 *
 * CRIU restores each task's seccomp filters, but without the listener that
 * crun asked for at create (SECCOMP_FILTER_FLAG_NEW_LISTENER): after a
 * restore, every syscall the guard notifies would fail with ENOSYS, never
 * reach corral-seccompd and never be counted. For each task named, this
 * helper stops it with ptrace, reads its newest filter
 * (PTRACE_SECCOMP_GET_FILTER: the guard's program, as CRIU restored it),
 * and makes the task itself stack that same program again with a new
 * listener: mmap a page, write the program there, seccomp(), munmap, each
 * run as a syscall injected at a `syscall` instruction of the task's vDSO.
 * The newest of equal filters takes the notification, so the new listener
 * gets them all. It takes the listener fd from the task (pidfd_getfd),
 * closes the task's copy, puts the task's registers back (an interrupted
 * syscall is set up to restart, as the kernel would have) and lets it go.
 * The listener goes to corral-seccompd over its socket with the sandbox id
 * as metadata, as crun sends it. Children forked later inherit the filter.
 *
 * A task it cannot handle (no filter, EBUSY: a listener already there) is
 * reported on stderr and keeps the restored filter alone (ENOSYS, fail
 * closed, as without this helper); a task that will not stop (an
 * uninterruptible sleep) makes it give up on all of them, for the same
 * result.
 *
 * usage: corral-relisten --socket PATH --id SANDBOX TASKS-FILE...
 * (the `tasks` or `cgroup.threads` file of the sandbox's cgroup and of
 * every cgroup below it). stdout: "<listeners> <tasks stopped>"; exit 0
 * when every task still alive got one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/user.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef __x86_64__
#error "corral-relisten drives x86_64 registers"
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
/* The kernel's restart codes (include/linux/errno.h, not exported). */
#define ERESTARTSYS 512
#define ERESTARTNOINTR 513
#define ERESTARTNOHAND 514
#define ERESTART_RESTARTBLOCK 516

struct task {
    pid_t tid;
    int stopped;     /* in a ptrace stop we made */
    int pending_sig; /* a signal we held back while it was stopped */
    struct user_regs_struct saved;
    unsigned long syscall_ip;
};

/* Wait for the next stop of t that is ours (syscall or event stop); a
 * signal that arrives meanwhile is held back and sent again after detach. */
static int wait_stop(struct task *t, int syscall_stop) {
    for (;;) {
        int st;
        if (waitpid(t->tid, &st, __WALL) != t->tid) return -1;
        if (!WIFSTOPPED(st)) return -1; /* exited or killed */
        int sig = WSTOPSIG(st), event = st >> 16;
        if (syscall_stop && sig == (SIGTRAP | 0x80)) return 0;
        if (!syscall_stop && event == PTRACE_EVENT_STOP) return 0;
        if (event == 0 && sig != (SIGTRAP | 0x80)) t->pending_sig = sig; /* signal-delivery-stop */
        /* Anything else: let it run on to the stop we wait for. */
        if (ptrace(syscall_stop ? PTRACE_SYSCALL : PTRACE_CONT, t->tid, 0, 0) < 0) return -1;
    }
}

/* Run one syscall in the task; its return value, or -1 with errno set
 * when the task could not be driven (the call's own errors come back as
 * negative values in *ret). */
static int inject(struct task *t, long nr, long a1, long a2, long a3, long a4, long a5, long a6,
                  long *ret) {
    struct user_regs_struct r = t->saved;
    r.rip = t->syscall_ip;
    r.rax = (unsigned long)nr;
    r.orig_rax = (unsigned long)-1; /* not in a syscall: nothing for the kernel to restart */
    r.rdi = (unsigned long)a1;
    r.rsi = (unsigned long)a2;
    r.rdx = (unsigned long)a3;
    r.r10 = (unsigned long)a4;
    r.r8 = (unsigned long)a5;
    r.r9 = (unsigned long)a6;
    if (ptrace(PTRACE_SETREGS, t->tid, 0, &r) < 0) return -1;
    for (int stop = 0; stop < 2; stop++) { /* syscall entry, then exit */
        if (ptrace(PTRACE_SYSCALL, t->tid, 0, 0) < 0) return -1;
        if (wait_stop(t, 1) < 0) return -1;
    }
    if (ptrace(PTRACE_GETREGS, t->tid, 0, &r) < 0) return -1;
    *ret = (long)r.rax;
    return 0;
}

/* A `syscall` instruction (0f 05) in the task's vDSO: mapped in every
 * task, static binaries too, and never written by the sandbox. */
static unsigned long find_syscall_ip(pid_t tid) {
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", tid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    unsigned long lo = 0, hi = 0;
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "[vdso]") && sscanf(line, "%lx-%lx", &lo, &hi) == 2) break;
        lo = hi = 0;
    }
    fclose(f);
    if (!lo || hi - lo > (1 << 16)) return 0;
    size_t len = hi - lo;
    unsigned char *buf = malloc(len);
    if (!buf) return 0;
    struct iovec local = {buf, len}, remote = {(void *)lo, len};
    unsigned long ip = 0;
    if (process_vm_readv(tid, &local, 1, &remote, 1, 0) == (ssize_t)len) {
        for (size_t i = 0; i + 1 < len; i++)
            if (buf[i] == 0x0f && buf[i + 1] == 0x05) {
                ip = lo + i;
                break;
            }
    }
    free(buf);
    return ip;
}

static pid_t tgid_of(pid_t tid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", tid);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    pid_t tgid = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Tgid: %d", &tgid) == 1) break;
    fclose(f);
    return tgid;
}

/* The registers the task must go on with: an interrupted syscall set up to
 * restart, as the kernel would on its way back (we return it to user mode
 * from the exit of an injected call, where the kernel restarts nothing). */
static struct user_regs_struct resumed(struct user_regs_struct r) {
    if ((long)r.orig_rax < 0) return r;
    long err = -(long)r.rax;
    if (err == ERESTARTSYS || err == ERESTARTNOINTR || err == ERESTARTNOHAND) {
        r.rax = r.orig_rax;
        r.rip -= 2;
    } else if (err == ERESTART_RESTARTBLOCK) {
        r.rax = SYS_restart_syscall;
        r.rip -= 2;
    }
    return r;
}

static int send_listener(const char *sock_path, const char *id, int fd) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", sock_path);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) < 0) {
        if (s >= 0) close(s);
        return -1;
    }
    char msg[256];
    int n = snprintf(msg, sizeof msg, "{\"metadata\": \"%s\"}", id);
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {msg, (size_t)n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    int r = sendmsg(s, &mh, MSG_NOSIGNAL) == n ? 0 : -1;
    close(s);
    return r;
}

/* The listener for one stopped task: stack its newest filter again with
 * a new listener, in the task, and take the fd; -1 and *why if not. */
static int take_listener(struct task *t, const char **why) {
    pid_t tid = t->tid;
    *why = "no syscall instruction in its vDSO";
    if (!(t->syscall_ip = find_syscall_ip(tid))) return -1;
    long n = ptrace(PTRACE_SECCOMP_GET_FILTER, tid, 0, NULL);
    *why = "no seccomp filter";
    if (n <= 0 || n > BPF_MAXINSNS) return -1;
    struct sock_filter *prog = calloc((size_t)n, sizeof *prog);
    *why = "reading its filter";
    if (!prog || ptrace(PTRACE_SECCOMP_GET_FILTER, tid, 0, prog) != n) {
        free(prog);
        return -1;
    }
    size_t need = sizeof(struct sock_fprog) + (size_t)n * sizeof *prog;
    long size = (long)((need + 4095) & ~4095ul), addr = 0, fd = -1, ret = 0;
    *why = "mmap in the task";
    if (inject(t, SYS_mmap, 0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0,
               &addr) < 0 || (addr < 0 && addr > -4096)) {
        if (addr < 0) errno = (int)-addr;
        free(prog);
        return -1;
    }
    struct sock_fprog fprog = {.len = (unsigned short)n,
                               .filter = (struct sock_filter *)(addr + sizeof(struct sock_fprog))};
    struct iovec local[2] = {{&fprog, sizeof fprog}, {prog, (size_t)n * sizeof *prog}};
    struct iovec remote = {(void *)addr, need};
    ssize_t wrote = process_vm_writev(tid, local, 2, &remote, 1, 0);
    free(prog);
    *why = "writing the filter into the task";
    if (wrote == (ssize_t)need) {
        *why = "seccomp in the task";
        if (inject(t, SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, addr,
                   0, 0, 0, &fd) < 0)
            return -1;
    }
    int err = fd < 0 ? (int)-fd : 0;
    if (inject(t, SYS_munmap, addr, size, 0, 0, 0, 0, &ret) < 0) return -1;
    if (fd < 0) {
        errno = err ? err : EIO;
        return -1;
    }
    *why = "taking its listener";
    int listener = -1, pidfd = (int)syscall(SYS_pidfd_open, tgid_of(tid), 0);
    if (pidfd >= 0) {
        listener = (int)syscall(SYS_pidfd_getfd, pidfd, (int)fd, 0);
        close(pidfd);
    }
    int saved_errno = errno;
    if (inject(t, SYS_close, fd, 0, 0, 0, 0, 0, &ret) < 0 && listener >= 0) {
        close(listener); /* the task keeps a copy we could not close: do not use it */
        *why = "closing the task's copy of the listener";
        return -1;
    }
    errno = saved_errno;
    return listener;
}

/* Registers back (an interrupted syscall set up to restart), detach, and
 * the signal held back sent again. */
static void release(struct task *t) {
    struct user_regs_struct back = resumed(t->saved);
    ptrace(PTRACE_SETREGS, t->tid, 0, &back);
    ptrace(PTRACE_DETACH, t->tid, 0, 0);
    /* A detach from a syscall stop may drop a signal given to it. */
    if (t->pending_sig) syscall(SYS_tgkill, tgid_of(t->tid), t->tid, t->pending_sig);
}

static volatile sig_atomic_t timed_out;
static void on_alarm(int sig) {
    (void)sig;
    timed_out = 1;
}

#define MAX_TASKS 65536
static struct task tasks[MAX_TASKS];
static int ntasks;

static int seized(pid_t tid) {
    for (int i = 0; i < ntasks; i++)
        if (tasks[i].tid == tid) return 1;
    return 0;
}

/* Seize and interrupt every task listed in the cgroup files, again until
 * no new one turns up (a task forks only while it runs); the number of
 * new ones seen in the last round, or -1 if a file could not be read. */
static int seize_round(char **files, int nfiles) {
    int fresh = 0;
    for (int f = 0; f < nfiles; f++) {
        FILE *fp = fopen(files[f], "re");
        if (!fp) continue; /* a nested cgroup removed meanwhile */
        int tid;
        while (fscanf(fp, "%d", &tid) == 1) {
            if (tid <= 1 || seized(tid) || ntasks >= MAX_TASKS) continue;
            if (ptrace(PTRACE_SEIZE, tid, 0, PTRACE_O_TRACESYSGOOD) < 0) {
                if (errno == ESRCH) continue; /* gone */
                fprintf(stderr, "corral-relisten: %d: seize: %s\n", tid, strerror(errno));
                fclose(fp);
                return -1;
            }
            tasks[ntasks++] = (struct task){.tid = tid};
            ptrace(PTRACE_INTERRUPT, tid, 0, 0);
            fresh++;
        }
        fclose(fp);
    }
    return fresh;
}

int main(int argc, char **argv) {
    const char *sock_path = NULL, *id = NULL;
    int i = 1;
    for (; i + 1 < argc && argv[i][0] == '-'; i += 2) {
        if (!strcmp(argv[i], "--socket")) sock_path = argv[i + 1];
        else if (!strcmp(argv[i], "--id")) id = argv[i + 1];
    }
    if (!sock_path || !id || !*id || strlen(id) > 48 || strpbrk(id, "\"\\") || i >= argc) {
        fprintf(stderr, "usage: corral-relisten --socket PATH --id SANDBOX TASKS-FILE...\n");
        return 2;
    }
    char **files = argv + i;
    int nfiles = argc - i;
    struct sigaction sa = {.sa_handler = on_alarm}; /* no SA_RESTART: waitpid gets EINTR */
    sigaction(SIGALRM, &sa, NULL);

    /* Stop the world first: a listener lands in the task's fd table, which
     * its other threads (or a process sharing the table) could dup and
     * answer themselves (CONTINUE) before we close it. So no task of the
     * sandbox runs until every listener is out of every table. */
    int fresh, rounds = 0, ok = 1;
    while ((fresh = seize_round(files, nfiles)) > 0 && ++rounds < 64) {}
    if (fresh != 0) {
        fprintf(stderr, "corral-relisten: the sandbox's tasks kept changing (or one could not be seized)\n");
        ok = 0;
    }
    int stopped = 0;
    for (int k = 0; k < ntasks; k++) {
        timed_out = 0;
        alarm(2);
        int r = wait_stop(&tasks[k], 0);
        alarm(0);
        if (r == 0) {
            tasks[k].stopped = 1;
            stopped++;
            if (ptrace(PTRACE_GETREGS, tasks[k].tid, 0, &tasks[k].saved) < 0) ok = 0;
        } else if (timed_out) {
            /* Uninterruptible (a vfork parent, a blocked read): it may run
             * again while we work. Give up on all of them (fail closed). */
            fprintf(stderr, "corral-relisten: %d: did not stop within 2 s\n", tasks[k].tid);
            ok = 0;
        } /* else: it exited */
    }
    int listeners[MAX_TASKS > 4096 ? 4096 : MAX_TASKS];
    int nlisteners = 0, failed = 0;
    for (int k = 0; ok && k < ntasks; k++) {
        if (!tasks[k].stopped) continue;
        const char *why = "";
        int fd = take_listener(&tasks[k], &why);
        if (fd >= 0 && nlisteners < (int)(sizeof listeners / sizeof *listeners)) {
            listeners[nlisteners++] = fd;
        } else {
            if (fd >= 0) close(fd);
            if (kill(tasks[k].tid, 0) == 0) {
                fprintf(stderr, "corral-relisten: %d: %s: %s\n", tasks[k].tid, why, strerror(errno));
                failed++;
            }
        }
    }
    for (int k = 0; k < ntasks; k++)
        if (tasks[k].stopped) release(&tasks[k]);
    /* Tasks that never stopped are detached when we exit. */
    for (int k = 0; k < nlisteners; k++) {
        if (send_listener(sock_path, id, listeners[k]) < 0) {
            fprintf(stderr, "corral-relisten: seccompd: %s\n", strerror(errno));
            failed++;
        }
        close(listeners[k]);
    }
    printf("%d %d\n", nlisteners, stopped);
    return ok && !failed ? 0 : 1;
}
