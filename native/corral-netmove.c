/*
 * corral-netmove: ends a copied sandbox's TCP connections to the outside.
 *
 * A fork's copy (or a sandbox restored on another node) holds every socket
 * of the moment it was saved, those to the outside included, but it wakes
 * up with an address of its own: the source's connections are not its to
 * keep, and the host drops what it sends from the source's address (the
 * host end filters by source). Left alone, each such connection would hang
 * until TCP gives up (~15 min). This helper aborts them at once, as the
 * kernel's SOCK_DESTROY does (`ss -K`): the program sees ECONNABORTED on
 * its next call, as if its peer had gone. It must run while the copy has
 * no route out (before its new interface is up, or with it down), so that
 * the reset the kernel sends for each never leaves: the peer's connection
 * is the source's, still live.
 *
 * Kept: listening sockets, and connections whose local address is loopback
 * (127/8, ::1, ::ffff:127/104): those are the copy's own, between its own
 * processes, and were copied whole.
 *
 * usage: corral-netmove [--netns-of PID]
 * With --netns-of, in that process's network namespace (the host's root
 * acting on a container's); without, in its own (a VM guest's root).
 * stdout: "<aborted> <kept>"; exit 0, or 1 with the reason on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* The copy's connections are those of one sandbox: a bound keeps a hostile
 * one that opened millions from growing this helper without end; the rest
 * are aborted by the next run (it is idempotent). */
#define MAX_SOCKETS 65536

/* Every TCP state but LISTEN and CLOSE (a closed socket has no peer). */
#define STATES (((1u << 12) - 1) & ~(1u << TCP_LISTEN) & ~(1u << TCP_CLOSE))

struct found {
    uint8_t family;
    struct inet_diag_sockid id;
};

static int is_loopback(uint8_t family, const uint32_t src[4])
{
    const uint8_t *b = (const uint8_t *)src;
    if (family == AF_INET)
        return b[0] == 127;
    static const uint8_t v6_loop[16] = {[15] = 1};
    static const uint8_t v4_mapped[12] = {[10] = 0xff, [11] = 0xff};
    if (memcmp(b, v6_loop, 16) == 0)
        return 1;
    return memcmp(b, v4_mapped, 12) == 0 && b[12] == 127;
}

static int request(int fd, uint16_t type, uint16_t flags, uint8_t family,
                   const struct inet_diag_sockid *id)
{
    struct {
        struct nlmsghdr nh;
        struct inet_diag_req_v2 req;
    } msg;
    memset(&msg, 0, sizeof msg);
    msg.nh.nlmsg_len = sizeof msg;
    msg.nh.nlmsg_type = type;
    msg.nh.nlmsg_flags = NLM_F_REQUEST | flags;
    msg.req.sdiag_family = family;
    msg.req.sdiag_protocol = IPPROTO_TCP;
    msg.req.idiag_states = STATES;
    if (id != NULL)
        msg.req.id = *id;
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    return sendto(fd, &msg, sizeof msg, 0, (struct sockaddr *)&kernel, sizeof kernel) < 0 ? -1 : 0;
}

/* Appends this family's non-loopback connections to `out`; counts the
 * loopback ones in `kept`. -1 with errno on a netlink failure. */
static int list(int fd, uint8_t family, struct found *out, size_t *n, size_t *kept)
{
    if (request(fd, SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, family, NULL) < 0)
        return -1;
    static char buf[1 << 16];
    for (;;) {
        ssize_t len = recv(fd, buf, sizeof buf, 0);
        if (len < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        for (struct nlmsghdr *h = (struct nlmsghdr *)buf; NLMSG_OK(h, (size_t)len);
             h = NLMSG_NEXT(h, len)) {
            if (h->nlmsg_type == NLMSG_DONE)
                return 0;
            if (h->nlmsg_type == NLMSG_ERROR) {
                struct nlmsgerr *e = NLMSG_DATA(h);
                errno = -e->error;
                return -1;
            }
            struct inet_diag_msg *m = NLMSG_DATA(h);
            if (is_loopback(m->idiag_family, m->id.idiag_src)) {
                (*kept)++;
            } else if (*n < MAX_SOCKETS) {
                out[*n].family = m->idiag_family;
                out[*n].id = m->id;
                (*n)++;
            }
        }
    }
}

/* 0, or the kernel's errno for this one (ENOENT: it closed meanwhile). */
static int destroy(int fd, const struct found *s)
{
    if (request(fd, SOCK_DESTROY, NLM_F_ACK, s->family, &s->id) < 0)
        return errno;
    char buf[256];
    for (;;) {
        ssize_t len = recv(fd, buf, sizeof buf, 0);
        if (len < 0 && errno == EINTR)
            continue;
        if (len < 0)
            return errno;
        struct nlmsghdr *h = (struct nlmsghdr *)buf;
        if (NLMSG_OK(h, (size_t)len) && h->nlmsg_type == NLMSG_ERROR)
            return -((struct nlmsgerr *)NLMSG_DATA(h))->error;
        return EPROTO;
    }
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--netns-of") == 0) {
        char *end;
        long pid = strtol(argv[2], &end, 10);
        if (*argv[2] == '\0' || *end != '\0' || pid <= 0) {
            fprintf(stderr, "corral-netmove: --netns-of: not a pid: %s\n", argv[2]);
            return 2;
        }
        char path[64];
        snprintf(path, sizeof path, "/proc/%ld/ns/net", pid);
        int ns = open(path, O_RDONLY | O_CLOEXEC);
        if (ns < 0 || setns(ns, CLONE_NEWNET) < 0) {
            fprintf(stderr, "corral-netmove: %s: %s\n", path, strerror(errno));
            return 1;
        }
        close(ns);
    } else if (argc != 1) {
        fprintf(stderr, "usage: corral-netmove [--netns-of PID]\n");
        return 2;
    }
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (fd < 0) {
        fprintf(stderr, "corral-netmove: sock_diag: %s\n", strerror(errno));
        return 1;
    }
    struct found *found = calloc(MAX_SOCKETS, sizeof *found);
    if (found == NULL) {
        fprintf(stderr, "corral-netmove: out of memory\n");
        return 1;
    }
    size_t n = 0, kept = 0;
    if (list(fd, AF_INET, found, &n, &kept) < 0 || list(fd, AF_INET6, found, &n, &kept) < 0) {
        fprintf(stderr, "corral-netmove: listing sockets: %s\n", strerror(errno));
        return 1;
    }
    size_t aborted = 0;
    for (size_t i = 0; i < n; i++) {
        int err = destroy(fd, &found[i]);
        if (err == 0) {
            aborted++;
        } else if (err != ENOENT) {
            /* EOPNOTSUPP: a kernel without CONFIG_INET_DIAG_DESTROY. */
            fprintf(stderr, "corral-netmove: aborting a connection: %s\n", strerror(err));
            return 1;
        }
    }
    printf("%zu %zu\n", aborted, kept);
    return 0;
}
