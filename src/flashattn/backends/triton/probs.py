"""Launcher of the S_dmask kernel (kernels/triton/probs.py): allocate, launch. Layouts as attention.py's."""

import torch

from flashattn.backends.triton.attention import _alibi_args, _problem
from flashattn.backends.triton.launch import launch
from flashattn.dropout import s_dmask_shape
from flashattn.kernels.triton.probs import attn_probs_kernel


def attention_probs(q, k, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, rng_seed=0, rng_offset=0, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_n: int = 64):
    """flash_attn's S_dmask, dropout.s_dmask_shape(batch, nheads, max lengths) in q's dtype, with key tiles
    block_n wide (a power of two <= 128)."""
    # v only sizes the problem's value head dim, which this kernel does not read
    pb = _problem(q, k, k, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, rng_seed,
                  rng_offset, cu_seqlens_q, max_seqlen_q, max_seqlen_k, None)
    shape = s_dmask_shape(pb.batch, pb.nheads, pb.seqlen_q, pb.seqlen_k)
    rows, cols = shape[2], shape[3]
    p = torch.empty(shape, dtype=q.dtype, device=q.device)
    if p.numel() == 0:
        return p
    block_m = 64 if q.is_cuda else 32
    alibi, stride_alibi = _alibi_args(alibi_slopes, q)
    qk_scale, cap_in, cap_out, left, right, p_drop, seed, offset = pb.scalars
    flags = pb.flags
    launch(
        attn_probs_kernel, (rows // block_m, pb.batch * pb.nheads),
        q, k, p, cu_seqlens_q if pb.varlen else q, cu_seqlens_k if pb.varlen else q, alibi,
        *pb.rows(q), *pb.rows(k), *p.stride()[:3], stride_alibi,
        pb.nheads, *pb.bounds(q, k), pb.seqlen_q, pb.seqlen_k, cols,
        qk_scale, cap_in, cap_out, left, right, p_drop, seed, offset,
        GROUP=flags["GROUP"], HEAD_DIM=pb.d, BLOCK_D=flags["BLOCK_D"], BLOCK_M=block_m, BLOCK_N=block_n,
        IS_VARLEN=pb.varlen, WINDOW_LEFT=flags["WINDOW_LEFT"], WINDOW_RIGHT=flags["WINDOW_RIGHT"],
        HAS_SOFTCAP=flags["HAS_SOFTCAP"], HAS_ALIBI=flags["HAS_ALIBI"], HAS_DROPOUT=flags["HAS_DROPOUT"],
        DOT_PREC=flags["DOT_PREC"], num_warps=4, num_stages=2,
    )
    return p
