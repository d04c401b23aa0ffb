/*
 * corral-watch: a directory's changes, as inotify reports them, on stdout.
 *
 * Run inside a sandbox (from the platform layer, /.corral/bin) as the user
 * who watches, by the node's E2B envd (api/compat/e2b/watch.py). It arms
 * its watches before it says so, then reports; with --recursive it watches
 * each directory below, and each new one the moment its creation is read.
 *
 * stdout, records ending in NUL (a path may hold any other byte):
 *   "R"                 armed: every change from here on is reported
 *   "E<mask hex>:<rel>" one event; rel is the path below the watched dir
 *   "S"                 the answer to a line on stdin: every event the
 *                       kernel had queued before that line was read is
 *                       above it (a caller's "all that happened so far")
 *   "O"                 the kernel's queue overflowed: events were lost
 * It exits when stdin closes, or when the watched directory goes away.
 *
 * usage: corral-watch [--recursive] DIR
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_WATCHES 8192
#define MASK (IN_CREATE | IN_MODIFY | IN_ATTRIB | IN_DELETE | IN_DELETE_SELF | IN_MOVED_FROM | \
              IN_MOVED_TO | IN_MOVE_SELF | IN_ONLYDIR)

static char *rel_of[MAX_WATCHES]; /* wd -> directory below the root ("" for the root) */
static int ifd, recursive, root_wd = -1;
static const char *root;

static void out(const char *rec) {
    fputs(rec, stdout);
    fputc(0, stdout);
}

static void add_tree(const char *rel, int late);

static void add(const char *rel) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s%s%s", root, *rel ? "/" : "", rel);
    int wd = inotify_add_watch(ifd, path, MASK);
    if (wd >= 0 && !*rel) root_wd = wd;
    if (wd < 0 || wd >= MAX_WATCHES) return;
    free(rel_of[wd]);
    rel_of[wd] = strdup(rel);
}

/* The directory and, when recursive, every directory below it. A `late`
 * one (created under a watched directory, watched only once its creation
 * was read) may already hold what was made in it meanwhile: each entry is
 * reported as created (and written, if it has content), so nothing made
 * after the watch began goes unseen. */
static void add_tree(const char *rel, int late) {
    add(rel);
    if (!recursive && !late) return;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s%s%s", root, *rel ? "/" : "", rel);
    DIR *d = opendir(path);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s%s%s", rel, *rel ? "/" : "", e->d_name);
        if (late) {
            char rec[PATH_MAX + 32];
            snprintf(rec, sizeof rec, "E%x:%s", IN_CREATE, sub);
            out(rec);
            if (S_ISREG(st.st_mode) && st.st_size > 0) {
                snprintf(rec, sizeof rec, "E%x:%s", IN_MODIFY, sub);
                out(rec);
            }
        }
        if (S_ISDIR(st.st_mode) && recursive) add_tree(sub, late);
    }
    closedir(d);
}

/* Read what the kernel has queued; 0 if the root went away. */
static int drain(void) {
    char buf[64 * 1024] __attribute__((aligned(__alignof__(struct inotify_event))));
    for (;;) {
        ssize_t n = read(ifd, buf, sizeof buf);
        if (n <= 0) return 1; /* EAGAIN: nothing more queued */
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)p;
            p += sizeof *ev + ev->len;
            if (ev->mask & IN_Q_OVERFLOW) {
                out("O");
                continue;
            }
            if (ev->wd < 0 || ev->wd >= MAX_WATCHES || !rel_of[ev->wd]) continue;
            const char *dir = rel_of[ev->wd];
            if (ev->mask & IN_IGNORED) {
                int was_root = !*dir;
                free(rel_of[ev->wd]);
                rel_of[ev->wd] = NULL;
                if (was_root) return 0;
                continue;
            }
            if (!ev->len && (ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF))) {
                if (!*dir) return 0; /* the watched directory itself */
                continue;            /* reported by its parent as a delete or move */
            }
            char rel[PATH_MAX], rec[PATH_MAX + 32];
            snprintf(rel, sizeof rel, "%s%s%s", dir, *dir && ev->len ? "/" : "", ev->len ? ev->name : "");
            snprintf(rec, sizeof rec, "E%x:%s", ev->mask & ~IN_ISDIR, rel);
            out(rec);
            if (recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)))
                add_tree(rel, 1);
        }
    }
}

int main(int argc, char **argv) {
    int i = 1;
    if (i < argc && !strcmp(argv[i], "--recursive")) {
        recursive = 1;
        i++;
    }
    if (i != argc - 1) {
        fprintf(stderr, "usage: corral-watch [--recursive] DIR\n");
        return 2;
    }
    root = argv[i];
    struct stat st;
    if (stat(root, &st) < 0) {
        fprintf(stderr, "corral-watch: %s: %s\n", root, strerror(errno));
        return errno == ENOENT ? 3 : 1;
    }
    if (!S_ISDIR(st.st_mode)) {
        fprintf(stderr, "corral-watch: %s: not a directory\n", root);
        return 4;
    }
    ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ifd < 0) {
        fprintf(stderr, "corral-watch: inotify: %s\n", strerror(errno));
        return 1;
    }
    add_tree("", 0);
    if (root_wd < 0) {
        fprintf(stderr, "corral-watch: %s: cannot watch it\n", root);
        return 1;
    }
    out("R");
    fflush(stdout);
    struct pollfd p[2] = {{ifd, POLLIN, 0}, {0, POLLIN, 0}};
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (p[0].revents && !drain()) break;
        if (p[1].revents) {
            char line[256];
            ssize_t n = read(0, line, sizeof line);
            if (n <= 0) break; /* stdin closed: the caller is done */
            if (!drain()) break;
            for (ssize_t k = 0; k < n; k++)
                if (line[k] == '\n') out("S");
        }
        fflush(stdout);
    }
    fflush(stdout);
    return 0;
}
