"""`generate`: Hugging Face `generate` end to end, our attention against SDPA, tokens per second.

A Llama-style decoder built from a config with random weights (no download): 8 layers, hidden 2048, 16
query / 4 KV heads of 128 (GQA), SwiGLU MLP, vocabulary 32000, bf16; one model, its attention switched
between providers (`attn_implementation`): ours as registered by flashattn.integrations.transformers
("fa_triton") and transformers' "sdpa". Greedy decoding of `new_tokens` tokens (no early stop) after a
random prompt of 1K or 8K tokens, batch 1 and 16, with an all-real attention mask as a tokenizer gives it:
  eager          the default dynamic cache, no compilation (most research code, HF pipelines);
  static-graph   cache_implementation="static" with transformers' compiled decoding step
                 (CompileConfig(mode="reduce-overhead"): torch.compile and CUDA graphs).
Each configuration runs once to warm up (compiling), then `repeats` timed runs: the median.

Rows (mode = the cache setup, seqlen_q = the prompt length): `tokens_per_s`, the generated tokens over the
whole call (prefill included); `decode_tokens_per_s`, the tokens after the first over the time after the
first (the call's time less a one-token call's); `ms`, the call; `prefill_ms`, the one-token call.

On the CPU (--device cpu) a tiny model, short prompts and a few tokens, fp32, eager and static caches
without compilation: the pipeline's smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..case import Grid, canonical_dtype
from .base import Suite, View, fmt_ms, fmt_rate

NAME = "generate"
OURS, SDPA = "flashattn", "sdpa"
TOKENS_PER_S = View("tokens_per_s", "generated tokens/s (prefill included)", fmt_rate)
DECODE_TOKENS_PER_S = View("decode_tokens_per_s", "decode tokens/s (after the first)", fmt_rate)
CALL_MS = View("ms", "generate call (ms)", fmt_ms, higher_is_better=False, plot=False)
MODES = ("eager", "static-graph")


@dataclass
class GenerateConfig:
    hidden: int = 2048
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 5632
    vocab: int = 32000
    batches: tuple[int, ...] = (1, 16)
    prompts: tuple[int, ...] = (1024, 8192)
    new_tokens: int = 128
    modes: tuple[str, ...] = MODES
    providers: tuple[str, ...] = (OURS, SDPA)
    repeats: int = 3
    dtype: str = "bfloat16"
    compile_graphs: bool = True  # static-graph compiles the decoding step (CUDA graphs); off on the CPU
    seed: int = 0

    @classmethod
    def preset(cls, device: torch.device, quick: bool) -> GenerateConfig:
        if device.type != "cuda":
            return cls(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=96, vocab=96, batches=(1, 2),
                       prompts=(16,), new_tokens=4, repeats=1, dtype="float32", compile_graphs=False)
        if quick:
            return cls(batches=(1, 16), prompts=(1024,), new_tokens=32, repeats=2)
        return cls()


def build_model(cfg: GenerateConfig, device: torch.device):
    """The random-weight Llama-style model, on `device` in cfg.dtype, in eval mode."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(cfg.prompts) + cfg.new_tokens + 1,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=getattr(torch, cfg.dtype)).eval()


def _implementation(provider: str) -> str:
    if provider == OURS:
        from ...integrations.transformers import register

        return register()
    if provider == SDPA:
        return "sdpa"
    raise ValueError(f"unknown provider {provider!r}; expected {OURS!r} or {SDPA!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate_kwargs(cfg: GenerateConfig, mode: str, new_tokens: int) -> dict:
    from transformers import CompileConfig

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode == "eager":
        kwargs["disable_compile"] = True
    elif cfg.compile_graphs:
        kwargs.update(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    else:
        kwargs.update(cache_implementation="static", disable_compile=True)
    return kwargs


def _timed(model, ids, mask, kwargs, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t0
    if out.shape[1] != ids.shape[1] + kwargs["max_new_tokens"]:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, expected "
                           f"{kwargs['max_new_tokens']}")
    return seconds


def measure(model, cfg: GenerateConfig, provider: str, mode: str, batch: int, prompt: int,
            device: torch.device) -> dict:
    """One row: a warm-up call, then `repeats` timed calls of new_tokens and of one token."""
    from ..runner import describe_error

    row = {
        "suite": NAME, "provider": provider, "mode": mode, "dtype": canonical_dtype(cfg.dtype),
        "batch": batch, "nheads": cfg.heads, "nheads_k": cfg.kv_heads, "seqlen_q": prompt, "seqlen_k": prompt,
        "headdim": cfg.hidden // cfg.heads, "causal": True, "new_tokens": cfg.new_tokens, "error": None,
        "tokens_per_s": None, "decode_tokens_per_s": None, "ms": None, "prefill_ms": None,
    }  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(cfg.seed + prompt)
        ids = torch.randint(1, cfg.vocab, (batch, prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        full = _generate_kwargs(cfg, mode, cfg.new_tokens)
        one = _generate_kwargs(cfg, mode, 1)
        _timed(model, ids, mask, full, device)  # compiles, fills the caches
        _timed(model, ids, mask, one, device)
        total = statistics.median(_timed(model, ids, mask, full, device) for _ in range(cfg.repeats))
        first = statistics.median(_timed(model, ids, mask, one, device) for _ in range(cfg.repeats))
        row.update(ms=total * 1e3, prefill_ms=first * 1e3, tokens_per_s=batch * cfg.new_tokens / total)
        if total > first and cfg.new_tokens > 1:
            row["decode_tokens_per_s"] = batch * (cfg.new_tokens - 1) / (total - first)
    except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
        row["error"] = describe_error(exc)
    return row


def run_generate(cfg: GenerateConfig, device: torch.device, *, quiet: bool = False) -> list[dict]:
    rows = []
    model = build_model(cfg, device)
    for provider in cfg.providers:
        model.set_attn_implementation(_implementation(provider))
        if hasattr(model, "_compiled_call"):  # traced with the previous provider's attention
            del model._compiled_call
        torch._dynamo.reset()
        for mode in cfg.modes:
            for prompt in cfg.prompts:
                for batch in cfg.batches:
                    row = measure(model, cfg, provider, mode, batch, prompt, device)
                    rows.append(row)
                    if not quiet:
                        done = row["error"] or (f"{row['tokens_per_s']:.0f} tok/s ({row['ms']:.0f} ms, "
                                                f"prefill {row['prefill_ms']:.0f} ms)")
                        print(f"[generate] {provider:<9} {mode:<12} b={batch:<3} prompt={prompt:<5} {done}",
                              flush=True)
                    gc.collect()
    return rows


def speedups(rows: list[dict]) -> list[str]:
    """'eager b=1 prompt=1024: flashattn / sdpa = 1.08x tokens/s' lines."""
    lines = []
    ok = {(r["provider"], r["mode"], r["batch"], r["seqlen_q"]): r for r in rows if not r.get("error")}
    for (provider, mode, batch, prompt), r in ok.items():
        other = ok.get((SDPA, mode, batch, prompt))
        if provider == OURS and other:
            ratio = r["tokens_per_s"] / other["tokens_per_s"]
            lines.append(f"{mode} b={batch} prompt={prompt}: {OURS} / {SDPA} = {ratio:.2f}x tokens/s")
    return lines


def _meta(cfg: GenerateConfig, device: torch.device, quick: bool) -> dict:
    from .. import env

    meta = env.collect_meta(device)
    meta.update(suite=NAME, providers=list(cfg.providers), modes=list(cfg.modes), quick=quick, seed=cfg.seed,
                generate=dataclasses.asdict(cfg))  # fmt: skip
    return meta


def report(doc: dict, out_dir: Path, plots: bool) -> list[Path]:
    from .. import report as report_mod
    from .. import results

    out_json = out_dir / f"{NAME}.json"
    results.write(out_json, doc)
    written = [out_json, *report_mod.render(doc, out_dir, plots=plots)]
    md = out_dir / f"{NAME}.md"
    md.write_text(md.read_text() + "\n## Speedups\n\n" + "".join(f"- {x}\n" for x in speedups(doc["rows"])))
    report_mod.print_tables(doc)
    for line in speedups(doc["rows"]):
        print(line)
    return written


def run(args: argparse.Namespace, device: torch.device) -> int:
    """`flashattn bench --suite generate`: the presets, with --batch, --seqlens (prompts), --providers,
    --modes (eager, static-graph) overrides."""
    from .. import env

    cfg = GenerateConfig.preset(device, bool(args.quick))
    changes = {}
    if getattr(args, "seqlens", None):
        changes["prompts"] = tuple(args.seqlens)
    if getattr(args, "batch", None):
        changes["batches"] = (args.batch,)
    if getattr(args, "providers", None):
        changes["providers"] = tuple(args.providers)
    if getattr(args, "modes", None):
        changes["modes"] = tuple(args.modes)
    if getattr(args, "seed", None):
        changes["seed"] = args.seed
    cfg = dataclasses.replace(cfg, **changes)
    rows = run_generate(cfg, device, quiet=args.quiet)
    doc = {"meta": _meta(cfg, device, bool(args.quick)), "rows": rows}
    written = report(doc, args.out or env.default_out_dir(device), plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _grid(quick: bool) -> Grid:
    # what `flashattn bench --list` shows; the run itself uses GenerateConfig
    cfg = GenerateConfig()
    return Grid(dtype="bf16", seqlens=cfg.prompts, headdims=(cfg.hidden // cfg.heads,), causal=(True,),
                batch=16, nheads=cfg.heads, nheads_k=cfg.kv_heads)


SUITE = Suite(
    name=NAME,
    description="Hugging Face generate on an 8-layer GQA Llama (random weights), bf16, prompts 1K and 8K, "
    "batch 1 and 16, dynamic cache eager and static cache with CUDA graphs: tokens/s, ours vs sdpa",
    grid=_grid,
    providers=GenerateConfig().providers,
    modes=MODES,
    device="cuda",
    views=(TOKENS_PER_S, DECODE_TOKENS_PER_S, CALL_MS),
    x_field="seqlen_q",
    panel_fields=("mode", "batch"),
    baseline=OURS,
    run=run,
)


def main(argv: list[str] | None = None) -> int:
    """Every knob of the suite, for runs that must fit a time budget."""
    p = argparse.ArgumentParser(prog="python -m flashattn.bench.suites.generate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    for name in ("layers", "new_tokens", "repeats", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int)
    for name in ("batches", "prompts", "modes", "providers"):
        p.add_argument("--" + name, help="comma-separated")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = GenerateConfig.preset(device, args.quick)
    changes = {k: getattr(args, k) for k in ("layers", "new_tokens", "repeats", "seed")
               if getattr(args, k) is not None}
    for name, kind in (("batches", int), ("prompts", int), ("modes", str), ("providers", str)):
        if getattr(args, name):
            changes[name] = tuple(kind(x.strip()) for x in getattr(args, name).split(",") if x.strip())
    cfg = dataclasses.replace(cfg, **changes)
    rows = run_generate(cfg, device, quiet=args.quiet)
    from .. import env

    doc = {"meta": _meta(cfg, device, args.quick), "rows": rows}
    written = report(doc, args.out or env.default_out_dir(device), plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
