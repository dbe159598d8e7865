# trainguard's Python side (processor, archive, topic setup). Kafka itself runs from the
# apache/kafka image (see docker-compose.yml); the jar-based local broker is not needed here.

# Stage 1: the compiled builds of the hot modules (trainguard/compiled_build.py: the core
# and the block checks, ~25% faster). The full image has the C compiler and the Python
# headers mypyc needs; only the built extensions go on. Both stages use the same Python
# and Debian release (the tags move together), so the extensions load in the slim one; an
# installed build whose stamp does not hold is not used (the Python runs instead).
FROM python:3.11 AS compiled
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir -e ".[compile]" \
    && python -m trainguard.devtools.compile_core --force

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
# The wheel carries the builds (pyproject's package data for _compiled/).
COPY --from=compiled /src/processors/core/_compiled processors/core/_compiled
COPY --from=compiled /src/schemas/_compiled schemas/_compiled
RUN pip install . \
    && useradd --create-home --uid 1000 trainguard \
    && mkdir -p /data && chown trainguard /data
USER 1000:1000

ENTRYPOINT ["trainguard"]
CMD ["--help"]
