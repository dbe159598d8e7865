"""The faust-consume baseline of bench_live.py (issue 20): how fast ONE faust worker
(the processor's framework, with the processor's consumer settings) moves the same
telemetry records through an agent that does nothing with them. Between the raw consume
(bench/raw_consume.py: aiokafka alone) and the processor, it shows what the stream
framework costs per record on this machine.

    .venv/bin/python bench/faust_consume.py BOOTSTRAP TOPIC RECORDS OUT [stock|eager]

`eager` gives the app the processor's transport (processors/eager_delivery.py: a record
delivered without faust's four tasks when nothing can race it); `stock` (the default) is
faust's own.

Reads the topic from its start until RECORDS records have come through, then writes one
JSON object to the file OUT (faust takes stdout over): records, wall_s (first record to
last), cpu_s (this process, same span).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import faust
from raw_consume import FETCH_BYTES, cpu_s

from trainguard.processors import eager_delivery

#: As processors/app.py sets it.
BUFFER = 16384


def main(argv: list[str]) -> int:
    bootstrap, topic_name, total, out = argv[0], argv[1], int(argv[2]), Path(argv[3])
    transport = argv[4] if len(argv) > 4 else "stock"
    app = faust.App(
        f"faust-consume-{uuid.uuid4().hex[:8]}",
        broker=f"kafka://{bootstrap}",
        datadir=tempfile.mkdtemp(prefix="faust-consume-"),
        web_enabled=False,
        topic_allow_declare=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        consumer_max_fetch_size=FETCH_BYTES,
        stream_buffer_maxsize=BUFFER,
    )
    if transport == "eager":
        eager_delivery.install(app)
    elif transport != "stock":
        raise SystemExit(f"transport: stock or eager, not {transport!r}")
    topic = app.topic(
        topic_name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw"
    )
    seen = {"records": 0, "t0": 0.0, "cpu0": 0.0}

    @app.agent(topic)
    async def count(stream: faust.StreamT[bytes]) -> None:
        async for _ in stream.events():
            if not seen["records"]:
                seen["t0"], seen["cpu0"] = time.perf_counter(), cpu_s()
            seen["records"] += 1
            if seen["records"] >= total:
                wall = time.perf_counter() - seen["t0"]
                used = cpu_s() - seen["cpu0"]
                out.write_text(json.dumps({"records": seen["records"], "wall_s": wall, "cpu_s": used}))
                os._exit(0)

    asyncio.set_event_loop(asyncio.new_event_loop())
    faust.Worker(app, loglevel="error", quiet=True).execute_from_commandline()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
