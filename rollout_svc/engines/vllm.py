"""The vllm engine: a client of a vLLM 0.32 OpenAI-compatible server (docs/vllm.md).

Generation: ``POST /v1/completions`` with ``prompt`` as a list of token ids, ``n``, ``max_tokens``,
``temperature`` (vLLM refuses > 2), ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
``logprobs`` (top-k; 0 = the sampled token only), ``return_token_ids`` and
``return_tokens_as_token_ids`` (top-k keys read ``token_id:<id>``). Each choice has ``token_ids``,
``logprobs.token_logprobs``, ``finish_reason`` and ``stop_reason``. A choice that ends ``abort`` was
cut by a policy update (``/pause?mode=abort``): the request is sent again, on the new weights.

Log-probs: raw or processed (temperature, top-k, top-p applied) by the server's
``--logprobs-mode``; there is no per-request switch. The client reads the mode from the server
(``/server_info``) and reports it as ``logprobs_kind``, so trajectories say what they carry.

Policy updates (dev mode, ``VLLM_SERVER_DEV_MODE=1``), a full checkpoint:
``POST /pause?mode=wait`` (in-flight requests finish on the old weights; ``mode=abort`` cuts them and
they are sent again) -> ``POST /collective_rpc {"method": "loom_reload_weights", "kwargs":
{"weights_path": ...}}`` (``vllm_worker``: check, vLLM's own ``reload_weights``, re-tie the head; a
refused or failed load leaves the old weights served and is ``PolicyLoadError``) ->
``POST /reset_prefix_cache`` (must answer ``{"success": true}``) -> ``POST /update_weight_version``
(a label naming the policy-store record) -> ``POST /resume`` (always, also after a failure).
A LoRA adapter (of the base model, as the torch engine merges it: when the server holds a full
version, the served model's own checkpoint is reloaded first): ``POST /v1/load_lora_adapter``
(answers plain text) under a name unique to the version, requests name it, the adapters beyond the
newest ``lora_keep`` are unloaded (``/v1/unload_lora_adapter``); no other dev-mode route is needed (a
new adapter name is a new prefix-cache namespace).

The server's version is never assumed: before the first request (and after a connection failure, or
after ``resync_s`` without a request, which a restarted server cannot hide behind) the client reads
``/weight_info``. A label it can verify against the policy store is adopted; vLLM's ``"default"`` is
the served model, version 0; anything else is reloaded: the policy this client loaded last, else
the served model's own checkpoint.

No custom position ids or attention masks: a ``Layout`` is refused with ``UnsupportedCapability``.
Connection errors and 5xx are retried with exponential backoff; every request has a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Literal

import httpx

from loom.contracts.wire import PolicyVersion, SamplingParams
from loom.store.checks import LoraBaseRefused, check_lora_base
from loom.store.layout import NAMESPACES
from rollout_svc.engines.base import (
    Completion,
    Engine,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    Layout,
    PolicyLoadError,
    UnsupportedCapability,
)
from rollout_svc.engines.vllm_worker import RELOAD_METHOD

log = logging.getLogger("loom.rollout.vllm")

VLLM_VERSION = "0.32.0"
PauseMode = Literal["wait", "abort"]
BASE_LABEL = "default"  # vLLM's weight version before anyone sets one: the served model
DEV_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 (docs/vllm.md)"
LORA_HINT = "start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (docs/vllm.md)"
EXTENSION_HINT = (
    "start vLLM with --worker-extension-cls rollout_svc.engines.vllm_worker.LoomWorkerExtension and "
    "Loom's repository on PYTHONPATH (docs/vllm.md)"
)


class Refused(EngineRequestError):
    """The server answered 4xx (or a deterministic 5xx): ``status`` and vLLM's error message."""

    def __init__(self, message: str, status: int, route_missing: bool = False) -> None:
        self.status = status
        self.route_missing = route_missing  # 404 for the route itself (dev mode / LoRA updating off)
        super().__init__(message)

    def __reduce__(self) -> tuple[type[Refused], tuple[str, int, bool]]:
        return type(self), (str(self), self.status, self.route_missing)


def completion_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "logprobs": params.logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    # the logits processors, under vLLM's own names, only where set (their defaults are vLLM's)
    defaults = SamplingParams()
    for name in PROCESSOR_FIELDS:
        if getattr(params, name) != getattr(defaults, name):
            body[name] = getattr(params, name)
    return body


PROCESSOR_FIELDS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "allowed_token_ids",
)


def parse_choice(choice: dict[str, Any]) -> Completion:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise EngineRequestError("server returned no token_ids: it needs vLLM >= 0.10.2 (return_token_ids)")
    lp = choice.get("logprobs") or {}
    token_lps = lp.get("token_logprobs")
    if token_lps is None or len(token_lps) != len(token_ids):
        raise EngineRequestError("server returned no per-token log-probs for every token")
    top = None
    if lp.get("top_logprobs") is not None:
        top = [
            {int(k.removeprefix("token_id:")): float(v) for k, v in (d or {}).items()}
            for d in lp["top_logprobs"]
        ]
    finish = choice.get("finish_reason") or "stop"
    return Completion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) if x is not None else 0.0 for x in token_lps],
        finish_reason="length" if finish == "length" else "stop",
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
    )


def weight_label(policy: PolicyVersion) -> str:
    """The ``/update_weight_version`` label of a policy: its version, path and publication time, so
    a later client can tell this record from another store's version of the same number."""
    return json.dumps(
        {"loom_policy_version": policy.version, "path": str(policy.path), "created_at": policy.created_at},
        separators=(",", ":"),
    )


def lora_name(policy: PolicyVersion) -> str:
    """The served name of a LoRA policy: unique to the record (version, path, publication time), so
    an adapter name never stands for two different weights (and their prefix-cache entries)."""
    digest = hashlib.sha1(f"{policy.path}\0{policy.created_at}".encode()).hexdigest()[:8]
    return f"loom-policy-v{policy.version}-{digest}"


def _message(r: httpx.Response) -> str:
    """vLLM's error message (``{"error": {"message": ...}}``), else FastAPI's ``detail``, else text."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in body:
            return str(body["detail"])
    return r.text[:500]


def _route_missing(r: httpx.Response) -> bool:
    """A 404 for the route itself (FastAPI's ``{"detail": "Not Found"}``), not for a resource."""
    if r.status_code != 404:
        return False
    try:
        return r.json() == {"detail": "Not Found"}
    except ValueError:
        return False


class VLLMEngine(Engine):
    name = "vllm"
    capabilities = frozenset({"prefix_cache", "lora"})

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 0.2,
        api_key: str | None = None,
        logprobs_mode: Literal["raw", "processed"] = "raw",
        policy_store: str | Path | None = None,
        pause_mode: PauseMode = "wait",
        lora_keep: int = 2,
        resync_s: float = 5.0,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.model = model  # the name requests use: the served model, or the current LoRA adapter
        self.retries = retries
        self.backoff = backoff
        self.logprobs_kind = logprobs_mode  # until the server says which it returns
        self.policy_store = Path(policy_store) if policy_store is not None else None
        self.pause_mode: PauseMode = pause_mode
        self.lora_keep = max(1, lora_keep)
        self.resync_s = resync_s
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers=headers,
        )
        self._base_name: str | None = None  # the served (base) model's name and checkpoint path
        self._base_path: str | None = None
        self._max_model_len: int | None = None
        self._policy: PolicyVersion | None = None  # the policy this client loaded last
        self._adapters: list[str] = []  # LoRA adapters this client loaded, oldest first
        self._synced = False
        self._last_ok = 0.0  # monotonic time of the last successful request
        self._locks: dict[int, asyncio.Lock] = {}

    # ---------------------------------------------------------------------------------- transport
    def _lock(self) -> asyncio.Lock:
        """One policy-update lock per event loop (asyncio locks belong to one loop)."""
        loop = asyncio.get_running_loop()
        lock = self._locks.get(id(loop))
        if lock is None:
            lock = self._locks[id(loop)] = asyncio.Lock()
        return lock

    async def _request(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
        text: bool = False,
        retry_5xx: bool = True,
    ) -> Any:
        """Send one request; the JSON answer (``text``: the body as text; None for an empty body).

        4xx (and 5xx with ``retry_5xx=False``) is ``Refused``; connection errors and 5xx are retried
        with backoff, then ``EngineUnavailable``. A kept-alive connection the server has closed (vLLM
        drops it after a 500) is retried at once, outside the budget: the request never reached it.
        """
        delay = self.backoff
        closed_retry = True
        attempt = 0
        last = ""
        while True:
            kwargs: dict[str, Any] = {"json": json, "params": params}
            if timeout is not None:
                kwargs["timeout"] = timeout
            try:
                r = await self.http.request(method, path, **kwargs)
            except httpx.TimeoutException as exc:
                self._synced = False
                raise EngineTimeout(f"{method} {self.base_url}{path} timed out: {exc!r}") from exc
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
                if closed_retry:
                    closed_retry = False
                    continue
                last = f"{type(exc).__name__}: {exc}"
                self._synced = False
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                self._synced = False  # the server may come back as another process: check again
            else:
                if r.status_code < 500 or not retry_5xx:
                    return self._answer(r, method, path, text)
                last = f"HTTP {r.status_code}: {_message(r)[:200]}"
                self._synced = False
            if attempt >= self.retries:
                break
            attempt += 1
            log.warning(
                "engine %s%s failed (%s); retry %d in %.2fs", self.base_url, path, last, attempt, delay
            )
            await asyncio.sleep(delay)
            delay *= 2
        raise EngineUnavailable(f"{method} {self.base_url}{path} failed after {attempt + 1} tries: {last}")

    def _answer(self, r: httpx.Response, method: str, path: str, text: bool) -> Any:
        """A final answer: the body of a success (``text``: as text; None if empty), else ``Refused``."""
        if r.status_code >= 400:
            raise Refused(
                f"{method} {path} -> HTTP {r.status_code}: {_message(r)}", r.status_code, _route_missing(r)
            )
        self._last_ok = time.monotonic()
        if text:
            return r.text
        return r.json() if r.content else None

    async def _dev(self, method: str, path: str, json: Any = None, **kw: Any) -> Any:
        """A dev-mode route: a missing route is a clear error naming the flag."""
        try:
            return await self._request(method, path, json, **kw)
        except Refused as exc:
            if exc.route_missing:
                raise EngineRequestError(f"the server has no {path}: {DEV_HINT}") from exc
            raise

    # ------------------------------------------------------------------------------- server state
    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    async def model_name(self) -> str:
        await self._discover()
        assert self.model is not None
        return self.model

    async def _discover(self) -> None:
        """The served model's name, checkpoint and context (``/v1/models``) and the log-prob mode
        (``/server_info``, dev mode); once."""
        if self._base_name is not None:
            return
        models = await self._request("GET", "/v1/models")
        cards = models.get("data") or []
        base = next((c for c in cards if not c.get("parent")), None)
        if base is None:
            raise EngineRequestError(f"{self.base_url}/v1/models lists no base model: {cards}")
        self._base_path = str(base.get("root") or base["id"])
        self._max_model_len = int(base["max_model_len"]) if base.get("max_model_len") else None
        if self.model is None:
            self.model = str(base["id"])
        self._base_name = str(base["id"])
        try:
            info = await self._request("GET", "/server_info", params={"config_format": "json"})
        except Refused as exc:
            if not exc.route_missing:
                raise
            log.warning(
                "%s has no dev mode: log-prob mode assumed %s; %s",
                self.base_url,
                self.logprobs_kind,
                DEV_HINT,
            )
            return
        mode = str(((info.get("vllm_config") or {}).get("model_config") or {}).get("logprobs_mode") or "")
        if mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineRequestError(
                f"vLLM returns {mode or 'unknown'}; Loom needs --logprobs-mode raw_logprobs or "
                "processed_logprobs"
            )
        kind: Literal["raw", "processed"] = "processed" if mode == "processed_logprobs" else "raw"
        if kind != self.logprobs_kind:
            log.warning(
                "LOOM_ENGINE_LOGPROBS_MODE says %s but %s runs --logprobs-mode %s: reporting %s",
                self.logprobs_kind, self.base_url, mode, kind,
            )  # fmt: skip
        self.logprobs_kind = kind

    def _verified(self, label: str) -> PolicyVersion | None:
        """The policy-store record a weight label names, when it still exists unchanged (and lies in
        this client's store, when it has one); the served model itself for vLLM's ``default``."""
        if label == BASE_LABEL:
            return PolicyVersion(version=0, path=self._base_path or "")
        try:
            fields = json.loads(label)
            named = PolicyVersion(
                version=int(fields["loom_policy_version"]),
                path=str(fields["path"]),
                created_at=float(fields["created_at"]),
            )
        except (ValueError, KeyError, TypeError):
            return None
        if named.version == 0 and named.path == self._base_path:
            return named
        meta = Path(named.path) / "policy.json"
        folder = Path(named.path).resolve().parent
        if folder.parent.name == NAMESPACES:  # a trainer's version: <store>/ns/<name>/v<N>
            folder = folder.parent.parent
        if self.policy_store is not None and folder != self.policy_store.resolve():
            return None
        try:
            record = PolicyVersion.model_validate_json(meta.read_text())
        except (OSError, ValueError):
            return None
        if (record.version, record.created_at) != (named.version, named.created_at):
            return None
        return record

    async def _ensure_synced(self) -> None:
        """Know what the server holds before generating (docstring at the top)."""
        if self._synced and time.monotonic() - self._last_ok < self.resync_s:
            return
        async with self._lock():
            if self._synced and time.monotonic() - self._last_ok < self.resync_s:
                return
            await self._discover()
            if self._policy is not None and self._policy.kind == "lora":
                self._synced = await self._lora_still_served() and await self._base_served()
                if self._synced:
                    return
                await self._load_lora(self._policy)
                self._synced = True
                return
            try:
                info = await self._request("GET", "/weight_info")
            except Refused as exc:
                if not exc.route_missing:
                    raise
                self._synced = True  # no dev mode: no way to ask, nor to reload; the served model it is
                return
            label = str(info.get("weight_version"))
            if self._policy is not None:
                if label != weight_label(self._policy):  # a restarted server, or another client's load
                    log.warning("%s holds %s, not this client's policy: reloading it", self.base_url, label)
                    await self._load_full(self._policy)
            elif (held := self._verified(label)) is not None:
                self.policy_version, self.policy_namespace = held.version, held.namespace
            else:
                log.warning("%s holds unknown weights (%s): reloading the served model", self.base_url, label)
                await self._load_full(PolicyVersion(version=0, path=self._base_path or ""))
            self._synced = True

    async def _lora_still_served(self) -> bool:
        models = await self._request("GET", "/v1/models")
        return any(c.get("id") == self.model for c in models.get("data") or [])

    # --------------------------------------------------------------------------------- generation
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if layout is not None:
            raise UnsupportedCapability(
                self.name, "group_positions", "vLLM has no custom position ids; use the interleaved layout"
            )
        if params.stop_token_sequences:  # vLLM stops on single ids and on text, not on id sequences
            raise UnsupportedCapability(
                self.name, "stop_sequences", "a marker of several tokens needs the torch engine"
            )
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        for _ in range(4):
            await self._ensure_synced()
            body = completion_body(await self.model_name(), prompt_ids, params)
            resp = await self._request("POST", "/v1/completions", json=body)
            choices = sorted(resp["choices"], key=lambda c: c["index"])
            if any(c.get("finish_reason") == "abort" for c in choices):
                # cut by /pause?mode=abort for a policy update: sent again once the update is done
                self.stats.extra["aborted_requests"] = self.stats.extra.get("aborted_requests", 0.0) + 1
                async with self._lock():
                    pass
                continue
            break
        else:
            raise EngineUnavailable("the request was aborted by policy updates 4 times in a row")
        if len(choices) != params.n:
            raise EngineRequestError(f"asked for {params.n} samples, server returned {len(choices)}")
        usage = resp.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        self.stats.requests += 1
        self.stats.cached_tokens += cached
        self.stats.prefill_tokens += len(prompt_ids) - cached
        out = [parse_choice(c) for c in choices]
        for c in out:
            c.cached_tokens = cached
        self.stats.decode_tokens += sum(len(c.token_ids) for c in out)
        return out

    # ------------------------------------------------------------------------------ policy updates
    async def load_policy(self, policy: PolicyVersion) -> None:
        await self._discover()
        async with self._lock():
            if policy.kind == "lora":
                await self._load_lora(policy)
            else:
                await self._load_full(policy)
            self._synced = True

    async def _load_full(self, policy: PolicyVersion) -> None:
        label = weight_label(policy)
        try:
            current = (await self._request("GET", "/weight_info")).get("weight_version")
        except Refused as exc:
            if exc.route_missing:
                raise EngineRequestError(f"full-checkpoint policy updates need dev mode: {DEV_HINT}") from exc
            raise
        if current == label:  # another client of this server loaded it already
            self._adopt_full(policy)
            return
        # /pause inside the try: a wait-mode pause can outlast the client's timeout on a loaded server
        # (in-flight requests draining), and the server must not stay paused after this call gives up
        try:
            await self._dev("POST", "/pause", params={"mode": self.pause_mode})
            results = await self._rpc_reload(policy.path)
            bad = [r for r in results if not (isinstance(r, dict) and r.get("loaded"))]
            if bad:
                first = bad[0] if isinstance(bad[0], dict) else {"error": repr(bad[0])}
                raise PolicyLoadError(
                    f"vLLM did not load policy {policy.version} from {policy.path}: {first.get('error')} "
                    f"(the server keeps {first.get('weights_path', 'its previous weights')})"
                )
            if not await self._reset_prefix_cache():
                # new weights, but cached prefixes of the old ones: leave no label a client would trust
                await self._dev("POST", "/update_weight_version", json={"new_version": "loom:unknown"})
                self._synced = False
                raise EngineUnavailable(f"{self.base_url} did not reset its prefix cache after a reload")
            reply = await self._dev("POST", "/update_weight_version", json={"new_version": label})
            if not (isinstance(reply, dict) and reply.get("success") is True):
                raise EngineUnavailable(f"/update_weight_version answered {reply!r}")
            # before /resume: a request held by the pause ends on the new weights, and is labelled so
            self._adopt_full(policy)
        finally:
            reply = await self._dev("POST", "/resume")
            if not (isinstance(reply, dict) and reply.get("status") == "resumed"):
                raise EngineUnavailable(f"/resume answered {reply!r}: the server may still be paused")
        log.info("vLLM %s serves policy version %d (%s)", self.base_url, policy.version, policy.path)

    def _adopt_full(self, policy: PolicyVersion) -> None:
        self.policy_version, self.policy_namespace = policy.version, policy.namespace
        self.model = self._base_name
        self._policy = policy if policy.path != self._base_path else None

    async def _rpc_reload(self, path: str) -> list[Any]:
        body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(path)}, "timeout": 600}
        try:
            reply = await self._dev("POST", "/collective_rpc", body, timeout=660.0, retry_5xx=False)
        except Refused as exc:
            if "has no attribute" in str(exc) and RELOAD_METHOD in str(exc):
                raise EngineRequestError(f"vLLM has no {RELOAD_METHOD}: {EXTENSION_HINT}") from exc
            raise PolicyLoadError(f"vLLM failed to reload {path}: {exc}") from exc
        results = (reply or {}).get("results")
        if not isinstance(results, list) or not results:
            raise PolicyLoadError(f"/collective_rpc {RELOAD_METHOD} answered {reply!r}")
        return results

    async def _reset_prefix_cache(self, tries: int = 5) -> bool:
        """``/reset_prefix_cache`` until it answers ``success: true`` (it refuses while blocks are held:
        running requests, or KV transfers finishing just after a pause)."""
        delay = 0.1
        for _ in range(tries):
            reply = await self._dev("POST", "/reset_prefix_cache")
            if isinstance(reply, dict) and reply.get("success") is True:
                return True
            await asyncio.sleep(delay)
            delay *= 2
        return False

    async def _base_served(self) -> bool:
        """Whether the server's weights are the served model's own (``/weight_info``): an adapter
        applies to them. Without dev mode no full reload was possible: they are."""
        try:
            label = (await self._request("GET", "/weight_info")).get("weight_version")
        except Refused as exc:
            if exc.route_missing:
                return True
            raise
        return label in (BASE_LABEL, weight_label(PolicyVersion(version=0, path=self._base_path or "")))

    async def _load_lora(self, policy: PolicyVersion) -> None:
        # a LoRA version is an adapter of the base model (the torch engine merges it into its base):
        # after a full version, the served model's own weights are reloaded first
        try:  # its record must declare that base (loom/store/checks.py)
            check_lora_base(policy.kind, policy.meta)
        except LoraBaseRefused as exc:
            raise PolicyLoadError(f"could not load policy version {policy.version}: {exc.detail}") from None
        if not await self._base_served():
            await self._load_full(PolicyVersion(version=0, path=self._base_path or ""))
        name = lora_name(policy)
        try:
            await self._request(
                "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": policy.path}, text=True
            )
        except Refused as exc:
            if exc.route_missing:
                raise EngineRequestError(f"the server cannot load LoRA adapters: {LORA_HINT}") from exc
            if not (exc.status == 400 and "has already been loaded" in str(exc)):
                raise PolicyLoadError(f"vLLM did not load LoRA policy {policy.version}: {exc}") from exc
        self.model = name
        self.policy_version, self.policy_namespace = policy.version, policy.namespace
        self._policy = policy
        if name in self._adapters:
            self._adapters.remove(name)
        self._adapters.append(name)
        while len(self._adapters) > self.lora_keep:
            old = self._adapters.pop(0)
            try:
                await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": old}, text=True)
            except Refused as exc:  # already gone (a restarted server): nothing to unload
                log.info("unloading %s: %s", old, exc)

    async def reset_cache(self) -> None:
        """Drop the server's prefix cache (dev mode); while requests run, pause until they finish."""
        if await self._reset_prefix_cache(tries=1):
            return
        await self._dev("POST", "/pause", params={"mode": "wait"})
        try:
            if not await self._reset_prefix_cache():
                raise EngineUnavailable(f"{self.base_url} refused to reset its prefix cache while paused")
        finally:
            await self._dev("POST", "/resume")

    async def health(self) -> bool:
        for _ in range(2):  # a kept-alive connection the server closed fails once: ask again
            try:
                r = await self.http.get("/health", timeout=5.0)
                return r.status_code == 200
            except (httpx.ReadError, httpx.RemoteProtocolError):
                continue
            except httpx.HTTPError:
                return False
        return False

    async def close(self) -> None:
        await self.http.aclose()
