"""ring-flash-attn 0.1.8, unmodified, on flashattn through flashattn.compat: CPU processes over gloo.

Each world size is started once (forked); every rank installs flashattn.compat, imports ring-flash-attn's
ring and zigzag modules (which import flash_attn.flash_attn_interface's private functions), runs every case
forward and backward on its shard of the sequence and checks it against single-process attention: the fp64
oracle on the whole sequence, under the tolerance rule (plain PyTorch in bfloat16 the baseline). bfloat16
because ring-flash-attn's ring backward returns dq in bfloat16 whatever the input dtype.

ring-flash-attn's package __init__ also imports its Hugging Face adapter, which needs a transformers < 5
name (is_flash_attn_greater_or_equal_2_10) and fails to import under the transformers 5 this project tests
with; the workers load the package's attention modules without that __init__ (`_ring_modules`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

DEADLINE_S = 120  # one world size, startup included; past it the parent reports a hang
# (name, module, function, causal); zigzag is defined for causal attention only
CASES = [
    ("ring-causal", "ring_flash_attn", "ring_flash_attn_func", True),
    ("ring-full", "ring_flash_attn", "ring_flash_attn_func", False),
    ("zigzag-causal", "zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func", True),
    ("ring-kvpacked-causal", "ring_flash_attn", "ring_flash_attn_kvpacked_func", True),
]
B, H, D = 2, 2, 16
CHUNK = 6  # tokens per rank (zigzag: two halves of 3)


def _ring_modules():
    """ring_flash_attn's package without its __init__ (see the module docstring), submodules importable."""
    if "ring_flash_attn" in sys.modules:
        return sys.modules["ring_flash_attn"]
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None:
        raise ModuleNotFoundError("ring-flash-attn==0.1.8 is not installed (it is in the dev extra)")
    pkg = types.ModuleType("ring_flash_attn")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    sys.modules["ring_flash_attn"] = pkg
    return pkg


def _warm() -> None:
    """Import and run once, in the parent, what every worker needs: forked workers then start at once."""
    import utils  # noqa: F401  (the tolerance rule; imports Triton)

    import flashattn
    from flashattn import config
    from flashattn.reference import attention_ref

    x = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    with config.use_backend("torch"):
        flashattn.flash_attn_func(x, x, x, causal=True).sum().backward()
    attention_ref(x, x, x, causal=True)[0].sum().backward()


def _shard(x, rank, world, zigzag):
    """The rank's tokens of a (b, s, ...) tensor: one chunk, or chunks rank and 2·world - 1 - rank."""
    if not zigzag:
        return x.chunk(world, dim=1)[rank]
    parts = x.chunk(2 * world, dim=1)
    return torch.cat([parts[rank], parts[2 * world - 1 - rank]], dim=1)


def _run_case(rank, world, module, func, causal):
    from utils import assert_close_to_ref

    from flashattn.reference import attention_ref

    fn = getattr(importlib.import_module(f"ring_flash_attn.{module}"), func)
    zigzag = module.startswith("zigzag")
    seqlen = CHUNK * world
    gen = torch.Generator().manual_seed(11)  # every rank draws the same full tensors
    q, k, v, dout = (torch.randn(B, seqlen, H, D, generator=gen).to(torch.bfloat16) for _ in range(4))
    local = [_shard(x, rank, world, zigzag).detach().clone().requires_grad_(True) for x in (q, k, v)]
    if func.endswith("kvpacked_func"):
        kv = torch.stack(local[1:], dim=2).detach().requires_grad_(True)
        out = fn(local[0], kv, causal=causal)
        grads = torch.autograd.grad(out, (local[0], kv), _shard(dout, rank, world, zigzag))
        grads = (grads[0], grads[1][:, :, 0], grads[1][:, :, 1])
    else:
        out = fn(*local, causal=causal)
        grads = torch.autograd.grad(out, local, _shard(dout, rank, world, zigzag))
    full = [x.detach().requires_grad_(True) for x in (q, k, v)]
    ref_out, _ = attention_ref(*full, causal=causal, upcast=True)
    pt_out, _ = attention_ref(*full, causal=causal, upcast=False)
    ref_g = torch.autograd.grad(ref_out, full, dout.double())
    pt_g = torch.autograd.grad(pt_out, full, dout)
    shard = lambda x: _shard(x, rank, world, zigzag)  # noqa: E731
    assert_close_to_ref(out, shard(ref_out), shard(pt_out), name="out")
    for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_g, pt_g, strict=True):
        assert_close_to_ref(g, shard(r), shard(p), factor=3.0, name=name)


def _worker(rank: int, world: int, out_dir: str, names: list[str]) -> None:
    import torch.distributed as dist

    import flashattn.compat
    from flashattn import config

    torch.set_num_threads(1)  # several processes share two cores
    flashattn.compat.install()
    config.set_backend("torch")  # the CPU path; the kernels' own tests cover the interpreter
    _ring_modules()
    # a file store in the run's own directory, not a TCP port another process could take first
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    path = Path(out_dir) / f"rank{rank}.json"
    results: dict[str, str | None] = {}
    for name, module, func, causal in CASES:
        if name not in names:
            continue
        results[name] = "started and never finished (hang or crash)"
        path.write_text(json.dumps(results))
        try:
            _run_case(rank, world, module, func, causal)
            results[name] = None
        except Exception:
            results[name] = f"rank {rank}:\n{traceback.format_exc()}"
        path.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, names: list[str] | None = None) -> dict[str, str | None]:
    """Every case's outcome at this world size: None (passed on every rank) or the failures."""
    names = [c[0] for c in CASES] if names is None else names
    _warm()
    with tempfile.TemporaryDirectory() as out_dir:
        # fork: a spawned worker would spend seconds importing torch and Triton again before its first case
        ctx = mp.start_processes(_worker, args=(world, out_dir, names), nprocs=world, join=False,
                                 start_method="fork")
        deadline = time.monotonic() + DEADLINE_S
        crashed = None
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    crashed = f"world size {world} did not finish within {DEADLINE_S} s (hang?)"
                    break
        except Exception:  # a worker exited with an error
            crashed = traceback.format_exc(limit=1)
        finally:
            for p in ctx.processes:  # only the processes this call started
                if p.is_alive():
                    p.kill()
        per_rank = [json.loads(p.read_text()) if p.exists() else {}
                    for p in (Path(out_dir) / f"rank{r}.json" for r in range(world))]
    outcome: dict[str, str | None] = {}
    for name in names:
        errors = [f"rank {r}: never reached" + (f" ({crashed})" if crashed else "")
                  if name not in res else res[name] for r, res in enumerate(per_rank)]
        errors = [e for e in errors if e is not None]
        outcome[name] = "\n".join(errors) or None
    return outcome
