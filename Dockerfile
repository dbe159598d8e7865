# trainguard's Python side (processor, archive, topic setup). Kafka itself runs from the
# apache/kafka image (see docker-compose.yml); the jar-based local broker is not needed here.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . .
RUN pip install . \
    && useradd --create-home --uid 1000 trainguard \
    && mkdir -p /data && chown trainguard /data
USER trainguard

ENTRYPOINT ["trainguard"]
CMD ["--help"]
