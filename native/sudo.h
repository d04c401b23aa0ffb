/*
 * sudo for the users an image names, with no setuid bit (docs/sudo.md).
 *
 * The guard sets no_new_privs on every sandbox process, so a setuid sudo
 * can never raise privileges. Instead corral-init (root in the sandbox)
 * runs a broker on the socket SUDO_SOCKET when the image's SUDO_USERS names
 * users; `sudo` (corral-init called by that name) sends the broker its
 * argv, environment, working directory and stdin/stdout/stderr, and the
 * broker runs the command as root (or the user the caller names) with those,
 * and answers its wait status.
 *
 * Invariants:
 *  - Who asks is the kernel's word (SO_PEERCRED), never the request's.
 *  - No SUDO_USERS, or no user in it: no socket, nothing listens.
 *  - The command ends when its caller does: the broker kills its process
 *    group once the connection closes (a timeout or kill of the calling
 *    command reaches the root one too).
 */
#ifndef CORRAL_SUDO_H
#define CORRAL_SUDO_H

#include <sys/types.h>

#define SUDO_SOCKET "/run/corral-sudo"
#define SUDO_USERS "/etc/corral/sudo"

/* The broker's listener (non-blocking, close-on-exec), or -1 where the
 * image names no sudo user. `uid_of` resolves a name as the exec server does. */
int sudo_listen(int (*uid_of)(const char *name, uid_t *uid));
/* Stop listening (before a checkpoint: init execs itself afterwards and
 * listens again). */
void sudo_close(int fd);
/* Whether the peer of a connection accepted from the listener may sudo. */
int sudo_allowed(int conn);
/* A handler's whole life: one request, its command, its answer. */
void sudo_serve(int conn);
/* `sudo ...` on the caller's side. */
int sudo_main(int argc, char **argv);

#endif
