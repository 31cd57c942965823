"""A bench's recorded result (issue 29): ``docs/benchmarks/<name>.md`` with the date, the machine and
the command, the printed table, and a PNG plot beside it (matplotlib, a project dependency)."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def machine() -> str:
    """The machine in words: CPU model, cores, GPU if torch sees one, load average."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, load average {load} at the end of the run"


def write(
    name: str,
    title: str,
    table: list[str],
    notes: list[str] | None = None,
    plot: Callable[[Any], None] | None = None,
    out_dir: Path = DOCS,
    figsize: tuple[float, float] = (6.4, 4.0),
) -> Path:
    """Write ``<out_dir>/<name>.md`` (and ``<name>.png`` when ``plot`` draws on the matplotlib figure it
    is given: ``fig.subplots()`` for one panel)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{name}.md"
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join([f"python bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    lines = [f"# {title}", "", f"{now}; {machine()}.", "", f"Command: `{command}`", "", *table, ""]
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=figsize)
        plot(fig)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=110)
        plt.close(fig)
        lines += [f"![{title}]({name}.png)", ""]
    lines += notes or []
    md.write_text("\n".join(lines).rstrip() + "\n")
    return md
