# trainguard's Python side (processor, archive, topic setup). Kafka itself runs from the
# apache/kafka image (see docker-compose.yml); the jar-based local broker is not needed here.

# Stage 1: the compiled builds of the hot modules (trainguard/compiled_build.py: the core
# and the block checks, ~25% faster). The full image has the C compiler and the Python
# headers mypyc needs; only the built extensions go on. Both stages use the same Python
# and Debian release (3.11.16 on trixie: the tags say so, tests/test_compose.py checks they
# agree), so the extensions load in the slim one; an installed build whose stamp does not
# hold is not used (the Python runs instead). Both are pinned by the digest of the tag's
# multi-platform index: `scripts/pin-images` refreshes them, docs/deploy/images.md records
# where each digest came from.
FROM python:3.11.16-trixie@sha256:49b1cf25d7f7e958959234f66ff97fc4a3156e084b468624eb85eaa3ab4aaf7b AS compiled
WORKDIR /src
COPY . .
# compile_core is development tooling (harness/, not in the product's wheel), run from the
# source tree: `python -m` finds it from the working directory.
RUN pip install --no-cache-dir -e ".[compile]" \
    && python -m harness.devtools.compile_core --force

FROM python:3.11.16-slim-trixie@sha256:be1575ed968de893bd54f4c56315ff7c4736ce522c1bca08fd521731aafc0d76

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
