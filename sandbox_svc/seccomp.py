"""The seccomp filter a run's program starts under (bubblewrap's ``--seccomp FD``; docs/sandbox.md).

A deny list, as Docker's and Flatpak's default profiles keep: the syscalls an untrusted program has no
use for and that widen the kernel's attack surface (ptrace and cross-process memory, mounts, new
namespaces, kernel modules, kexec, bpf, perf, userfaultfd, keyrings, io_uring, handle-based opens,
the kernel log) answer ``EPERM``; ``clone`` with a namespace flag is refused the same way, and
``clone3`` answers ``ENOSYS`` (its flags are in memory a filter cannot read) so the C library falls
back to ``clone``. Any other architecture than the host's, and x32 syscall numbers, are refused too.

Written as classic BPF by hand: only x86-64's numbers are here, so ``program()`` is None elsewhere
and runs go without a filter (the namespaces and rlimits still hold; ``/v1/sandbox/health`` says so).
"""

from __future__ import annotations

import platform
import struct

_LD_W_ABS = 0x20
_JEQ = 0x15
_JGE = 0x35
_JSET = 0x45
_RET = 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_KILL_PROCESS = 0x80000000
_EPERM, _ENOSYS = 1, 38
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_CLONE_NAMESPACES = 0x7E020000

DENIED_X86_64 = {
    "ptrace": 101, "syslog": 103, "acct": 163, "mount": 165, "umount2": 166, "pivot_root": 155,
    "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
    "perf_event_open": 298, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320,
    "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442,
}  # fmt: skip
_CLONE, _CLONE3 = 56, 435


def _assemble(lines: list[tuple[int, str | None, str | None, int] | str]) -> bytes:
    """BPF from (code, jump-if-true label, jump-if-false label, k) lines and label strings."""
    at: dict[str, int] = {}
    insns: list[tuple[int, str | None, str | None, int]] = []
    for line in lines:
        if isinstance(line, str):
            at[line] = len(insns)
        else:
            insns.append(line)
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(insns):
        t = at[jt] - i - 1 if jt else 0
        f = at[jf] - i - 1 if jf else 0
        out += struct.pack("=HBBI", code, t, f, k)
    return bytes(out)


def program() -> bytes | None:
    """The filter for this host, or None where Loom has no syscall table for its architecture."""
    if platform.machine() != "x86_64":
        return None
    lines: list[tuple[int, str | None, str | None, int] | str] = [
        (_LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ, "arch_ok", None, _AUDIT_ARCH_X86_64),
        (_RET, None, None, _KILL_PROCESS),
        "arch_ok",
        (_LD_W_ABS, None, None, 0),  # seccomp_data.nr
        (_JGE, "eperm", None, _X32_BIT),
        (_JEQ, "enosys", None, _CLONE3),
        (_JEQ, "clone", None, _CLONE),
    ]
    lines += [(_JEQ, "eperm", None, nr) for nr in sorted(DENIED_X86_64.values())]
    lines += [
        (_RET, None, None, _ALLOW),
        "clone",
        (_LD_W_ABS, None, None, 16),  # args[0], the flags (low 32 bits)
        (_JSET, "eperm", None, _CLONE_NAMESPACES),
        (_RET, None, None, _ALLOW),
        "eperm",
        (_RET, None, None, _ERRNO | _EPERM),
        "enosys",
        (_RET, None, None, _ERRNO | _ENOSYS),
    ]
    return _assemble(lines)
