/* What corral-init's parts share (corral-init.c, sudo.c). */
#ifndef CORRAL_INIT_H
#define CORRAL_INIT_H

#include <limits.h>
#include <sys/types.h>

/* Supplementary groups kept per user at most: the image's /etc/group can
 * list a user in any number; past this many the rest are left out. */
#define IDENT_GROUPS 64

struct ident {
    uid_t uid;
    gid_t gid;
    /* The primary gid first, then the groups /etc/group lists the user in. */
    gid_t groups[IDENT_GROUPS];
    int ngroups;
    char home[PATH_MAX];
};

void logmsg(const char *fmt, ...);
/* "root", "name", "1000" or "1000:1000" against the image's /etc/passwd,
 * and, unless a group is given, the user's other groups from its
 * /etc/group. */
int resolve_user(const char *spec, struct ident *id);
/* This process becomes `id` (groups, gid, uid): -1 on failure. */
int become(const struct ident *id);
/* Kill every process below this subreaper until none remain. */
void kill_tree(void);
/* A command's child: default signals, nothing masked, and the OOM killer's
 * choice over corral-init. */
void command_child_defaults(void);

#endif
