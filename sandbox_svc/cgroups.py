"""One cgroup per runner slot, where the host lets this process make one (docs/sandbox.md "Limits").

cgroup v2 (``/sys/fs/cgroup/cgroup.controllers``) or v1 (``memory`` and ``pids`` hierarchies) under
this process's own group; when neither is writable the slot has none and the rlimits alone bound a
run (``Slot.cgroup is None``). A slot's group is made once (warm) and reused: between runs its
counters are reset and every process left in it is killed.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str:
    """This process's group in ``controller`` ('' for v2's unified line)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    return "/"


def _write(path: Path, value: str) -> None:
    path.write_text(value)


@dataclass
class SlotGroup:
    """A slot's cgroup: ``dirs`` holds one directory (v2) or one per controller (v1)."""

    version: int
    dirs: dict[str, Path]

    def set_limits(self, memory_bytes: int, pids: int) -> None:
        if self.version == 2:
            d = self.dirs["unified"]
            _write(d / "memory.max", str(memory_bytes))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(pids))
        else:
            mem = self.dirs["memory"]
            _write(mem / "memory.limit_in_bytes", str(memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():
                try:
                    _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
                except OSError:  # swap accounting off: the memory limit alone
                    pass
            _write(self.dirs["pids"] / "pids.max", str(pids))

    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def join_self(self) -> None:
        """Move the calling process into the group (a runner's child, before it execs bwrap)."""
        pid = str(os.getpid())
        for f in self.procs_files():
            _write(f, pid)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files():
            try:
                out.update(int(p) for p in f.read_text().split())
            except OSError:
                pass
        return out

    def kill_all(self) -> None:
        """SIGKILL every process in the group (v2's ``cgroup.kill`` at once; v1 by pid, repeated
        while new ones appear: a fork bomb forks between the read and the kill)."""
        if self.version == 2 and (self.dirs["unified"] / "cgroup.kill").exists():
            try:
                _write(self.dirs["unified"] / "cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def reset(self) -> None:
        """Zero the counters a run's outcome reads (``memory_hit``)."""
        if self.version == 1:
            for name in ("memory.failcnt", "memory.max_usage_in_bytes", "memory.memsw.failcnt"):
                try:
                    _write(self.dirs["memory"] / name, "0")
                except OSError:
                    pass
        self._events0 = self._oom_events()

    def _oom_events(self) -> int:
        if self.version != 2:
            return 0
        try:
            for line in (self.dirs["unified"] / "memory.events").read_text().splitlines():
                key, value = line.split()
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def cpu_s(self) -> float | None:
        """CPU seconds the group's processes used since it was made (None: not accounted)."""
        try:
            if self.version == 2:
                for line in (self.dirs["unified"] / "cpu.stat").read_text().splitlines():
                    key, value = line.split()
                    if key == "usage_usec":
                        return int(value) / 1e6
                return None
            if "cpuacct" in self.dirs:
                return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except OSError:
            pass
        return None

    def memory_hit(self) -> bool:
        """Did the last run reach its memory limit?"""
        if self.version == 2:
            return self._oom_events() > getattr(self, "_events0", 0)
        try:
            return int((self.dirs["memory"] / "memory.failcnt").read_text()) > 0
        except OSError:
            return False

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            try:
                d.rmdir()
            except OSError:
                pass


def _parents() -> list[Path]:
    """The directories this process's slot groups are made in, per hierarchy."""
    if (ROOT / "cgroup.controllers").exists():
        return [ROOT / _own_path("").lstrip("/")]
    return [ROOT / c / _own_path(c).lstrip("/") for c in ("memory", "pids", "cpuacct") if (ROOT / c).is_dir()]


def sweep_stale(prefix: str = "loom-sandbox-") -> int:
    """Remove the slot groups left by sandbox processes that are gone (killed before their pool
    closed): group names carry their process's pid (``<prefix><pid>-...``), and a group whose pid is
    not a live process of this pid namespace is stale. Its processes, if any outlived it, are killed
    first. Returns how many groups were removed."""
    removed = 0
    for parent in _parents():
        try:
            children = [d for d in parent.iterdir() if d.is_dir() and d.name.startswith(prefix)]
        except OSError:
            continue
        for d in children:
            pid = d.name[len(prefix) :].split("-", 1)[0]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            v2 = (ROOT / "cgroup.controllers").exists()
            group = SlotGroup(2, {"unified": d}) if v2 else SlotGroup(1, {parent.name: d})
            group.kill_all()
            try:
                d.rmdir()
                removed += 1
            except OSError:
                pass
    return removed


def make_group(name: str) -> SlotGroup | None:
    """A fresh group ``name`` under this process's own, or None where the host does not allow one."""
    try:
        if (ROOT / "cgroup.controllers").exists():
            base = ROOT / _own_path("").lstrip("/")
            d = base / name
            d.mkdir(parents=True, exist_ok=True)
            group = SlotGroup(2, {"unified": d})
        elif (ROOT / "memory").is_dir() and (ROOT / "pids").is_dir():
            dirs = {}
            ctrls = ("memory", "pids", "cpuacct") if (ROOT / "cpuacct").is_dir() else ("memory", "pids")
            for ctrl in ctrls:
                d = ROOT / ctrl / _own_path(ctrl).lstrip("/") / name
                d.mkdir(parents=True, exist_ok=True)
                dirs[ctrl] = d
            group = SlotGroup(1, dirs)
        else:
            return None
        group.reset()
        return group
    except OSError:
        return None
