"""The embedded transport's own guarantees, in-process: leases, redelivery, ack, requeue, durability."""

from __future__ import annotations

import time

from kombu import Connection, Exchange, Queue

import loom.queue  # noqa: F401  (registers the loomsql transport alias)
from loom.queue import _register_embedded_transport

_register_embedded_transport()


def _conn(path, vt: float = 1.0) -> Connection:
    return Connection(f"loomsql:///{path}", transport_options={"visibility_timeout": vt})


def _declare(conn: Connection) -> Queue:
    queue = Queue("q", Exchange("q", type="direct", durable=True), routing_key="q", durable=True)
    queue(conn.default_channel).declare()
    return queue


def test_unacked_message_is_invisible_then_redelivered_after_the_visibility_timeout(tmp_path):
    db = tmp_path / "broker.sqlite"
    with _conn(db) as producer, _conn(db) as a, _conn(db) as b:
        queue = _declare(producer)
        producer.Producer().publish({"n": 1}, exchange=queue.exchange, routing_key="q", serializer="json")
        first = a.default_channel.basic_get("q")
        assert first is not None and first.delivery_info.get("redelivered") is not True
        assert b.default_channel.basic_get("q") is None  # leased: not visible to another consumer
        assert b.default_channel.queue_declare("q", passive=True).message_count == 0
        time.sleep(1.2)  # a never renews (it does not poll): the lease expires
        again = b.default_channel.basic_get("q")
        assert again is not None and again.delivery_info["redelivered"] is True
        assert again.decode() == {"n": 1}
        again.ack()
        assert b.default_channel.queue_declare("q", passive=True).message_count == 0
        time.sleep(1.2)
        assert a.default_channel.basic_get("q") is None  # acked: gone for good


def test_reject_with_requeue_makes_the_message_visible_at_once(tmp_path):
    db = tmp_path / "broker.sqlite"
    with _conn(db, vt=60) as a, _conn(db, vt=60) as b:
        queue = _declare(a)
        a.Producer().publish({"n": 2}, exchange=queue.exchange, routing_key="q", serializer="json")
        a.default_channel.basic_get("q").reject(requeue=True)
        message = b.default_channel.basic_get("q")
        assert message.decode() == {"n": 2} and message.delivery_info["redelivered"] is True


def test_polling_consumer_renews_its_leases(tmp_path):
    db = tmp_path / "broker.sqlite"
    with _conn(db, vt=1.0) as a, _conn(db, vt=1.0) as b:
        queue = _declare(a)
        a.Producer().publish({"n": 3}, exchange=queue.exchange, routing_key="q", serializer="json")
        held = a.default_channel.basic_get("q")
        assert held is not None
        for _ in range(8):  # 2 s of polling, twice the visibility timeout
            time.sleep(0.25)
            a.default_channel._renew_leases()
            assert b.default_channel.basic_get("q") is None


def test_messages_survive_a_restart_and_purge_removes_ready_ones(tmp_path):
    db = tmp_path / "broker.sqlite"
    with _conn(db) as a:
        queue = _declare(a)
        for n in range(3):
            a.Producer().publish({"n": n}, exchange=queue.exchange, routing_key="q", serializer="json")
    with _conn(db) as fresh:  # a new process would open the file the same way; bindings are stored too
        assert fresh.default_channel.queue_declare("q", passive=True).message_count == 3
        assert fresh.default_channel.basic_get("q").decode() == {"n": 0}
        assert fresh.default_channel.queue_purge("q") == 2
        assert fresh.default_channel.queue_declare("q", passive=True).message_count == 0
