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


def test_an_ack_wakes_a_consumer_whose_prefetch_window_was_full(tmp_path):
    """With one message in flight the poller cannot fetch; the ack must end its wait at once instead of
    at the next poll. Polls are 30 s apart here (one drain waits at most 1 s before it returns to
    Celery's loop), so without the wake-up the second message comes a full second after the ack."""
    import threading

    db = tmp_path / "broker.sqlite"
    with Connection(f"loomsql:///{db}", transport_options={"polling_interval": 30.0}) as conn:
        queue = _declare(conn)
        for n in range(2):
            conn.Producer().publish({"n": n}, exchange=queue.exchange, routing_key="q", serializer="json")
        conn.transport.hot_polling_interval = 30.0
        got: list = []
        acked_at: list[float] = []

        def ack_first() -> None:
            acked_at.append(time.monotonic())
            got[0][1].ack()

        with conn.Consumer(queue, callbacks=[lambda body, msg: got.append((body, msg))], prefetch_count=1):
            conn.drain_events(timeout=10)
            assert [b for b, _ in got] == [{"n": 0}]
            timer = threading.Timer(0.2, ack_first)
            timer.start()
            conn.drain_events(timeout=10)
            delivered_at = time.monotonic()
            timer.join()
            assert [b for b, _ in got] == [{"n": 0}, {"n": 1}]
            assert delivered_at - acked_at[0] < 0.5, "the ack did not wake the poller"
            got[1][1].ack()
        assert conn.default_channel.queue_declare("q", passive=True).message_count == 0
