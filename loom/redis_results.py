"""Celery's Redis result backend with one round trip per state change.

Celery's key-value backends store a state in two steps: read the current meta (a SUCCESS is never
overwritten: a lost worker's duplicate run must not replace the recorded result), then write the new
one (SET + PUBLISH in a pipeline). With ``task_track_started`` and Loom's idempotency read
(``loom.queue.LoomTask``) that is five Redis round trips per task. In a rollout worker whose engine
runs in-process, each round trip hands the GIL back and forth with the engine's scheduler thread;
``bench/rollout.py`` (RabbitMQ, 4 groups in flight) read +12.7 % with the STARTED store and +8.7 %
without it.

``LoomRedisBackend`` does the check and the write in one Lua script (atomic, which Celery's read-then-
write is not), and remembers, per thread, what the STARTED store found: LoomTask then knows without
another read whether the task already has a result. Two round trips per task instead of five. The
stored values, keys, expiry and published messages are Celery's own, so every Celery reader (and
``loom.results.ResultWaiter``) works unchanged.

URL: ``loom.redis_results:LoomRedisBackend+redis://…`` (``loom.queue.result_backend_url`` builds it
from ``LOOM_RESULT_BACKEND=redis://…``).
"""

from __future__ import annotations

import threading
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import BackendStoreError
from kombu.utils.encoding import bytes_to_str

BACKEND_CLASS = "loom.redis_results:LoomRedisBackend"

# KEYS[1]: the result key; ARGV[1]: the encoded meta, ARGV[2]: expiry in seconds (0: none).
# Returns {0} when stored, {1, current} when the key already holds a SUCCESS (nothing written),
# {2} when the current value is not JSON (e.g. a compressed payload): the caller falls back to Celery.
_CHECK_AND_SET = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, meta = pcall(cjson.decode, cur)
  if not ok or type(meta) ~= 'table' then
    return {2}
  end
  if meta['status'] == 'SUCCESS' then
    return {1, cur}
  end
end
local ttl = tonumber(ARGV[2])
if ttl and ttl > 0 then
  redis.call('SETEX', KEYS[1], ttl, ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return {0}
"""

STORED, HAS_SUCCESS, UNDECODABLE = 0, 1, 2


class LoomRedisBackend(RedisBackend):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen = threading.local()  # task id -> the SUCCESS meta its STARTED store found, or None
        self._script: Any = None

    def _check_and_set(self, key: bytes, value: Any, expires: int) -> list[Any]:
        if self._script is None:
            self._script = self.client.register_script(_CHECK_AND_SET)
        return list(self._script(keys=[key], args=[value, int(expires or 0)]))

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        value = self.encode(meta)
        if isinstance(value, str) and len(value) > self._MAX_STR_VALUE_SIZE:
            raise BackendStoreError("value too large for Redis backend", state=state, task_id=task_id)
        expires = self.failure_expires if state == states.FAILURE else self.expires
        out = self.ensure(self._check_and_set, (self.get_key_for_task(task_id), value, expires))
        if out[0] == UNDECODABLE:
            return super()._store_result(task_id, result, state, traceback, request, **kwargs)
        if state == states.STARTED:
            seen = self._seen.__dict__
            if len(seen) > 1000:  # entries of tasks that never reached LoomTask.__call__
                seen.clear()
            seen[task_id] = self.decode_result(out[1]) if out[0] == HAS_SUCCESS else None
        return result

    def started_found(self, task_id: str) -> tuple[bool, dict[str, Any] | None]:
        """(known, meta): whether this thread's STARTED store of ``task_id`` ran (and is forgotten now),
        and the SUCCESS meta it found instead of writing, if any."""
        seen = self._seen.__dict__
        if task_id not in seen:
            return False, None
        return True, seen.pop(task_id)
