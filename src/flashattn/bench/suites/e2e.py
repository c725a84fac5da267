"""`e2e`: training a GPT-2-small-shaped decoder end to end, one attention implementation at a time.

Throughput: GPT-2 small (124M parameters; `flashattn.bench.gpt`) trained in bf16 autocast with fused AdamW at
seqlen 1K and 8K (16K tokens a step by default): tokens/s, step time and peak memory per provider, everything
but the attention call identical. Rows have mode "train"; `tflops` counts 6·N + causal attention per token.

Convergence: the same model with a byte-level vocabulary (256) trained for 300 steps on the Python standard
library's own source files (offline, a few MB of real text), with the same seed, initial weights and batch
order for every provider. Rows have mode "converge" and carry the loss curve. Ours is "within noise" of the
reference (sdpa-cudnn) when the gap between the final losses (mean of the last 50 steps) is at most twice the
larger of: the gap between two correct implementations (sdpa-flash vs sdpa-cudnn, the bf16 yardstick), and
the standard error of that final mean from the step-to-step scatter of the reference curve.

The full run is sized for about 3-4 minutes on an H200 (an estimate until measured there; flex's compilation
is the largest single cost); --quick cuts the timed and convergence steps. On the CPU (--device cpu) it runs
a tiny smoke configuration in fp32. Finer control (steps, providers of each part, skipping a part):
`python -m flashattn.bench.suites.e2e --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..case import Grid, canonical_dtype
from ..gpt import GPT, GPT2_SMALL, GPTConfig, attention_impl, train_flops_per_token
from .base import Suite, View, fmt_gib, fmt_ms, fmt_rate

NAME = "e2e"
TOKENS_PER_S = View("tokens_per_s", "tokens/s", fmt_rate)
STEP_MS = View("ms", "step time (ms)", fmt_ms, higher_is_better=False, plot=False)
PEAK_MEM_TOTAL = View(
    "peak_mem_bytes", "peak memory (GiB)", fmt_gib, higher_is_better=False, plot_scale=2**30
)
MODEL_TFLOPS = View("tflops", "model TFLOP/s", fmt_rate, plot=False)


@dataclass
class E2EConfig:
    model: GPTConfig = GPT2_SMALL
    seqlens: tuple[int, ...] = (1024, 8192)
    tokens_per_step: int = 16384
    warmup_steps: int = 3
    timed_steps: int = 10
    providers: tuple[str, ...] = ("flashattn", "sdpa-cudnn", "flex", "naive")
    converge_providers: tuple[str, ...] = ("flashattn", "sdpa-cudnn", "sdpa-flash")
    converge_steps: int = 300
    converge_seqlen: int = 1024
    converge_tokens: int = 16384
    corpus_bytes: int = 16 << 20
    lr: float = 6e-4
    autocast: str | None = "bfloat16"  # None: plain fp32 (the CPU smoke run)
    seed: int = 0
    reference: str = "sdpa-cudnn"
    yardstick: str = "sdpa-flash"
    tail: int = 50  # steps averaged for the final loss

    @classmethod
    def preset(cls, device: torch.device, quick: bool) -> E2EConfig:
        if device.type != "cuda":
            return cls(
                model=GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, max_seqlen=128),
                seqlens=(64, 128),
                tokens_per_step=512,
                warmup_steps=1,
                timed_steps=2,
                providers=("flashattn", "sdpa-math", "naive"),
                converge_providers=("flashattn", "sdpa-math"),
                converge_steps=10 if quick else 30,
                converge_seqlen=64,
                converge_tokens=256,
                corpus_bytes=1 << 20,
                lr=3e-3,
                autocast=None,
                reference="sdpa-math",
                yardstick="",
                tail=5,
            )
        if quick:
            return cls(
                warmup_steps=2,
                timed_steps=5,
                converge_providers=("flashattn", "sdpa-cudnn", "sdpa-flash"),
                converge_steps=120,
                tail=30,
            )
        return cls()


# -- data ----------------------------------------------------------------------------------------------------


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's .py files (sorted paths, site-packages excluded), concatenated as bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if any(part in ("site-packages", "dist-packages", "__pycache__") for part in path.parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(
            f"found only {total} bytes of Python source under {root}; expected a standard library"
        )
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def _batches(corpus: torch.Tensor, batch: int, seqlen: int, steps: int, seed: int):
    """(inputs, targets) windows at random offsets, seeded: every provider sees the same batches."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - seqlen - 1, (batch,), generator=gen)
        rows = torch.stack([corpus[s : s + seqlen + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


# -- training ------------------------------------------------------------------------------------------------


def _build(cfg: E2EConfig, model_cfg: GPTConfig, provider: str, device: torch.device):
    impl = attention_impl(provider)
    torch.manual_seed(cfg.seed)  # identical initial weights for every provider
    model = GPT(model_cfg, impl).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    return impl, model, opt


def _step(model, opt, x, y, autocast: str | None, lr: float | None = None) -> torch.Tensor:
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr
    dtype = getattr(torch, autocast) if autocast else None
    with torch.autocast(x.device.type, dtype=dtype, enabled=autocast is not None):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _base_row(cfg: E2EConfig, provider: str, mode: str, batch: int, seqlen: int) -> dict:
    m = cfg.model
    return {
        "suite": NAME,
        "provider": provider,
        "mode": mode,
        "dtype": canonical_dtype(cfg.autocast or "fp32"),
        "batch": batch,
        "nheads": m.n_head,
        "nheads_k": m.n_head,
        "seqlen_q": seqlen,
        "seqlen_k": seqlen,
        "headdim": m.n_embd // m.n_head,
        "causal": True,
        "error": None,
    }


def measure_throughput(cfg: E2EConfig, provider: str, seqlen: int, device: torch.device) -> dict:
    """One row: warmup steps (compilation, autotuning: first_call_s), then timed steps on a fixed batch."""
    from ..runner import describe_error

    batch = max(1, cfg.tokens_per_step // seqlen)
    row = _base_row(cfg, provider, "train", batch, seqlen)
    row.update(ms=None, tflops=None, tokens_per_s=None, peak_mem_bytes=None, first_call_s=None)
    model_cfg = cfg.model.with_(max_seqlen=max(cfg.model.max_seqlen, seqlen))
    model = opt = None
    try:
        impl, model, opt = _build(cfg, model_cfg, provider, device)
        row["n_params"] = model.num_params()
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        data = torch.randint(0, model_cfg.vocab_size, (batch, seqlen + 1), generator=gen, device=device)
        x, y = data[:, :-1], data[:, 1:]
        impl.prepare(seqlen, device)
        with impl.context():
            _sync(device)
            t0 = time.perf_counter()
            loss = _step(model, opt, x, y, cfg.autocast)
            _sync(device)
            row["first_call_s"] = time.perf_counter() - t0
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"loss is {loss.item()} at the first step")
            for _ in range(cfg.warmup_steps - 1):
                _step(model, opt, x, y, cfg.autocast)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(cfg.timed_steps):
                loss = _step(model, opt, x, y, cfg.autocast)
            _sync(device)
            elapsed = time.perf_counter() - t0
        row["ms"] = elapsed / cfg.timed_steps * 1e3
        row["tokens_per_s"] = batch * seqlen * cfg.timed_steps / elapsed
        row["tflops"] = row["tokens_per_s"] * train_flops_per_token(model_cfg, row["n_params"], seqlen) / 1e12
        row["final_loss"] = loss.item()
        if device.type == "cuda":
            row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as exc:  # noqa: BLE001 - a provider that fails (OOM at 8K, say) is a result
        row["error"] = describe_error(exc)
    finally:
        del model, opt
        _release(device)
    return row


def _lr_at(cfg: E2EConfig, step: int) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to a tenth."""
    warmup = max(1, cfg.converge_steps // 10)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.converge_steps - warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_curve(cfg: E2EConfig, provider: str, corpus: torch.Tensor, device: torch.device) -> dict:
    """One "converge" row with the per-step training loss of `provider` on the byte corpus."""
    from ..runner import describe_error

    seqlen = cfg.converge_seqlen
    batch = max(1, cfg.converge_tokens // seqlen)
    row = _base_row(cfg, provider, "converge", batch, seqlen)
    row.update(steps=cfg.converge_steps, loss_curve=None, wall_s=None)
    model_cfg = cfg.model.with_(vocab_size=256, max_seqlen=max(cfg.model.max_seqlen, seqlen))
    model = opt = None
    try:
        impl, model, opt = _build(cfg, model_cfg, provider, device)
        impl.prepare(seqlen, device)
        losses = []
        t0 = time.perf_counter()
        with impl.context():
            for step, (x, y) in enumerate(_batches(corpus, batch, seqlen, cfg.converge_steps, cfg.seed)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                losses.append(_step(model, opt, x, y, cfg.autocast, lr=_lr_at(cfg, step)))
        row["loss_curve"] = [float(v) for v in torch.stack(losses).float().cpu()]
        row["wall_s"] = time.perf_counter() - t0
        if not all(math.isfinite(v) for v in row["loss_curve"]):
            raise FloatingPointError("non-finite training loss")
    except Exception as exc:  # noqa: BLE001
        row["error"] = describe_error(exc)
    finally:
        del model, opt
        _release(device)
    return row


# -- the verdict ---------------------------------------------------------------------------------------------


def _tail_mean(curve: list[float], n: int) -> float:
    tail = curve[-n:]
    return sum(tail) / len(tail)


def _step_noise(curve: list[float], n: int) -> float:
    """Standard error of the mean of the last n losses, from the scatter of successive steps (the slow
    downward trend cancels in differences; each difference carries twice the per-step variance)."""
    tail = curve[-n:]
    diffs = [b - a for a, b in zip(tail, tail[1:], strict=False)]
    if len(diffs) < 2:
        return 0.0
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return math.sqrt(var / 2) / math.sqrt(len(tail))


def annotate_convergence(rows: list[dict], cfg: E2EConfig) -> None:
    """Adds final_loss to every converge row and, to the others, the comparison with the reference."""
    curves = {r["provider"]: r["loss_curve"] for r in rows if r["mode"] == "converge" and r.get("loss_curve")}
    n = max(1, min(cfg.tail, cfg.converge_steps // 2))
    for r in rows:
        if r["mode"] == "converge" and r.get("loss_curve"):
            r["final_loss"] = _tail_mean(r["loss_curve"], n)
            r["first_loss"] = r["loss_curve"][0]
    ref = curves.get(cfg.reference)
    if ref is None:
        return
    noise = _step_noise(ref, n)
    yard = curves.get(cfg.yardstick)
    yard_gap = abs(_tail_mean(yard, n) - _tail_mean(ref, n)) if yard else None
    allowed = 2 * max(noise, yard_gap or 0.0)
    for r in rows:
        curve = r.get("loss_curve")
        if r["mode"] != "converge" or not curve or r["provider"] == cfg.reference:
            continue
        gap = abs(_tail_mean(curve, n) - _tail_mean(ref, n))
        early = min(10, len(curve))
        r.update(
            reference=cfg.reference,
            final_gap=gap,
            yardstick=cfg.yardstick if yard else None,
            yardstick_gap=yard_gap,
            noise_se=noise,
            allowed_gap=allowed,
            within_noise=gap <= allowed,
            max_step_gap=max(abs(a - b) for a, b in zip(curve, ref, strict=False)),
            early_max_gap=max(abs(a - b) for a, b in zip(curve[:early], ref[:early], strict=False)),
        )


# -- running and reporting -----------------------------------------------------------------------------------


def run_e2e(cfg: E2EConfig, device: torch.device, *, throughput: bool = True, converge: bool = True,
            quiet: bool = False) -> list[dict]:  # fmt: skip
    def say(msg: str) -> None:
        if not quiet:
            print(f"[e2e] {msg}", flush=True)

    rows: list[dict] = []
    if throughput:
        for seqlen in cfg.seqlens:
            for provider in cfg.providers:
                row = measure_throughput(cfg, provider, seqlen, device)
                rows.append(row)
                done = row["error"] or (
                    f"{row['tokens_per_s']:.0f} tok/s, {row['ms']:.1f} ms/step, "
                    f"first step {row['first_call_s']:.1f}s"
                )
                say(f"{provider:<12} N={seqlen:<6} {done}")
    if converge:
        corpus = load_corpus(cfg.corpus_bytes)
        say(f"corpus: {corpus.numel() / 2**20:.1f} MiB of standard-library source")
        for provider in cfg.converge_providers:
            row = train_curve(cfg, provider, corpus, device)
            rows.append(row)
            curve = row.get("loss_curve")
            say(f"{provider:<12} converge " + (row["error"] or f"loss {curve[0]:.3f} -> {curve[-1]:.3f}"))
        annotate_convergence(rows, cfg)
    return rows


def speedups(rows: list[dict], base: str = "flashattn") -> list[str]:
    """'flashattn vs naive at N=1024: 3.1x tokens/s' lines for every provider measured beside ours."""
    lines = []
    train = [r for r in rows if r["mode"] == "train" and not r.get("error")]
    for r in train:
        if r["provider"] == base:
            continue
        mine = next((o for o in train if o["provider"] == base and o["seqlen_q"] == r["seqlen_q"]), None)
        if mine:
            ratio = mine["tokens_per_s"] / r["tokens_per_s"]
            lines.append(f"{base} vs {r['provider']} at N={r['seqlen_q']}: {ratio:.2f}x tokens/s")
    return lines


def convergence_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["mode"] != "converge":
            continue
        if r.get("error"):
            lines.append(f"{r['provider']}: {r['error']}")
        elif "final_gap" in r:
            yard = f", {r['yardstick']} gap {r['yardstick_gap']:.4f}" if r.get("yardstick") else ""
            verdict = "within noise" if r["within_noise"] else "NOT within noise"
            lines.append(
                f"{r['provider']}: final loss {r['final_loss']:.4f}, gap to {r['reference']} "
                f"{r['final_gap']:.4f} (allowed {r['allowed_gap']:.4f} = 2 x max(noise se "
                f"{r['noise_se']:.4f}{yard})): {verdict}"
            )
        elif r.get("final_loss") is not None:
            lines.append(f"{r['provider']} final loss {r['final_loss']:.4f} (first {r['first_loss']:.3f})")
    return lines


def plot_losses(rows: list[dict], path: Path) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    curves = {r["provider"]: r["loss_curve"] for r in rows if r["mode"] == "converge" and r.get("loss_curve")}
    if not curves:
        return None
    ref_name = next((r.get("reference") for r in rows if r.get("reference")), None)
    fig = Figure(figsize=(11, 4))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.86, wspace=0.25)
    ax, ax_gap = fig.subplots(1, 2)
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1)
        if ref_name in curves and name != ref_name:
            gap = [a - b for a, b in zip(curve, curves[ref_name], strict=False)]
            ax_gap.plot(gap, label=f"{name} − {ref_name}", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    ax_gap.axhline(0, color="k", linewidth=0.5)
    ax_gap.set_xlabel("step")
    ax_gap.set_ylabel("loss difference")
    if ax_gap.lines[1:]:
        ax_gap.legend(fontsize="small")
    ax_gap.grid(True, alpha=0.3)
    fig.suptitle("e2e convergence: byte-level GPT on the Python standard library, same seed/init/data")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


_PREAMBLE = (
    "Each step: forward, backward, gradient clipping and a fused AdamW update of the whole model, autocast "
    "as in the dtype column; the attention call is the only difference between providers. Step time is the "
    "mean of the timed steps after warmup (first_call_s in the JSON: the first step, compilation included); "
    "peak memory is torch.cuda.max_memory_allocated over the timed steps (weights, optimizer state and "
    "activations); model TFLOP/s counts 6·N per token plus causal attention. Cells: OOM = out of memory, "
    "err = failed to run (reason below)."
)


def _report(doc: dict, cfg: E2EConfig, out_dir: Path, plots: bool) -> list[Path]:
    from .. import report, results

    out_json = out_dir / f"{NAME}.json"
    results.write(out_json, doc)
    written = [out_json, *report.render(doc, out_dir, plots=plots)]
    extra = ["", "## Speedups", ""] + [f"- {x}" for x in speedups(doc["rows"])]
    # the module's account of the check, with this run's step counts (--quick shortens them)
    method = __doc__.split("\n\n")[2].replace("\n", " ")
    method = method.replace("300 steps", f"{cfg.converge_steps} steps").replace("last 50", f"last {cfg.tail}")
    extra += ["", "## Convergence", "", method, ""]
    extra += [f"- {x}" for x in convergence_lines(doc["rows"])]
    md = out_dir / f"{NAME}.md"
    text = md.read_text()
    # the generic preamble speaks of kernel sweeps (oracle checks, FLOP conventions); say what e2e measured
    start = text.find("TFLOP/s by the FlashAttention convention")
    if start >= 0:
        end = text.find("\n\n", start)
        text = text[:start] + _PREAMBLE + text[end if end >= 0 else len(text) :]
    md.write_text(text + "\n".join(extra) + "\n")
    if plots:
        loss_png = plot_losses(doc["rows"], out_dir / f"{NAME}-loss.png")
        if loss_png:
            written.append(loss_png)
    report.print_tables(doc)
    for line in speedups(doc["rows"]) + convergence_lines(doc["rows"]):
        print(line)
    return written


def _meta(cfg: E2EConfig, device: torch.device, quick: bool) -> dict:
    from .. import env

    meta = env.collect_meta(device)
    config = dataclasses.asdict(cfg)
    meta.update(suite=NAME, providers=list(cfg.providers), modes=["train", "converge"], quick=quick,
                seed=cfg.seed, e2e=config)  # fmt: skip
    return meta


def run(args: argparse.Namespace, device: torch.device) -> int:
    """`flashattn bench --suite e2e`: the presets, with --seqlens, --tokens, --providers, --seed overrides."""
    from .. import env

    cfg = E2EConfig.preset(device, bool(args.quick))
    changes = {}
    if args.seqlens:
        changes["seqlens"] = tuple(args.seqlens)
    if args.tokens:
        changes["tokens_per_step"] = args.tokens
    if args.providers:
        changes["providers"] = tuple(args.providers)
    if args.seed:
        changes["seed"] = args.seed
    cfg = dataclasses.replace(cfg, **changes)
    rows = run_e2e(cfg, device, quiet=args.quiet)
    doc = {"meta": _meta(cfg, device, bool(args.quick)), "rows": rows}
    written = _report(doc, cfg, args.out or env.default_out_dir(device), plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _grid(quick: bool) -> Grid:
    # what `flashattn bench --list` shows; the run itself uses E2EConfig
    return Grid(
        dtype="bf16", seqlens=E2EConfig().seqlens, headdims=(64,), causal=(True,), tokens=16384, nheads=12
    )


SUITE = Suite(
    name=NAME,
    description="GPT-2 small (124M) training in bf16, N 1K and 8K: tokens/s, step time, peak memory; "
    "loss curves on stdlib source vs sdpa",
    grid=_grid,
    providers=E2EConfig().providers,
    modes=("train",),
    device="cuda",
    views=(TOKENS_PER_S, STEP_MS, PEAK_MEM_TOTAL, MODEL_TFLOPS),
    panel_fields=("headdim",),
    run=run,
)


def main(argv: list[str] | None = None) -> int:
    """Every knob of the suite, for runs that must fit a time budget."""
    p = argparse.ArgumentParser(
        prog="python -m flashattn.bench.suites.e2e", description=__doc__.split("\n")[0]
    )
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-converge", action="store_true")
    ints = {"seed", "tokens_per_step", "warmup_steps", "timed_steps", "converge_steps", "converge_seqlen",
            "converge_tokens", "tail"}  # fmt: skip
    for name in sorted(ints):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    p.add_argument("--lr", type=float)
    for name in ("seqlens", "providers", "converge_providers"):
        p.add_argument("--" + name.replace("_", "-"), help="comma-separated")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = E2EConfig.preset(device, args.quick)
    changes = {k: getattr(args, k) for k in (*ints, "lr") if getattr(args, k) is not None}
    if args.seqlens:
        changes["seqlens"] = tuple(int(x) for x in args.seqlens.split(","))
    for name in ("providers", "converge_providers"):
        if getattr(args, name):
            changes[name] = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
    cfg = dataclasses.replace(cfg, **changes)
    rows = run_e2e(cfg, device, throughput=not args.skip_throughput, converge=not args.skip_converge,
                   quiet=args.quiet)  # fmt: skip
    from .. import env

    doc = {"meta": _meta(cfg, device, args.quick), "rows": rows}
    written = _report(doc, cfg, args.out or env.default_out_dir(device), plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
