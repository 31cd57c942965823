# RabbitMQ from Debian's package, for compose on hosts that reach no registry (deploy/images/build.sh).
# The first user comes from RABBITMQ_DEFAULT_USER / RABBITMQ_DEFAULT_PASS, as with the upstream image.
ARG BASE_IMAGE=loom/debian:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends rabbitmq-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/rabbitmq && chown rabbitmq:rabbitmq /var/lib/rabbitmq
ENV RABBITMQ_DEFAULT_USER=guest RABBITMQ_DEFAULT_PASS=guest HOME=/var/lib/rabbitmq \
    RABBITMQ_CONFIG_FILE=/var/lib/rabbitmq/loom.conf PATH=/usr/lib/rabbitmq/bin:$PATH
USER rabbitmq
VOLUME ["/var/lib/rabbitmq"]
EXPOSE 5672
CMD ["sh", "-c", "printf 'listeners.tcp.default = 5672\\nloopback_users = none\\ndefault_user = %s\\ndefault_pass = %s\\n' \"$RABBITMQ_DEFAULT_USER\" \"$RABBITMQ_DEFAULT_PASS\" >\"$RABBITMQ_CONFIG_FILE\" && exec rabbitmq-server"]
