"""Runs many cases in one gloo process group per world size, and reports each case's outcome.

Starting processes and importing torch costs seconds, so each world size is spawned once
(``torch.multiprocessing``, start method spawn) and every worker runs the whole case list in order. A case
is a function ``(rank, world) -> None`` that raises on failure; every rank runs it and writes its outcome
(None or the traceback) to a JSON file after each case, so the parent can report per case even if a worker
dies or hangs. The parent waits with a deadline: a hang becomes a failure naming the case that was running,
never a stuck test run. Cases make their collectives symmetric (every rank reaches the same calls) and
compare results only after the last one, so a failing comparison on one rank cannot strand the others.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

# how long one world size may run (startup included) before the parent calls it hung
DEADLINE_S = 150
# a collective waiting longer than this raises in the worker (a mismatched call instead of a hang)
COLLECTIVE_TIMEOUT_S = 60


def _worker(rank: int, world: int, out_dir: str, names: list[str], backend: str) -> None:
    if backend == "gloo":
        # the kernels are interpreted on the CPU only if this is set before triton is first imported; the
        # torch backend ignores it, and each case picks its backend (flashattn.config.set_backend)
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # a few processes share two cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a file store in the run's own directory: a TCP port picked by the parent could be taken by another
    # process before rank 0 listens on it
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    import cp_cases

    path = Path(out_dir) / f"rank{rank}.json"
    results: dict[str, str | None] = {}
    for name in names:
        results[name] = "started and never finished (hang or crash)"
        path.write_text(json.dumps(results))
        try:
            torch.manual_seed(0)
            cp_cases.CASES[name].fn(rank, world)
            results[name] = None
        except Exception:
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, names: list[str], backend: str = "gloo") -> dict[str, str | None]:
    """Every case's outcome at this world size: None (passed on every rank) or the failures. ``backend``:
    gloo (CPU tensors) or nccl (one GPU a rank)."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, out_dir, names, backend), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        crashed = None
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    crashed = f"world size {world} did not finish within {DEADLINE_S} s (hang?)"
                    break
        except Exception:  # a worker exited with an error (ProcessRaisedException / ProcessExitedException)
            crashed = traceback.format_exc(limit=1)
        finally:
            for p in ctx.processes:  # only the processes this call started
                if p.is_alive():
                    p.kill()
        per_rank = []
        for rank in range(world):
            path = Path(out_dir) / f"rank{rank}.json"
            per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    outcome: dict[str, str | None] = {}
    for name in names:
        errors = []
        for rank, res in enumerate(per_rank):
            if name not in res:
                errors.append(f"rank {rank}: never reached" + (f" ({crashed})" if crashed else ""))
            elif res[name] is not None:
                errors.append(res[name] + (f"\n({crashed})" if crashed else ""))
        outcome[name] = "\n".join(errors) or None
    return outcome
