"""Publish a trainer's policy versions to Loom (``/v1/policies``, docs/interop-rollout.md).

    publisher = PolicyPublisher("http://gateway:8400", api_key)
    ref = publisher.publish_model(model, tokenizer)       # save_pretrained, hash, upload, commit
    job = {"...": ..., "policy_namespace": ref.namespace, "policy_version": ref.version}

Each file is hashed first (its size and sha256 are declared before any byte is sent), then sent in
parts below the services' body limit; the gateway checks each complete file against its sha256 and
the version appears only at the commit, whole. The key needs the ``policy`` scope.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from loom.clients.base import ServiceClient
from loom.contracts.policies import FILE_SUFFIXES, PolicyRef
from loom.store.manifest import file_hashes

PART_BYTES = 8 * 1024 * 1024  # one request's body: under LOOM_MAX_BODY_BYTES (16 MiB by default)


class PolicyPublisher(ServiceClient):
    def __init__(
        self, url: str, api_key: str, *, timeout: float = 600.0, part_bytes: int = PART_BYTES
    ) -> None:
        super().__init__(url, api_key=api_key, timeout=timeout, retries=0)  # a part is sent once
        self.part_bytes = part_bytes

    def publish_dir(
        self,
        path: str | Path,
        kind: Literal["full", "lora"] = "full",
        version: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> PolicyRef:
        """Publish the checkpoint (or adapter) files under ``path``: its safetensors, configs and
        tokenizer files (other files are not part of a version). ``version`` None: the next."""
        folder = Path(path)
        # the store's own hashing: what the gateway checks each arriving file against
        files = file_hashes(folder, keep=lambda rel: rel.endswith(FILE_SUFFIXES))
        if not files:
            raise ValueError(f"{folder} holds no checkpoint file ({', '.join(FILE_SUFFIXES)})")
        declared = {"kind": kind, "version": version, "files": files, "meta": meta or {}}
        ticket = self.post("/v1/policies/uploads", json=declared)
        upload = ticket["upload_id"]
        for f in files:
            self._send(upload, folder / f["path"], f["path"])
        return PolicyRef.model_validate(self.post(f"/v1/policies/uploads/{upload}/commit"))

    def publish_model(
        self,
        model: Any,
        tokenizer: Any = None,
        version: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> PolicyRef:
        """``model.save_pretrained`` (and the tokenizer's) into a temporary folder, then ``publish_dir``;
        a PEFT model saves its adapter, published as a LoRA version."""
        kind: Literal["full", "lora"] = "lora" if hasattr(model, "peft_config") else "full"
        with tempfile.TemporaryDirectory(prefix="loom-publish-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            return self.publish_dir(tmp, kind=kind, version=version, meta=meta)

    def versions(self) -> list[PolicyRef]:
        return [PolicyRef.model_validate(r) for r in self.get("/v1/policies")]

    def version(self, version: int) -> PolicyRef:
        return PolicyRef.model_validate(self.get(f"/v1/policies/{version}"))

    def _send(self, upload: str, source: Path, rel: str) -> None:
        size = source.stat().st_size
        offset = 0
        while True:
            n = min(self.part_bytes, size - offset)
            self.request(
                "PUT",
                f"/v1/policies/uploads/{upload}/files/{rel}",
                params={"offset": offset},
                content=_read(source, offset, n),
                headers={"Content-Type": "application/octet-stream", "Content-Length": str(n)},
            )
            offset += n
            if offset >= size:
                return


def _read(path: Path, offset: int, n: int) -> Iterator[bytes]:
    """``n`` bytes of ``path`` from ``offset``, streamed in 1 MiB chunks."""
    with open(path, "rb") as f:
        f.seek(offset)
        left = n
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
