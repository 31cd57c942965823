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
        conn.transport.hot_tick_max = conn.transport.idle_tick_max = 30.0
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


def test_an_empty_poll_moves_no_version_and_a_publish_does(tmp_path):
    """The change signal an idle consumer sleeps on (``Database.version``): other consumers' empty
    claims must not wake it (idle workers would keep each other polling), a publish from another
    connection (another process) or from this process must."""
    import sqlite3

    from loom.embedded_broker import Database

    db = tmp_path / "broker.sqlite"
    with _conn(db) as a:
        _declare(a)
        a.default_channel.basic_get("q")  # an empty claim of our own
        other = sqlite3.connect(db, isolation_level=None)  # another process's connection
        v0 = Database.get(str(db)).version()
        other.execute(
            "UPDATE messages SET visible_at = 1, owner = 'x' WHERE id = (SELECT id FROM messages"
            " WHERE queue = 'q' AND visible_at <= 0 ORDER BY id LIMIT 1) RETURNING id"
        ).fetchall()  # another consumer's empty claim
        assert Database.get(str(db)).version() == v0
        other.execute("INSERT INTO messages (queue, payload) VALUES ('q', '{}')")
        v1 = Database.get(str(db)).version()
        assert v1 != v0
        a.Producer().publish({"n": 1}, exchange="q", routing_key="q", serializer="json")
        assert Database.get(str(db)).version() != v1
        other.close()


def test_a_publish_from_another_process_ends_an_idle_consumers_wait(tmp_path):
    """An idle consumer sleeps until the broker file changes, not until its next poll (issue 37: a
    worker idle for 2 s saw its next task ~25 ms late on average at the default 50 ms interval).
    Polls are 30 s apart here and the drain has no time limit: before the change signal the message
    another process publishes while the consumer waits came at the next poll, 30 s later. A message
    of this process's own at 20 s ends a wait that nothing else ended (the test then fails)."""
    import subprocess
    import sys
    import threading

    db = tmp_path / "broker.sqlite"
    publish = (
        "import sys, time; from kombu import Connection; from loom.queue import _register_embedded_transport;"
        "_register_embedded_transport(); c = Connection(sys.argv[1]); c.default_channel;"
        "print('ready', flush=True); sys.stdin.readline(); time.sleep(0.3);"
        "c.Producer().publish({'n': 1}, exchange='q', routing_key='q', serializer='json')"
    )
    with Connection(f"loomsql:///{db}", transport_options={"polling_interval": 30.0}) as conn:
        queue = _declare(conn)
        proc = subprocess.Popen(
            [sys.executable, "-c", publish, f"loomsql:///{db}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # connected: the publish is one statement
        got: list = []
        with conn.Consumer(queue, callbacks=[lambda body, msg: got.append((body, msg))], prefetch_count=1):
            conn.transport._last_delivery = 0.0  # idle, not just after a delivery
            fired = threading.Event()

            def fall_back() -> None:
                fired.set()
                with _conn(db) as own:  # this process's Database: its publish ends the wait
                    own.Producer().publish({"n": "fallback"}, exchange="q", routing_key="q")

            fallback = threading.Timer(20.0, fall_back)
            fallback.start()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            conn.drain_events(timeout=None)  # the publish comes 0.3 s into this wait
            fallback.cancel()
            assert not fired.is_set(), "the publish did not wake the idle consumer"
            assert [b for b, _ in got] == [{"n": 1}]
            got[0][1].ack()
        proc.wait(timeout=30)
