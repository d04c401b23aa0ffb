/* What corral-init's parts share (corral-init.c, sudo.c). */
#ifndef CORRAL_INIT_H
#define CORRAL_INIT_H

#include <limits.h>
#include <sys/types.h>

struct ident {
    uid_t uid;
    gid_t gid;
    char home[PATH_MAX];
};

void logmsg(const char *fmt, ...);
/* "root", "name", "1000" or "1000:1000" against the image's /etc/passwd. */
int resolve_user(const char *spec, struct ident *id);
/* This process becomes `id` (groups, gid, uid): -1 on failure. */
int become(const struct ident *id);
/* Kill every process below this subreaper until none remain. */
void kill_tree(void);
/* A command's child: default signals, nothing masked, and the OOM killer's
 * choice over corral-init. */
void command_child_defaults(void);

#endif
