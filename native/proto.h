/*
 * Wire format between the node agent (host) and corral-init (in the sandbox).
 * Mirrored by src/corral/execd/protocol.py; the two must change together
 * (tests/unit/test_execd_protocol.py checks the constants match).
 *
 * Every message is a frame: u32 payload length, u32 stream id, u8 type,
 * then the payload, all little-endian. A container sandbox uses one
 * connection per request and stream id 0; the stream id exists so that a VM
 * guest, which has a single serial channel, can multiplex the same frames.
 */
#ifndef CORRAL_PROTO_H
#define CORRAL_PROTO_H

#include <stdint.h>

#define CORRAL_PROTO_VERSION 1
#define FRAME_HEADER 9
#define FRAME_MAX_PAYLOAD (1u << 20)

/* agent -> sandbox: the first frame on a connection names the request */
enum {
    REQ_PING = 0x01,
    REQ_EXEC = 0x10,
    REQ_STDIN = 0x11,     /* on an exec connection: bytes for the child's stdin */
    REQ_STDIN_EOF = 0x12, /* on an exec connection: close the child's stdin */
    REQ_SIGNAL = 0x13,    /* on an exec connection: u32 signal for the command */
    REQ_RESIZE = 0x14,    /* on a PTY exec connection: u32 rows, u32 cols */
    REQ_READ = 0x20,
    REQ_WRITE = 0x21,     /* followed by REQ_DATA frames and REQ_END */
    REQ_LIST = 0x22,
    REQ_STAT = 0x23,
    REQ_MKDIR = 0x24,
    REQ_REMOVE = 0x25,
    REQ_KILL = 0x26,      /* u32 pid, u32 signal: for a command whose connection is gone */
    REQ_RESET = 0x27,     /* strv dirs: kill every process, empty the dirs, drop SysV IPC */
    /* 16 hex chars: before a checkpoint, PID 1 swaps its listener (a socket
     * of the host's network namespace, which CRIU cannot dump) for a memfd
     * named corral-ctl-<nonce> and waits on the abstract socket
     * @corral-park-<nonce> for a peer outside its pid namespace (the node)
     * to hand it a listener, or none to keep the one a restore put in
     * place of the memfd; it then execs itself again. */
    REQ_PARK = 0x28,
    REQ_XATTR = 0x2A,     /* user, path, string prefix to clear, u32 n, n x (name, value) */
    REQ_RESEED = 0x29,    /* 32..512 bytes: credit them to the kernel's pool and re-key its CRNG */
    REQ_SETTIME = 0x2B,   /* u64 ns since the epoch: set the kernel's wall clock (a VM's guest) */
    REQ_DATA = 0x30,
    REQ_END = 0x31,
};

/* sandbox -> agent */
enum {
    RSP_PONG = 0x81,
    RSP_STARTED = 0x82,   /* u32 pid */
    RSP_STDOUT = 0x83,
    RSP_STDERR = 0x84,
    RSP_EXIT = 0x85,      /* see send_exit() */
    RSP_DATA = 0x86,
    RSP_OK = 0x87,
    RSP_ERROR = 0x88,     /* i32 errno, u32 stage (ERR_*), then a message */
    RSP_ENTRY = 0x89,     /* u8 type, u32 mode, u64 size, i64 mtime_ns, name (older inits) */
    RSP_ENTRY2 = 0x8A,    /* as RSP_ENTRY, then u32 uid, u32 gid, string name, string link target,
                           * u32 n, n x (string name, string value): its user.* xattrs */
};

/* On a VM's serial channel only (stream id != 0): either side ends its
 * direction of a stream; the stream is gone once both have. */
#define FRAME_CLOSE 0x7F

/* RSP_ERROR stages: where a request failed */
#define ERR_GENERIC 0u
#define ERR_USER 1u   /* the user does not exist or cannot be switched to */
#define ERR_CWD 2u    /* the working directory cannot be entered */
#define ERR_EXEC 3u   /* the program cannot be executed */
#define ERR_PARKED 4u /* (EAGAIN) the listener was parked with this connection queued on it:
                       * nothing of the request ran; send it again once the change that
                       * parked it has ended (REQ_PARK) */

/* REQ_EXEC flags */
#define EXEC_STDIN_STREAM 0x1u  /* REQ_STDIN frames follow; otherwise stdin is /dev/null */
#define EXEC_PTY 0x2u           /* a terminal: u32 rows, u32 cols follow env; stdio is its slave,
                                 * output comes as RSP_STDOUT, input as REQ_STDIN */
#define EXEC_IDLE 0x4u          /* background CPU class: the command runs at SCHED_IDLE (its
                                 * children inherit it; it cannot leave it without CAP_SYS_NICE) */

/* REQ_WRITE / REQ_MKDIR / REQ_REMOVE flags */
#define FILE_MKDIRS 0x1u
#define FILE_APPEND 0x2u
/* Follow no symbolic link anywhere in the path (openat2 RESOLVE_NO_SYMLINKS):
 * the platform acting for a trainer never writes through a link an agent
 * planted. */
#define FILE_NOFOLLOW 0x4u
#define FILE_RECURSIVE 0x4u

#endif
