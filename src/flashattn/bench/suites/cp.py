"""`cp`: context parallelism (flashattn.distributed), measured under torchrun or predicted from one device.

Measured (``torchrun --nproc-per-node W -m flashattn.bench --suite cp``): every rank runs
``context_parallel_attn`` on its shard (ring and Ulysses, zigzag layout), timed over a fixed number of
calls between barriers (the slowest rank's time). Per row: per-rank TFLOP/s (the FLOPs of the whole
problem / W / time), the time of the same local work without communication (``compute_ms``: the ring's
steps run back to back on local blocks; Ulysses' full-sequence attention of its heads), of the
communication alone (``comm_ms``: the same transfers without compute), and the fraction of communication
hidden under compute, ``hidden = (compute_ms + comm_ms − ms) / comm_ms`` (clipped to [0, 1]). Rank 0 also
times ``flash_attn_func`` on the whole problem alone (``single_ms``); ``efficiency = single_ms / (W · ms)``.
Weak scaling rows keep the tokens per rank fixed (global length ``W · s_local``); strong scaling rows keep the
global length fixed.

Predicted (one process, no torchrun; ``--device cpu`` runs a tiny configuration): the same rows for each W of
the preset, from single-device measurements and this model of the ring (two relays, as
flashattn.distributed.ring runs it):

  Rank r's step t is the attention of its queries with the K/V block of rank (r − t) mod W; ``c_r(t)`` is its
  measured time (the step's single-device calls and float32 merges, 0 for a skipped step; timed once per
  distinct shape of work, with local tensors standing in for the other ranks' blocks). With relays of
  lengths a (down) and b (up) and R = max(a, b) rounds, round u computes steps {0} (u = 0), else
  {u if u <= a} ∪ {W − u if u <= b}; C(u) = max_r Σ of its steps' c_r(t) (ranks wait for their neighbours,
  so the slowest rank sets every round). A transfer of n blocks takes X_n = α + n·B / BW, with B the bytes of
  one K/V block (b · s_local · h_k · (d + d_v) · element size) or, backward, D of one block's float32 dK/dV;
  BW is the per-GPU, per-direction link bandwidth and α a fixed latency per round, both ASSUMED
  (defaults: H200 NVLink 4, 900 GB/s bidirectional per GPU = 450 GB/s each way, α = 10 us;
  ``--link-gbps``/``--latency-us`` of ``python -m flashattn.bench.suites.cp`` change them);
  n(u) = [u <= a] + [u <= b] blocks move per round (0 outside 1..R).

    T_fwd = Σ_{u<R} max(C(u), X_{n(u+1)}(B)) + C(R)
    T_bwd = max(C'(0), X_{n(1)}(B)) + Σ_{1<=u<=R} max(C'(u), [u<R]·X_{n(u+1)}(B) + [u>=2]·X_{n(u−1)}(D))
            + X_{n(R)}(D)

  (forward: round u's compute overlaps the transfer of round u+1's blocks; backward: it overlaps the next
  K/V and the previous round's dK/dV accumulators, and the last accumulators return to their owners
  exposed; C' are the steps' backward times). Ulysses: T = X_a2a(q, k, v) + C_local + X_a2a(out) with no
  overlap, an all-to-all of a tensor of L local bytes costing α + (W − 1)/W · L / BW, C_local the measured
  flash_attn_func of the whole sequence with h/W heads; the backward adds the all-to-alls of dout and of
  dq, dk, dv around the measured local backward.

  Rows then report ms = T, compute_ms = Σ_u C(u) (Ulysses: C_local), comm_ms = Σ of the transfer times,
  hidden = 1 − (T − compute_ms) / comm_ms, per-rank TFLOP/s and efficiency = single_ms / (W · T) with
  single_ms measured here. The model ignores link contention beyond one GPU's egress, kernel-launch gaps
  between steps, and how the transport's copies compete with the kernels for memory bandwidth; a measured run
  under torchrun is the check of it. The local copy time of one K/V block (``copy_us``, a device-to-device
  copy) is reported for reference only: it is HBM bandwidth, not the link's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..case import Grid, torch_dtype
from ..flops import attention_flops, tflops
from ..results import KEY_FIELDS
from .base import Suite, View, fmt_ms, fmt_rate

NAME = "cp"
MODES = ("fwd", "fwd+bwd")
KEYS = KEY_FIELDS + ("world", "method", "layout", "kind", "scaling")
EFFICIENCY = View("efficiency", "scaling efficiency (single_ms / (W·ms))", lambda x: f"{x:.2f}", plot=False)
HIDDEN = View("hidden", "communication hidden under compute", lambda x: f"{x:.2f}", plot=False)
RANK_TFLOPS = View("tflops", "TFLOP/s per rank", fmt_rate, plot=False)


@dataclass
class CPConfig:
    dtype: str = "bf16"
    batch: int = 1
    nheads: int = 16
    nheads_k: int = 8
    headdim: int = 128
    causal: tuple[bool, ...] = (True, False)
    layout: str = "zigzag"
    methods: tuple[str, ...] = ("ring", "ulysses")
    worlds: tuple[int, ...] = (2, 4, 8)  # predicted mode; measured mode uses the launched world
    weak_local: tuple[int, ...] = (4096, 16384)  # tokens per rank
    strong_global: tuple[int, ...] = (32768, 131072)  # tokens in all
    link_gbps: float = 450.0
    latency_us: float = 10.0
    warmup: int = 3
    iters: int = 10

    @classmethod
    def preset(cls, device: torch.device, quick: bool) -> CPConfig:
        if device.type != "cuda":
            return cls(dtype="fp32", nheads=2, nheads_k=2, headdim=16, causal=(True,), worlds=(2,),
                       weak_local=(32,), strong_global=(64,), warmup=1, iters=2)
        if quick:
            return cls(causal=(True,), worlds=(2, 8), weak_local=(8192,), strong_global=(65536,), iters=5)
        return cls()

    def shapes(self, world: int):
        """(scaling, global length) pairs at this world size."""
        out = [("weak", world * s) for s in self.weak_local]
        return out + [("strong", s) for s in self.strong_global if s % (2 * world) == 0]


# -- timing --------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _local_ms(fn, device, cfg: CPConfig) -> float:
    """Median time of fn alone on this device."""
    from ..timing import TimerConfig, median_ms

    if device.type == "cuda":
        return median_ms(fn, device, TimerConfig())
    return median_ms(fn, device, TimerConfig(cpu_min_reps=cfg.iters, cpu_max_reps=cfg.iters))


def _collective_ms(fn, device, cfg: CPConfig, pg) -> float:
    """Mean time of fn over cfg.iters calls that every rank makes together (a fixed count, so the ranks'
    collectives pair up); the slowest rank's."""
    import torch.distributed as dist

    for _ in range(cfg.warmup):
        fn()
    _sync(device)
    dist.barrier(group=pg)
    t0 = time.perf_counter()
    for _ in range(cfg.iters):
        fn()
    _sync(device)
    ms = torch.tensor([(time.perf_counter() - t0) / cfg.iters * 1e3], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=pg)
    return float(ms)


def _inputs(cfg: CPConfig, seqlen: int, heads: int, heads_k: int, device, grad: bool):
    dtype = torch_dtype(cfg.dtype)
    shape = (cfg.batch, seqlen)
    q = torch.randn(*shape, heads, cfg.headdim, device=device, dtype=dtype)
    k = torch.randn(*shape, heads_k, cfg.headdim, device=device, dtype=dtype)
    v = torch.randn(*shape, heads_k, cfg.headdim, device=device, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _pass(fn, mode: str, q):
    """fn() for fwd; fn() and its backward for fwd+bwd."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn()
        return run
    g = torch.randn_like(q)

    def run_bwd():
        fn().backward(g)
    return run_bwd


def _single_ms(cfg: CPConfig, seqlen: int, causal: bool, mode: str, device) -> float:
    from flashattn import flash_attn_func

    q, k, v = _inputs(cfg, seqlen, cfg.nheads, cfg.nheads_k, device, grad=mode != "fwd")
    return _local_ms(_pass(lambda: flash_attn_func(q, k, v, causal=causal), mode, q), device, cfg)


def _row(cfg: CPConfig, *, method, mode, world, seqlen, causal, kind, scaling, ms, compute_ms, comm_ms,
         single_ms, copy_us=None, error=None) -> dict:
    flops = attention_flops(cfg.batch, cfg.nheads, seqlen, seqlen, cfg.headdim, causal, mode)
    hidden = None
    if ms is not None and comm_ms:
        hidden = min(1.0, max(0.0, (compute_ms + comm_ms - ms) / comm_ms))
    return dict(
        suite=NAME, provider=f"cp-{method}", mode=mode,
        dtype=str(torch_dtype(cfg.dtype)).removeprefix("torch."),
        batch=cfg.batch, nheads=cfg.nheads, nheads_k=cfg.nheads_k, seqlen_q=seqlen, seqlen_k=seqlen,
        headdim=cfg.headdim, causal=causal, world=world, method=method, layout=cfg.layout, kind=kind,
        scaling=scaling, ms=ms, tflops=tflops(flops / world, ms), compute_ms=compute_ms, comm_ms=comm_ms,
        hidden=hidden, single_ms=single_ms,
        efficiency=(single_ms / (world * ms)) if ms and single_ms else None,
        copy_us=copy_us, error=error,
    )


# -- the model (one device) ----------------------------------------------------------------------------------
def _xfer_ms(cfg: CPConfig, nbytes: float) -> float:
    return cfg.latency_us * 1e-3 + nbytes / (cfg.link_gbps * 1e9) * 1e3


def ring_model(c_fwd, c_bwd, down: int, up: int, world: int, kv_bytes: int, dkv_bytes: int, cfg: CPConfig):
    """(T_fwd, T_bwd, compute_fwd, compute_bwd, comm_fwd, comm_bwd) in ms from the per-rank step times
    ``c_fwd[r][t]`` / ``c_bwd[r][t]``: the module docstring's formulas."""
    rounds = max(down, up)

    def steps(u):
        return [0] if u == 0 else [t for t, on in ((u, u <= down), (world - u, u <= up)) if on]

    def n(u):
        return (u <= down) + (u <= up) if 1 <= u <= rounds else 0

    def c(table, u):
        return max(sum(table[r][t] for t in steps(u)) for r in range(world))

    def x(nblocks, nbytes):
        return _xfer_ms(cfg, nblocks * nbytes) if nblocks else 0.0

    t_fwd = sum(max(c(c_fwd, u), x(n(u + 1), kv_bytes)) for u in range(rounds)) + c(c_fwd, rounds)
    comm_fwd = sum(x(n(u), kv_bytes) for u in range(1, rounds + 1))
    t_bwd = max(c(c_bwd, 0), x(n(1), kv_bytes))
    for u in range(1, rounds + 1):
        inflight = ((x(n(u + 1), kv_bytes) if u < rounds else 0.0)
                    + (x(n(u - 1), dkv_bytes) if u >= 2 else 0.0))
        t_bwd += max(c(c_bwd, u), inflight)
    t_bwd += x(n(rounds), dkv_bytes)
    comm_bwd = comm_fwd + sum(x(n(u), dkv_bytes) for u in range(1, rounds + 1))
    compute = [sum(c(table, u) for u in range(rounds + 1)) for table in (c_fwd, c_bwd)]
    return t_fwd, t_bwd, compute[0], compute[1], comm_fwd, comm_bwd


def _predict_ring(cfg: CPConfig, world: int, seqlen: int, causal: bool, device) -> dict[str, tuple]:
    """mode -> (ms, compute_ms, comm_ms, copy_us) predicted for the ring."""
    from flashattn.distributed.steps import local_steps

    q, k, v = _inputs(cfg, seqlen // world, cfg.nheads, cfg.nheads_k, device, grad=False)
    timed: dict = {}  # (signature, direction) -> ms: equal work, timed once
    c_fwd, c_bwd, plan = [], [], None
    for r in range(world):
        plan = local_steps(q, k, v, world=world, rank=r, layout=cfg.layout, causal=causal)
        row_f, row_b = [], []
        for t in range(world):
            sig = plan.signature(t)
            for direction, row, fn in (("f", row_f, plan.forward), ("b", row_b, plan.backward)):
                if sig and (sig, direction) not in timed:
                    timed[sig, direction] = _local_ms(lambda fn=fn, t=t: fn(t), device, cfg)
                row.append(timed[sig, direction] if sig else 0.0)
        c_fwd.append(row_f)
        c_bwd.append(row_b)
    t_f, t_b, cf, cb, xf, xb = ring_model(c_fwd, c_bwd, plan.down, plan.up, world, plan.kv_bytes,
                                          plan.dkv_bytes, cfg)
    block = torch.empty(plan.kv_bytes, dtype=torch.uint8, device=device)
    copy_us = _local_ms(lambda: block.clone(), device, cfg) * 1e3
    return {"fwd": (t_f, cf, xf, copy_us), "fwd+bwd": (t_f + t_b, cf + cb, xf + xb, copy_us)}


def _predict_ulysses(cfg: CPConfig, world: int, seqlen: int, causal: bool, device) -> dict[str, tuple]:
    from flashattn import flash_attn_func
    from flashattn.distributed.ulysses import kv_repeats

    if cfg.nheads % world:
        return {}
    hk = cfg.nheads_k * kv_repeats(cfg.nheads_k, world)
    elt = torch_dtype(cfg.dtype).itemsize
    local = cfg.batch * (seqlen // world) * cfg.headdim * elt  # bytes per head of a sequence shard

    def a2a(*heads):
        return sum(_xfer_ms(cfg, (world - 1) / world * local * h) for h in heads)

    out = {}
    for mode in MODES:
        q, k, v = _inputs(cfg, seqlen, cfg.nheads // world, hk // world, device, grad=mode != "fwd")
        call = _pass(lambda q=q, k=k, v=v: flash_attn_func(q, k, v, causal=causal), mode, q)
        comp = _local_ms(call, device, cfg)
        comm = a2a(cfg.nheads, hk, hk, cfg.nheads)
        if mode != "fwd":
            comm += a2a(cfg.nheads, cfg.nheads, hk, hk)  # dout in; dq, dk, dv out
        out[mode] = (comp + comm, comp, comm, None)
    return out


def predict(cfg: CPConfig, device, quiet: bool = False) -> list[dict]:
    rows = []
    for world in cfg.worlds:
        for scaling, seqlen in cfg.shapes(world):
            for causal in cfg.causal:
                single = {mode: _single_ms(cfg, seqlen, causal, mode, device) for mode in MODES}
                for method in cfg.methods:
                    fn = _predict_ring if method == "ring" else _predict_ulysses
                    for mode, (ms, comp, comm, copy_us) in fn(cfg, world, seqlen, causal, device).items():
                        rows.append(_row(cfg, method=method, mode=mode, world=world, seqlen=seqlen,
                                         causal=causal, kind="predicted", scaling=scaling, ms=ms,
                                         compute_ms=comp, comm_ms=comm, single_ms=single[mode],
                                         copy_us=copy_us))
                if not quiet:
                    print(f"cp: predicted W={world} N={seqlen} causal={causal}", flush=True)
    return rows


# -- measured (under torchrun) ------------------------------------------------------------------------------
def _comm_only(method: str, q, k, v, pg, world: int, causal: bool, cfg: CPConfig, mode: str):
    """The call's transfers without its compute (for fwd+bwd, the backward's transfers too)."""
    if method == "ulysses":
        from flashattn.distributed.ulysses import heads_to_seq, kv_repeats, seq_to_heads

        rep = kv_repeats(k.shape[2], world)
        kk, vv = (x.repeat_interleave(rep, dim=2) for x in (k, v)) if rep > 1 else (k, v)
        # forward: q, k, v to head shards and the output back; backward: dout in, dq, dk, dv back
        ins, outs = [q, kk, vv], [q]
        if mode != "fwd":
            ins, outs = ins + [q], outs + [q, kk, vv]

        def run():
            for x in ins:
                seq_to_heads(x, pg, world).contiguous()
            for x in outs:
                heads_to_seq(seq_to_heads(x, pg, world), pg, world).contiguous()
        return run
    import torch.distributed as dist

    from flashattn.distributed._comm import Ring
    from flashattn.distributed.steps import local_steps

    plan = local_steps(q, k, v, world=world, rank=dist.get_rank(pg), layout=cfg.layout, causal=causal)
    ring, kv = Ring(pg), [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in kv]
    legs = [(s, n) for s, n in ((1, plan.down), (-1, plan.up)) if n]

    def relay(with_dkv: bool):
        held, pending_dkv = [kv for _ in legs], None
        for u in range(plan.rounds + 1):
            pending = ring.exchange([(held[i], s, i) for i, (s, n) in enumerate(legs) if u < n])
            if with_dkv and u >= 1:
                if pending_dkv is not None:
                    pending_dkv.wait()
                pending_dkv = ring.exchange([(dkv, s if u < n else -s * n, 2 + i)
                                             for i, (s, n) in enumerate(legs) if u <= n])
            if pending is not None:
                got = iter(pending.wait())
                held = [next(got) if u < n else held[i] for i, (_, n) in enumerate(legs)]
        if pending_dkv is not None:
            pending_dkv.wait()

    def run_ring():
        relay(False)
        if mode != "fwd":
            relay(True)
    return run_ring


def _compute_only(method: str, q, k, v, world: int, rank: int, causal: bool, cfg: CPConfig, mode: str):
    if method == "ulysses":
        from flashattn import flash_attn_func
        from flashattn.distributed.ulysses import kv_repeats

        hk = k.shape[2] * kv_repeats(k.shape[2], world)
        qf, kf, vf = _inputs(cfg, q.shape[1] * world, q.shape[2] // world, hk // world, q.device,
                             mode != "fwd")
        return _pass(lambda: flash_attn_func(qf, kf, vf, causal=causal), mode, qf)
    from flashattn.distributed.steps import local_steps

    plan = local_steps(q.detach(), k.detach(), v.detach(), world=world, rank=rank, layout=cfg.layout,
                       causal=causal)
    work = [t for t in range(world) if plan.signature(t)]

    def run():
        for t in work:
            plan.forward(t)
        if mode != "fwd":
            for t in work:
                plan.backward(t)
    return run


def measure(cfg: CPConfig, device, pg=None, quiet: bool = False) -> list[dict]:
    """Rows of this launched world (every rank calls it; rank 0's list is the one to report)."""
    import torch.distributed as dist

    from flashattn.distributed import context_parallel_attn

    pg = pg if pg is not None else dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    rows = []
    for scaling, seqlen in cfg.shapes(world):
        for causal in cfg.causal:
            for mode in MODES:
                single = None
                if rank == 0:
                    single = _single_ms(cfg, seqlen, causal, mode, device)
                dist.barrier(group=pg)
                for method in cfg.methods:
                    if method == "ulysses" and cfg.nheads % world:
                        continue
                    q, k, v = _inputs(cfg, seqlen // world, cfg.nheads, cfg.nheads_k, device, mode != "fwd")

                    def call(q=q, k=k, v=v, method=method, causal=causal):
                        return context_parallel_attn(q, k, v, pg, method=method, layout=cfg.layout,
                                                     causal=causal, check_shards=False)
                    total = _collective_ms(_pass(call, mode, q), device, cfg, pg)
                    comm = _collective_ms(_comm_only(method, q.detach(), k.detach(), v.detach(), pg, world,
                                                     causal, cfg, mode), device, cfg, pg)
                    local = _compute_only(method, q, k, v, world, rank, causal, cfg, mode)
                    comp = _local_ms(local, device, cfg)
                    comp_t = torch.tensor([comp], dtype=torch.float64, device=device)
                    dist.all_reduce(comp_t, op=dist.ReduceOp.MAX, group=pg)
                    rows.append(_row(cfg, method=method, mode=mode, world=world, seqlen=seqlen, causal=causal,
                                     kind="measured", scaling=scaling, ms=total, compute_ms=float(comp_t),
                                     comm_ms=comm, single_ms=single))
                if not quiet and rank == 0:
                    print(f"cp: measured W={world} N={seqlen} causal={causal} {mode}", flush=True)
    return rows


# -- report -------------------------------------------------------------------------------------------------
def _fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _rate(x) -> str:
    return "-" if x is None else fmt_rate(x)


def scaling_tables(rows: list[dict]) -> list[str]:
    """Markdown: for weak and strong scaling, per (kind, method, mode, causal) a table of the length against
    the world sizes: per-rank TFLOP/s · efficiency · hidden fraction."""
    lines = []
    for scaling, label, size in (("weak", "Weak scaling (tokens per rank fixed)", lambda r: r["seqlen_q"] //
                                  r["world"]),
                                 ("strong", "Strong scaling (global length fixed)", lambda r: r["seqlen_q"])):
        mine = [r for r in rows if r.get("scaling") == scaling]
        groups = sorted({(r["kind"], r["method"], r["mode"], r["causal"]) for r in mine}, key=str)
        for kind, method, mode, causal in groups:
            sel = [r for r in mine if (r["kind"], r["method"], r["mode"], r["causal"]) == (kind, method, mode,
                                                                                        causal)]
            worlds = sorted({r["world"] for r in sel})
            sizes = sorted({size(r) for r in sel})
            lines += [f"## {label}: {kind}, {method}, {mode}, {'causal' if causal else 'full'}", "",
                      "Cells: TFLOP/s per rank · efficiency · hidden fraction of communication", "",
                      "| tokens " + ("per rank" if scaling == "weak" else "in all") + " | "
                      + " | ".join(f"W={w}" for w in worlds) + " |", "|---" * (len(worlds) + 1) + "|"]
            for s in sizes:
                cells = []
                for w in worlds:
                    r = next((x for x in sel if x["world"] == w and size(x) == s), None)
                    cells.append("-" if r is None else f"{_rate(r['tflops'])} · {_fmt(r['efficiency'])} · "
                                 f"{_fmt(r['hidden'])}")
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def write_report(rows: list[dict], cfg: CPConfig, device, out_dir: Path, kind: str) -> list[Path]:
    from .. import env, results

    meta = env.collect_meta(device)
    meta.update(suite=NAME, kind=kind, cp=dataclasses.asdict(cfg))
    out_json = out_dir / f"{NAME}.json"
    results.write(out_json, {"meta": meta, "rows": rows})
    # how the rows were obtained: the docstring's paragraph on the mode (predicted: the whole model)
    start = __doc__.index("Predicted (" if kind == "predicted" else "Measured (")
    model = __doc__[start:] if kind == "predicted" else __doc__[start:__doc__.index("\n\n", start)]
    text = [f"# flashattn bench: {NAME} suite ({kind})", "", model, "",
            f"Assumed link: {cfg.link_gbps:g} GB/s per direction, {cfg.latency_us:g} us per round"
            if kind == "predicted" else f"{meta.get('gpu')}", "", *scaling_tables(rows)]
    md = out_dir / f"{NAME}.md"
    md.write_text("\n".join(text) + "\n")
    print("\n".join(scaling_tables(rows)))
    return [out_json, md]


def _init_from_env(device):
    """The default process group under torchrun (WORLD_SIZE > 1), or None for a single process."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.group.WORLD


def run_suite(cfg: CPConfig, device, out_dir: Path, quiet: bool = False) -> int:
    """Measured rows under an initialised process group of more than one rank, predicted rows otherwise;
    rank 0 writes ``cp.json`` and ``cp.md`` to out_dir."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        rows = measure(cfg, device, quiet=quiet)
        if dist.get_rank() == 0:
            write_report(rows, cfg, device, out_dir, "measured")
        return 0
    write_report(predict(cfg, device, quiet), cfg, device, out_dir, "predicted")
    return 0


def run(args: argparse.Namespace, device: torch.device) -> int:
    """`flashattn bench --suite cp`: measured under torchrun, predicted otherwise; --seqlens sets the strong
    scaling lengths, --dtype / --headdims / --nheads / --nheads-k / --batch / --causal override the preset."""
    from .. import env

    _init_from_env(device)
    cfg = CPConfig.preset(device, bool(args.quick))
    changes = {}
    for field, value in (("dtype", args.dtype), ("batch", args.batch), ("nheads", args.nheads),
                         ("nheads_k", args.nheads_k)):
        if value is not None:
            changes[field] = value
    if args.headdims:
        changes["headdim"] = args.headdims[0]
    if args.seqlens:
        changes["strong_global"] = tuple(args.seqlens)
    if args.causal:
        changes["causal"] = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    if "nheads" in changes and "nheads_k" not in changes:
        changes["nheads_k"] = changes["nheads"]
    cfg = dataclasses.replace(cfg, **changes)
    return run_suite(cfg, device, args.out or env.default_out_dir(device), quiet=args.quiet)


def _grid(quick: bool) -> Grid:
    # what `flashattn bench --list` shows; the run itself uses CPConfig
    cfg = CPConfig()
    return Grid(dtype=cfg.dtype, seqlens=cfg.strong_global, headdims=(cfg.headdim,), causal=cfg.causal,
                batch=cfg.batch, nheads=cfg.nheads)


SUITE = Suite(
    name=NAME,
    description="context parallelism: ring and Ulysses under torchrun (per-rank TFLOP/s, communication "
    "hidden, weak/strong scaling), or predicted from one GPU's step times and an assumed link",
    grid=_grid,
    providers=("cp-ring", "cp-ulysses"),
    modes=MODES,
    views=(RANK_TFLOPS, EFFICIENCY, HIDDEN, View("ms", "ms", fmt_ms, higher_is_better=False, plot=False)),
    key_fields=KEYS,
    run=run,
)


def main(argv: list[str] | None = None) -> int:
    """Every knob of the preset (link model included)."""
    p = argparse.ArgumentParser(prog="python -m flashattn.bench.suites.cp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--link-gbps", type=float)
    p.add_argument("--latency-us", type=float)
    for name in ("worlds", "weak_local", "strong_global", "methods"):
        p.add_argument("--" + name.replace("_", "-"), help="comma-separated")
    args = p.parse_args(argv)
    from .. import env

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _init_from_env(device)
    cfg = CPConfig.preset(device, args.quick)
    changes = {k: getattr(args, k) for k in ("link_gbps", "latency_us") if getattr(args, k) is not None}
    for name in ("worlds", "weak_local", "strong_global"):
        if getattr(args, name):
            changes[name] = tuple(int(x) for x in getattr(args, name).split(","))
    if args.methods:
        changes["methods"] = tuple(x.strip() for x in args.methods.split(","))
    cfg = dataclasses.replace(cfg, **changes)
    return run_suite(cfg, device, args.out or env.default_out_dir(device), quiet=args.quiet)


if __name__ == "__main__":
    raise SystemExit(main())
