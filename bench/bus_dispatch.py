"""Cost of one send on the contract bus, with and without the per-route ledger.

    .venv/bin/python bench/bus_dispatch.py

Three shapes of the training step's traffic: a command without reply, a command whose
reply is routed back (checked and counted both ways), an event published to two
receivers. Each is timed on a bus counting into a ledger and on one whose ledger counts
nothing, interleaved, best of 15 rounds of 100,000 sends (microseconds per send).
"""

from __future__ import annotations

import time

from services.contract import Module, engine_pb2
from services.contract.bus import Bus, Traffic


class _Uncounted(Traffic):
    def delivered(self, sender: int, message: str, receiver: int, n: int = 1) -> None:
        pass


def shapes(traffic: Traffic) -> dict:
    bus = Bus(traffic=traffic)
    reply = engine_pb2.UpdateApplied(step=1)
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, lambda m, p: reply)
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ExportState, lambda m, p: None)
    bus.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.StepCompleted, lambda m, p: None)
    bus.subscribe(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, lambda m, p: None)
    port, emit = bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER), bus.emitter(Module.L2_TRAINING_LOOP)
    update = engine_pb2.ApplyUpdate(step=7, learning_rate=1e-3)
    export = engine_pb2.ExportState()
    step = engine_pb2.StepCompleted(job_id="j", step=3, loss=2.5, tokens=4096)
    return {
        "command, no reply": lambda: port(export),
        "command + routed reply": lambda: port(update),
        "publish to 2 receivers": lambda: emit(step),
    }


def per_send_us(fn, n: int = 100_000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    counted, uncounted = shapes(Traffic()), shapes(_Uncounted())
    best = {name: [float("inf"), float("inf")] for name in counted}
    for _ in range(15):
        for name in counted:
            best[name][0] = min(best[name][0], per_send_us(counted[name]))
            best[name][1] = min(best[name][1], per_send_us(uncounted[name]))
    print(f"{'shape':24} {'counted':>9} {'uncounted':>10} {'ledger':>8}   (us per send)")
    for name, (c, u) in best.items():
        print(f"{name:24} {c:9.2f} {u:10.2f} {c - u:+8.2f}")


if __name__ == "__main__":
    main()
