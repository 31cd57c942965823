"""The one shape of every error answer of every Loom service (loom.service, docs/security.md): its own
module, so that what builds apps (loom.service) and what guards routes (loom.service_token) both
name it without importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Problem(BaseModel):
    """One problem with a request: where (``loc``: ``body``/``query``/``path`` then the field path),
    what (``msg``) and its kind (``type``)."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    """Every error answer of every Loom service. Some kinds carry more fields (e.g. ``limit`` and
    ``requested`` on a quota refusal, ``queue_depth`` on backpressure)."""

    model_config = ConfigDict(extra="allow")
    error: str = Field(description="the kind: validation_error, unauthenticated, rate_limited, ...")
    detail: str | list[Problem] = Field(description="what went wrong: a sentence, or the problems found")
