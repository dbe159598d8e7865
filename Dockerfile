# trainguard's Python side (processor, archive, topic setup). Kafka itself runs from the
# apache/kafka image (see docker-compose.yml); the jar-based local broker is not needed here.
FROM python:3.11-slim

# TRAINGUARD_HOME: where a service keeps its state (the processor's faust data, the
# archive). /app, the working directory, stays root-owned and read-only to the service:
# nothing may be written next to the code. docker-compose.yml puts a volume on /data.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINGUARD_HOME=/data

WORKDIR /app
COPY . .
RUN pip install . \
    && useradd --create-home --uid 1000 trainguard \
    && mkdir -p /data && chown trainguard /data
USER 1000:1000

ENTRYPOINT ["trainguard"]
CMD ["--help"]
