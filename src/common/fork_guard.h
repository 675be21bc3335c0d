/*
 * Liveness sockets stay in the process that opened them (fork_guard.c): a
 * child forked without exec gets /dev/null in their place.
 */
#ifndef VMMT_FORK_GUARD_H
#define VMMT_FORK_GUARD_H

/* socket(2), guarded: no fork can copy it between its making and its guard. -1 and errno. */
int vmmt__guarded_socket(int domain, int type, int protocol);

/*
 * accept4(2), guarded, for a caller that reserved room (vmmt__guard_reserve)
 * and may not allocate (the broker thread). -1 and errno; EMFILE when the
 * reservation is used up.
 */
int vmmt__guarded_accept(int listen_fd, int flags);

/* Room for `count` more guarded accepts; VMMT_ENOMEM when none could be had. */
int vmmt__guard_reserve(int count);
void vmmt__guard_unreserve(int count);

/* Close a guarded socket and forget it. -1 is a no-op. */
void vmmt__guarded_close(int fd);

#endif
