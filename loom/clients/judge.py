"""Client of the operators' judge servers (OpenAI-compatible ``/v1/completions``): what the reward
service's ``judge`` component calls (docs/interop-reward.md "Judge rewards").

Every judge is named in ``LOOM_REWARD_JUDGES`` (``loom.contracts.reward_settings.JudgeServer``); a
request names a judge, never a URL (docs/security-workers.md). Per judge: at most
``max_concurrency`` requests in flight, and token buckets for requests and tokens per minute (a
request waits for its share, it is never sent early). A 429, a 5xx or a connect error is retried with
bounded exponential back-off; a timeout is not (the deadline is the caller's). ``ask_batch`` never
raises: each ask's reply carries a typed status (``judge_timeout``, ``judge_unavailable``), so one
unreachable judge fails no reward batch. Successful replies are cached by (judge, prompt, max tokens,
log-probs): the prompt is the template filled with the inputs, so a repeated item costs no request.
Connections are spread over ``Lanes`` of a few each (httpcore's pool is quadratic in its size).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from loom.contracts.reward_settings import JudgeServer

log = logging.getLogger(__name__)

ReplyStatus = Literal["ok", "judge_timeout", "judge_unavailable", "judge_unparsable"]


@dataclass(frozen=True)
class JudgeAsk:
    judge: str
    prompt: str
    max_tokens: int
    timeout_s: float
    logprobs: int = 0  # top log-probs per token asked for (0: none)


@dataclass(frozen=True)
class JudgeReply:
    status: ReplyStatus
    text: str = ""
    first_tops: dict[str, float] | None = None  # the first token's top log-probs
    detail: str | None = None


def estimate_tokens(ask: JudgeAsk) -> int:
    """Tokens an ask may cost (prompt at ~4 characters a token, plus its whole completion budget):
    the tokens-per-minute bucket is charged before the request, so it never runs over."""
    return len(ask.prompt) // 4 + 1 + ask.max_tokens


class TokenBucket:
    """``per_minute`` units a minute, at most ``per_minute`` at once (0: unlimited)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = self.capacity
        self.clock = clock
        self.stamp = clock()

    def wait_for(self, n: float) -> float:
        """Seconds until ``n`` units are there; takes them and returns 0 when they are."""
        if self.rate <= 0:
            return 0.0
        n = min(n, self.capacity)
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate

    async def take(self, n: float) -> None:
        while (wait := self.wait_for(n)) > 0:
            await asyncio.sleep(wait)


@dataclass
class _Limits:
    sem: asyncio.Semaphore
    rpm: TokenBucket
    tpm: TokenBucket


@functools.cache
def _tls() -> Any:
    """The process's one TLS context for judge connections: every new pool would load the CA bundle
    again (~20 ms), and a reward task's ``ask_batch_once`` opens pools of its own each call."""
    return httpx.create_ssl_context()


@dataclass
class Lanes:
    """Connection pools of at most ``width`` connections each, a request on the first with room, a
    new pool only when every one is full. httpcore 1.0's pool, on every request's start and end,
    checks each idle connection against a count of all of them (``_assign_requests_to_connections``):
    one pool holding a few hundred in flight spent 4/5 of the client's CPU there (bench/judge.py,
    docs/benchmarks/README.md "judge"); a lane never queues a request and scans at most ``width``."""

    width: int = 16
    pools: list[httpx.AsyncClient] = field(default_factory=list)
    load: list[int] = field(default_factory=list)

    async def post(self, url: str, body: dict[str, Any], timeout: float) -> httpx.Response:
        i = next((i for i, n in enumerate(self.load) if n < self.width), len(self.load))
        if i == len(self.load):
            limits = httpx.Limits(max_connections=self.width, max_keepalive_connections=self.width)
            self.pools.append(httpx.AsyncClient(limits=limits, verify=_tls()))
            self.load.append(0)
        self.load[i] += 1
        try:
            return await self.pools[i].post(url, json=body, timeout=timeout)
        finally:
            self.load[i] -= 1

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


@dataclass
class JudgeClient:
    servers: Mapping[str, JudgeServer]
    cache_size: int = 65536
    cache: OrderedDict[tuple[Any, ...], JudgeReply] = field(default_factory=OrderedDict)
    sent: int = 0  # requests sent (attempts included), for the bench and the logs
    _limits: dict[str, _Limits] = field(default_factory=dict)
    # the rate buckets outlive an event loop (a Celery task's ``asyncio.run``): the rates hold across
    # the process's batches; only the semaphores and the shared in-flight asks belong to one loop
    _buckets: dict[str, tuple[TokenBucket, TokenBucket]] = field(default_factory=dict)
    _loop: Any = None
    _http: Lanes | None = None
    _pending: dict[tuple[Any, ...], asyncio.Future[JudgeReply]] = field(default_factory=dict)

    def _limits_of(self, name: str, server: JudgeServer | None) -> _Limits | None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # semaphores and connections belong to one event loop
            self._limits, self._loop, self._http, self._pending = {}, loop, None, {}
        if server is None:
            return None
        if name not in self._limits:
            if name not in self._buckets:
                self._buckets[name] = (TokenBucket(server.rpm), TokenBucket(server.tpm))
            rpm, tpm = self._buckets[name]
            self._limits[name] = _Limits(asyncio.Semaphore(server.max_concurrency), rpm, tpm)
        return self._limits[name]

    def close(self) -> None:
        """Forget the cache and connections (``loom.runtime.Shared.close``: a reset, the next use
        opens new ones)."""
        self.cache.clear()
        self._limits, self._loop, self._http, self._pending = {}, None, None, {}

    async def ask_batch(self, asks: Sequence[JudgeAsk]) -> list[JudgeReply]:
        """One reply per ask, in order, all asked at once (each judge's limits hold them back), on
        this event loop's connection pool (kept: a batch reuses the last one's connections)."""
        if not asks:
            return []
        self._limits_of("", None)
        if self._http is None:
            self._http = Lanes()
        http = self._http
        return list(await asyncio.gather(*(self.ask(http, a) for a in asks)))

    async def ask_batch_once(self, asks: Sequence[JudgeAsk]) -> list[JudgeReply]:
        """``ask_batch`` on connections of its own, closed after (an ``asyncio.run`` per call)."""
        http = Lanes()
        try:
            return list(await asyncio.gather(*(self.ask(http, a) for a in asks)))
        finally:
            await http.aclose()

    async def ask(self, http: Lanes, ask: JudgeAsk) -> JudgeReply:
        server = self.servers.get(ask.judge)
        if server is None:
            return JudgeReply("judge_unavailable", detail=f"no judge {ask.judge!r} in LOOM_REWARD_JUDGES")
        key = (ask.judge, ask.prompt, ask.max_tokens, ask.logprobs)
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        limits = self._limits_of(ask.judge, server)
        assert limits is not None
        pending = self._pending.get(key)
        if pending is not None:  # the same ask in flight already (a group's equal answers): one request
            return await asyncio.shield(pending)
        future: asyncio.Future[JudgeReply] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            reply = await self._call(http, server, limits, ask)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody waited
            raise
        else:
            future.set_result(reply)
        finally:
            del self._pending[key]
        if reply.status == "ok":
            self.cache[key] = reply
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return reply

    async def _call(self, http: Lanes, server: JudgeServer, lim: _Limits, ask: JudgeAsk) -> JudgeReply:
        body: dict[str, Any] = {
            "model": server.model,
            "prompt": ask.prompt,
            "max_tokens": ask.max_tokens,
            "temperature": 0.0,
        }
        if ask.logprobs:
            body["logprobs"] = ask.logprobs
        url = server.url.rstrip("/") + "/v1/completions"
        why = "no attempt"
        for attempt in range(server.retries + 1):
            if attempt:
                await asyncio.sleep(min(server.backoff_s * 2 ** (attempt - 1), server.backoff_s * 8))
            async with lim.sem:
                await lim.rpm.take(1)
                await lim.tpm.take(estimate_tokens(ask))
                self.sent += 1
                try:
                    r = await http.post(url, body, ask.timeout_s)
                except httpx.TimeoutException:
                    return JudgeReply("judge_timeout", detail=f"no judge answer in {ask.timeout_s:g} s")
                except httpx.HTTPError as exc:
                    why = f"judge unreachable ({type(exc).__name__})"
                    continue
            if r.status_code == 429 or r.status_code >= 500:
                why = f"judge answered HTTP {r.status_code}"
                continue
            if r.status_code >= 400:  # its body goes to this service's log, never into a reward
                log.warning("judge %s answered HTTP %d: %s", ask.judge, r.status_code, r.text[:300])
                return JudgeReply("judge_unavailable", detail=f"judge answered HTTP {r.status_code}")
            return _reply_of(r)
        return JudgeReply("judge_unavailable", detail=f"{why}; {server.retries} retries")


def _reply_of(r: httpx.Response) -> JudgeReply:
    """The completion's text and first token's top log-probs; a body that is not one: unparsable."""
    try:
        choice = r.json()["choices"][0]
        text = choice.get("text")
        if not isinstance(text, str):
            raise TypeError("no text")
        tops_raw = (choice.get("logprobs") or {}).get("top_logprobs") or []
        first = tops_raw[0] if tops_raw and isinstance(tops_raw[0], dict) else None
        tops = {str(k): float(v) for k, v in first.items() if math.isfinite(float(v))} if first else None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return JudgeReply("judge_unparsable", detail=f"not a completion ({type(exc).__name__})")
    return JudgeReply("ok", text, tops)
