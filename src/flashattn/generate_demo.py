"""Greedy generation with a paged KV cache that grows while decoding: flash_attn_with_kvcache vs SDPA.

A small decoder-only transformer with random weights (RMSNorm, GQA attention with rotary embeddings,
SwiGLU MLP) generates from a batch of random prompts of different lengths, twice:

  ours  a paged cache: a pool of pages per layer, a block table per sequence, pages handed out from a free
        list as sequences grow. Prefill is one causal flash_attn_with_kvcache call per prompt; every decode
        step of every layer is one run of a DecodePlan made once for the batch, which rotates and appends
        the new k/v and attends in one kernel launch;
  sdpa  the same model with a contiguous cache, rotary in torch and scaled_dot_product_attention.

It prints the tokens/s of both and checks that they agree. Free-running greedy decoding amplifies any
rounding difference at a near-tie (two logits within bf16 noise), after which the continuations differ;
so the check is teacher-forced: the SDPA model reads ours' whole output in one causal pass, and at every
step its argmax must be ours' token, or else the two best logits must be within `--tie` of each other.

    python -m flashattn.generate_demo                 # GPU: bf16, batch 8, 256 new tokens
    python -m flashattn.generate_demo --device cpu    # CPU: fp32, the torch backend, a short run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import DecodePlan, config
from flashattn.kvcache import flash_attn_with_kvcache


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 4096
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn: int = 1408
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Model:
    """Weights and the forward pass; attention is a callable so both implementations share the rest."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device, dtype, seed: int = 0):
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape, std=0.02):
            return (torch.randn(*shape, generator=g) * std).to(device=device, dtype=dtype)

        d, hd = cfg.d_model, cfg.head_dim
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
        self.embed = w(cfg.vocab, d, std=1.0)
        self.layers = [
            dict(ln1=torch.ones(d, device=device, dtype=dtype), wqkv=w(d, qkv), wo=w(d, d),
                 ln2=torch.ones(d, device=device, dtype=dtype), w1=w(d, cfg.ffn), w3=w(d, cfg.ffn),
                 w2=w(cfg.ffn, d))
            for _ in range(cfg.n_layers)
        ]
        self.ln_f = torch.ones(d, device=device, dtype=dtype)
        self.lm_head = w(d, cfg.vocab, std=1.0 / math.sqrt(d))
        inv = 1.0 / cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.cos = freqs.cos().to(device=device, dtype=dtype)  # (max_positions, hd / 2)
        self.sin = freqs.sin().to(device=device, dtype=dtype)

    def forward(self, tokens, attention):
        """tokens (b, s) -> logits (b, s, vocab) in fp32; attention(layer, q, k, v) -> (b, s, h, hd)."""
        cfg = self.cfg
        b, s = tokens.shape
        hd = cfg.head_dim
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            h = F.rms_norm(x, (cfg.d_model,), p["ln1"])
            sizes = [cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd]
            q, k, v = (h @ p["wqkv"]).split(sizes, -1)
            a = attention(i, q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd))
            x = x + a.reshape(b, s, -1) @ p["wo"]
            h = F.rms_norm(x, (cfg.d_model,), p["ln2"])
            x = x + (F.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
        return (F.rms_norm(x, (cfg.d_model,), self.ln_f) @ self.lm_head).float()


def rope(x, cos, sin, positions):
    """GPT-NeoX rotary (pairs (i, i + hd/2)) of x (b, s, heads, hd) at positions (b, s), in fp32."""
    c, s = cos.float()[positions].unsqueeze(2), sin.float()[positions].unsqueeze(2)
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# ours: a paged KV cache that grows page by page


class PagedKVCache:
    """Per-layer page pools, one block table for the batch, pages handed out from a free list on demand."""

    def __init__(self, cfg: ModelConfig, batch: int, num_pages: int, page_size: int, max_len: int, device,
                 dtype):
        shape = (num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.page_size = page_size
        max_pages = -(-max_len // page_size)
        self.table_host = torch.zeros(batch, max_pages, dtype=torch.int32)
        self.block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
        self.lens = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.used = [0] * batch  # pages held by each sequence
        # pages come out of the pool in no particular order, as in a server that has run for a while
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()

    def reserve(self, i: int, length: int) -> None:
        """Pages for positions [0, length) of sequence i; the device table is refreshed by sync()."""
        while self.used[i] * self.page_size < length:
            if not self.free:
                raise RuntimeError("the page pool is exhausted; pass a larger --pages")
            self.table_host[i, self.used[i]] = self.free.pop()
            self.used[i] += 1

    def sync(self) -> None:
        self.block_table.copy_(self.table_host, non_blocking=True)
        self.seqlens.copy_(torch.tensor(self.lens, dtype=torch.int32), non_blocking=True)

    def advance(self, i: int | None, n: int) -> None:
        for j in range(len(self.lens)) if i is None else (i,):
            self.lens[j] += n


def ours_generate(model: Model, prompts: list[torch.Tensor], new_tokens: int, page_size: int,
                  num_pages: int):
    """Greedy generation on a paged cache (prefill: flash_attn_with_kvcache, decode: a DecodePlan). Returns
    (tokens (b, new_tokens), prefill seconds, decode seconds, pages in use)."""
    cfg, dev = model.cfg, model.embed.device
    b = len(prompts)
    max_len = max(len(p) for p in prompts) + new_tokens
    cache = PagedKVCache(cfg, b, num_pages, page_size, max_len, dev, model.embed.dtype)

    def prefill_attention(i: int):
        def attention(layer, q, k, v):
            # appends the rotated k and v at the sequence's cache_seqlens, then attends (bottom-right causal)
            return flash_attn_with_kvcache(
                q, cache.k[layer], cache.v[layer], k, v, rotary_cos=model.cos, rotary_sin=model.sin,
                cache_seqlens=cache.seqlens[i : i + 1], block_table=cache.block_table[i : i + 1], causal=True,
                rotary_interleaved=False,
            )

        return attention

    # the decode steps' plan: split count, tiles and workspace fixed once for the batch, shared by every layer
    plan = DecodePlan(b, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, page_size=page_size, max_seqlen_k=max_len,
                      dtype=model.embed.dtype, device=dev, causal=True, rotary_interleaved=False)

    def decode_attention(layer, q, k, v):
        return plan.run(q, cache.k[layer], cache.v[layer], cache.seqlens, cache.block_table, k=k, v=v,
                        rotary_cos=model.cos, rotary_sin=model.sin)

    _sync(dev)
    t0 = time.perf_counter()
    nxt = torch.empty(b, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):  # prefill: one causal call per prompt, into freshly reserved pages
        cache.reserve(i, len(p))
        cache.sync()
        logits = model.forward(p.view(1, -1), prefill_attention(i))
        cache.advance(i, len(p))
        nxt[i] = logits[0, -1].argmax()
    _sync(dev)
    t1 = time.perf_counter()
    out = []
    for _ in range(new_tokens):
        out.append(nxt)
        for i in range(b):
            cache.reserve(i, cache.lens[i] + 1)  # a new page whenever a sequence crosses a page boundary
        cache.sync()
        logits = model.forward(nxt.view(b, 1), decode_attention)
        cache.advance(None, 1)
        nxt = logits[:, -1].argmax(-1)
    _sync(dev)
    return torch.stack(out, 1), t1 - t0, time.perf_counter() - t1, sum(cache.used)


# ----------------------------------------------------------------------------------------------------------
# sdpa: the same model with a contiguous cache


def sdpa_generate(model: Model, prompts: list[torch.Tensor], new_tokens: int):
    cfg, dev, dtype = model.cfg, model.embed.device, model.embed.dtype
    b = len(prompts)
    max_len = max(len(p) for p in prompts) + new_tokens
    shape = (b, max_len, cfg.n_kv_heads, cfg.head_dim)
    kc = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_layers)]
    vc = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_layers)]
    lens = torch.zeros(b, dtype=torch.long, device=dev)
    rows = torch.arange(b, device=dev)

    def prefill_attention(i):
        def attention(layer, q, k, v):
            pos = torch.arange(q.shape[1], device=dev).view(1, -1)
            q, k = rope(q, model.cos, model.sin, pos), rope(k, model.cos, model.sin, pos)
            kc[layer][i, : k.shape[1]], vc[layer][i, : v.shape[1]] = k[0], v[0]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)

        return attention

    def decode_attention(layer, q, k, v):
        pos = lens.view(-1, 1)
        q, k = rope(q, model.cos, model.sin, pos), rope(k, model.cos, model.sin, pos)
        kc[layer][rows, lens], vc[layer][rows, lens] = k[:, 0], v[:, 0]
        n = int(lens_max) + 1
        mask = (torch.arange(n, device=dev).view(1, -1) <= lens.view(-1, 1)).view(b, 1, 1, n)
        # not cuDNN: it builds a new plan for every new key length, i.e. at every step (60 ms a step measured)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc[layer][:, :n].transpose(1, 2),
                                               vc[layer][:, :n].transpose(1, 2), attn_mask=mask,
                                               enable_gqa=True)
        return o.transpose(1, 2)

    _sync(dev)
    t0 = time.perf_counter()
    nxt = torch.empty(b, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        logits = model.forward(p.view(1, -1), prefill_attention(i))
        lens[i] = len(p)
        nxt[i] = logits[0, -1].argmax()
    lens_max = max(len(p) for p in prompts)  # host copy: no device sync per step for the mask length
    _sync(dev)
    t1 = time.perf_counter()
    out = []
    for _ in range(new_tokens):
        out.append(nxt)
        logits = model.forward(nxt.view(b, 1), decode_attention)
        lens += 1
        lens_max += 1
        nxt = logits[:, -1].argmax(-1)
    _sync(dev)
    return torch.stack(out, 1), t1 - t0, time.perf_counter() - t1


def teacher_forced_check(model: Model, prompts, generated, tie: float) -> tuple[int, int, list[str]]:
    """SDPA over prompt + ours' tokens in one causal pass per sequence. Returns (steps agreeing, steps,
    notes on the disagreements that are not near-ties)."""
    agree, total, bad = 0, 0, []
    for i, p in enumerate(prompts):
        seq = torch.cat((p, generated[i, :-1]))

        def attention(layer, q, k, v):
            pos = torch.arange(q.shape[1], device=q.device).view(1, -1)
            q, k = rope(q, model.cos, model.sin, pos), rope(k, model.cos, model.sin, pos)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)

        logits = model.forward(seq.view(1, -1), attention)[0, len(p) - 1 :]  # predicts generated[i]
        top2 = logits.topk(2, dim=-1)
        ours = generated[i]
        same = top2.indices[:, 0] == ours
        agree += int(same.sum())
        total += len(ours)
        for t in (~same).nonzero().flatten().tolist():
            gap = float(top2.values[t, 0] - logits[t, ours[t]])
            if gap > tie:
                bad.append(f"sequence {i} step {t}: ours chose {int(ours[t])}, SDPA "
                           f"{int(top2.indices[t, 0])}, logit gap {gap:.3g} > {tie}")
    return agree, total, bad


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashattn.generate_demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--batch", type=int, help="prompts (default 8 on GPU, 2 on CPU)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per prompt (default 256 / 16)")
    parser.add_argument("--prompt-len", type=int, default=100, help="longest prompt; the others are shorter")
    parser.add_argument("--page-size", type=int, default=64, help="keys per page (a multiple of 16)")
    parser.add_argument("--pages", type=int, help="pages in each layer's pool (default: just enough)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--tie", type=float, help="logit gap under which a disagreement is a near-tie "
                        "(default 0.05 for 16-bit, 1e-3 for fp32)")
    parser.add_argument("--check-indices", action="store_true",
                        help="range-check the cache indices of every call (a device-to-host copy per call)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if gpu else "fp32")
    ]
    batch = args.batch or (8 if gpu else 2)
    new_tokens = args.new_tokens or (256 if gpu else 16)
    tie = args.tie if args.tie is not None else (1e-3 if dtype == torch.float32 else 0.05)
    if args.check_indices:
        config.set_check_indices(True)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn=int(args.d_model * 2.75) // 64 * 64)
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = [args.prompt_len] + torch.randint(args.prompt_len // 4, args.prompt_len, (batch - 1,),
                                                generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g).to(device) for n in lengths]
    max_len = max(lengths) + new_tokens
    pages = args.pages or batch * -(-max_len // args.page_size)
    model = Model(cfg, max_positions=pages * args.page_size, device=device, dtype=dtype, seed=args.seed)
    print(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads / {cfg.n_kv_heads} kv "
          f"heads (head dim {cfg.head_dim}), vocab {cfg.vocab}, random weights; {dtype} on {device}")
    print(f"batch {batch}, prompt lengths {lengths}, {new_tokens} new tokens each; paged cache: pages of "
          f"{args.page_size}, pool of {pages} per layer")

    with torch.inference_mode():
        # a first short run of each compiles the kernels, outside the timings
        ours_generate(model, prompts, 2, args.page_size, pages)
        sdpa_generate(model, prompts, 2)
        toks_o, pre_o, dec_o, used = ours_generate(model, prompts, new_tokens, args.page_size, pages)
        toks_s, pre_s, dec_s = sdpa_generate(model, prompts, new_tokens)
        agree, total, bad = teacher_forced_check(model, prompts, toks_o, tie)

    n = batch * new_tokens
    print(f"pages in use at the end: {used} of {pages} (the block table grew page by page)")
    runs = (("ours (DecodePlan, paged)", pre_o, dec_o), ("sdpa (contiguous)", pre_s, dec_s))
    for name, pre, dec in runs:
        print(f"{name:40s} prefill {pre * 1e3:8.1f} ms   decode {n / dec:9.1f} tokens/s ({dec * 1e3:.1f} ms)")
    same = int((toks_o == toks_s).all(dim=1).sum())
    first = [int((toks_o[i] != toks_s[i]).nonzero()[0]) for i in range(batch)
             if not torch.equal(toks_o[i], toks_s[i])]
    print(f"free-running greedy: {same}/{batch} sequences identical"
          + (f"; the others part at steps {first} (then continue differently)" if first else ""))
    print(f"teacher-forced: SDPA's argmax equals ours' token at {agree}/{total} steps; "
          f"{total - agree - len(bad)} near-ties (logit gap <= {tie}), {len(bad)} real disagreements")
    for line in bad[:10]:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
