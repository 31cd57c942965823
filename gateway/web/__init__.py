"""The run page's templates (``templates/``), vendored static files (``static/``: uPlot, see its README)
and pure view builders (``views.py``); its routes are gateway/routes/web.py (docs/run-page.md)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
STATIC = Path(__file__).parent / "static"
