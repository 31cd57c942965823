"""``python -m launch ARGS`` is the ``loom`` command."""

from launch.cli import main

raise SystemExit(main())
