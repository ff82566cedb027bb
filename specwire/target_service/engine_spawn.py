"""Starting the engine process (`engine_process.py`), apart from waiting for it.

Spawning needs nothing heavy: the child's entry point (`engine_child.engine_main`) imports
torch and the engine only once it runs. So the CLI spawns the child first, and the child
imports and loads while the front end imports its own modules (torch among them, for
admission) and starts listening; `EngineProcess` then waits for the child's `ready`. On a
GPU host both imports take seconds, and they used to run one after the other.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from specwire.target_service.config import TargetConfig
from specwire.target_service.engine_child import engine_main


@dataclass
class SpawnedEngine:
    """A started engine child: the process, the front end's end of the pipe, and the folder
    where the child leaves its tokenizer for admission."""

    proc: Any  # multiprocessing's SpawnProcess
    conn: Any  # multiprocessing.connection.Connection
    tok_dir: tempfile.TemporaryDirectory

    def kill(self) -> None:
        """End the child now (a front end that fails before it waits for the child, or
        exits): it must never outlive us holding the GPU."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


def spawn_engine(
    cfg: TargetConfig,
    *,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    switch_interval: float = 5e-4,
    log_level: str = "WARNING",
    log_format: str = "text",
) -> SpawnedEngine:
    """Start the engine child for `cfg` (it loads at once) and return without waiting.
    Linux ties the child's PR_SET_PDEATHSIG to the thread that starts it: call this on a
    thread that lives as long as the engine should (the CLI: its main thread)."""
    tok_dir = tempfile.TemporaryDirectory(prefix="specwire-tokenizer-")
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=engine_main,
        args=(
            cfg,
            child_conn,
            tok_dir.name,
            dict(
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                switch_interval=switch_interval,
                log_level=log_level,
                log_format=log_format,
                parent=os.getpid(),
            ),
        ),
        name="specwire-engine",
        daemon=True,
    )
    proc.start()
    spawned = SpawnedEngine(proc, conn, tok_dir)
    # Before multiprocessing's own exit join (which would wait for a loading child).
    atexit.register(spawned.kill)
    child_conn.close()
    return spawned
