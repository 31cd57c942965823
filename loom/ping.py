"""The Celery app the workers' healthchecks ping through (docker-compose.yml, deploy/k8s/).

``celery -A loom.ping:celery_app inspect ping -d learner@$HOSTNAME`` needs only the broker settings
every service's app shares (``loom.queue.make_celery``): a control broadcast, answered by the worker
whose node name it names, whichever service that is. Pinging through the worker's own module
(``learner.tasks``) imported torch and transformers first: 16.5 s on a loaded 2-core host, past the
check's 15 s limit, so a healthy learner read ``unhealthy`` for as long as the host stayed busy and
``docker compose up --wait`` never returned. This module imports ``loom.queue`` only (about 1.5 s
there). The queue named here is only the app's default and is never published to.
"""

from __future__ import annotations

from loom.queue import make_celery

celery_app = make_celery("gateway")
