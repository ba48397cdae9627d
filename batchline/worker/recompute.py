"""The reproducibility check's engine: a version's records recomputed in a fresh engine
process, as a worker computes them (the same prompt, engine child, init and output check),
a batch of a chosen size at a time (`batchline.check.reproduce`).

Nothing here writes to the store: the answers are compared with the stored ones and
reported, never put. A record that crashes or hangs the engine is an answer missing this
time; the engine is started again for the rest.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from batchline.check.reproduce import Recomputed
from batchline.errors import EngineFatal
from batchline.registry import ENGINES
from batchline.snapshot import Record
from batchline.spec import JobSpec
from batchline.worker.engine_process import EngineProcess
from batchline.worker.shard import JobContext

LOAD_TIMEOUT_SECONDS = 900.0


def recompute(spec: JobSpec, records: Sequence[Record], batch_size: int) -> tuple[Mapping[str, Recomputed], str | None]:
    job = JobContext.of(spec)
    engine = EngineProcess(job.engine_init(), LOAD_TIMEOUT_SECONDS)
    _start(engine, spec)
    out: dict[str, Recomputed] = {}
    shards = spec.shards
    try:
        for i in range(0, len(records), batch_size):
            batch = records[i:i + batch_size]
            # The next batch goes only once this one is answered: the engine sees exactly this batch.
            engine.send([job.request(r) for r in batch])
            waiting = {r.id for r in batch}
            deadline = time.monotonic() + shards.batch_timeout_seconds + len(batch) * shards.record_timeout_seconds
            while waiting:
                msg = engine.get(deadline - time.monotonic())
                if msg is None or msg["op"] in ("crash", "eof"):
                    why = "no answer before the batch deadline" if msg is None else "the engine process died"
                    out.update({rid: Recomputed(None, why) for rid in waiting})
                    engine.kill()
                    _start(engine, spec)
                    break
                if msg["op"] == "fatal":
                    raise EngineFatal(f"validate.reproduce: {msg['error']}")
                if msg["op"] != "out" or msg["id"] not in waiting:
                    continue
                waiting.discard(msg["id"])
                if msg.get("error"):
                    out[msg["id"]] = Recomputed(None, str(msg["error"]))
                    continue
                canonical, problem = job.checker.check(msg["output"])
                out[msg["id"]] = Recomputed(canonical, problem)
        return out, engine.runtime
    finally:
        engine.close()


def _start(engine: EngineProcess, spec: JobSpec) -> None:
    try:
        engine.start()
    except EngineFatal as exc:
        extra = ENGINES[spec.model.engine].extra
        raise EngineFatal(f"validate.reproduce: the {spec.model.engine} engine cannot load here ({exc}); validate "
                          f"where the version's workers run (its extra: pip install 'batchline[{extra}]')") from None
