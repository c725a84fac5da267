"""flash_attn 2.8's `flash_attn.flash_attn_interface`: the public functions and the private ones other
libraries call (ring-flash-attn, yunchang's USP, ...), with flash_attn's signatures and return tuples.

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None) -> softmax_d   (dq, dk, dv written in place)
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                rng_state=None, zero_tensors=False) -> softmax_d
    _get_block_size_n(device, head_dim, is_dropout, is_causal): the key-tile width S_dmask is decoded with.
    flash_attn_gpu.fwd / varlen_fwd / bwd / varlen_bwd: the extension's entry points, positional, returning
        lists (flash_attn_with_kvcache's fwd_kvcache is not among them: call flash_attn_with_kvcache).

Shapes as flash_attn's: q (batch, seqlen_q, nheads, headdim) or varlen (total_q, nheads, headdim); out like q
(with v's head dim); softmax_lse (batch, nheads, seqlen_q) float32, varlen (nheads, total_q); S_dmask as
flashattn.flash_attn_func's (an empty tensor unless return_softmax and dropout_p > 0); rng_state (2,) int64
(seed, offset) on the CPU (flash_attn's lives on q's device; both forms are accepted back); softmax_d
rowsum(dout * out) float32, (batch, nheads, seqlen_q rounded up to 128) or (nheads, total_q + 128 * batch)
with sequence b's rows from cu_seqlens_q[b] + 128 * b, as flash_attn lays it out.

Every function also takes window_size=(left, right) as a keyword in place of window_size_left/right (the
spelling of flash_attn before 2.6). The forward functions run without building an autograd graph, like
flash_attn's custom ops; every argument goes through the public functions' checks (flashattn._validate).
"""

import itertools

import torch

from flashattn import _validate, paged
from flashattn._validate_cache import check_index_tensor
from flashattn.dropout import s_dmask_block_n
from flashattn.errors import FlashAttnError
from flashattn.interface import (
    check_options,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    forward,
)
from flashattn.interface_varlen import (
    check_varlen,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    paged_forward,
)
from flashattn.kvcache import flash_attn_with_kvcache as _flash_attn_with_kvcache
from flashattn.ops.attention import attn_bwd
from flashattn.ops.rng import NO_RNG

__all__ = [
    "USE_TRITON_ROCM",
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_get_block_size_n",
    "flash_attn_func",
    "flash_attn_gpu",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "maybe_contiguous",
    "round_multiple",
]

USE_TRITON_ROCM = False  # flash_attn's switch to its ROCm Triton kernels; code and tests read it


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, **kwargs):
    """flashattn.flash_attn_with_kvcache (same arguments and shapes), with flash_attn 2.8's check of a paged
    call: a sequence longer than block_table addresses (max_pages x page_size, appended keys included)
    raises a FlashAttnError naming block_table. flash_attn pays one device-to-host copy for that check on
    the paged path, and so does this one: with a block_table, check_inputs defaults to True (every index
    of the call is range-checked in that one copy; pass check_inputs=False to skip it). flashattn's own
    flash_attn_with_kvcache leaves the check opt-in, so that no default call syncs; either way the kernel
    clamps every index it reads. Other keywords (key_padding_mask, check_inputs, k_descale, v_descale) are
    flashattn's."""
    if block_table is not None:
        kwargs.setdefault("check_inputs", True)
    return _flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
        num_splits, return_softmax_lse, **kwargs)


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """flash_attn's key-tile width for a head dim on a device: S_dmask's running max steps by it."""
    if head_dim > _validate.MAX_HEADDIM:
        raise FlashAttnError(f"head_dim is {head_dim}; expected at most {_validate.MAX_HEADDIM}")
    device = torch.device(device)
    sm8x = False
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sm8x = major == 8 and minor > 0
    return s_dmask_block_n(head_dim, is_dropout, is_causal, sm8x)


def _window(window_size_left, window_size_right, window_size):
    return (window_size_left, window_size_right) if window_size is None else window_size


def _scale(softmax_scale, q):
    if softmax_scale is None:
        return q.shape[-1] ** -0.5
    _validate.check_scale(softmax_scale)
    return float(softmax_scale)


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                        softcap, alibi_slopes, return_softmax, *, window_size=None):
    """flash_attn's forward of the padded layout, without autograd; see the module docstring."""
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    _validate.check_qkv(q, k, v)
    scale = _scale(softmax_scale, q)
    window = check_options(q, dropout_p, scale, _window(window_size_left, window_size_right, window_size),
                           softcap, alibi_slopes, None, q.shape[0])
    with torch.no_grad():
        return forward(q, k, v, dropout_p, scale, bool(causal), window, softcap, alibi_slopes, False,
                       bool(return_softmax))


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0, *, window_size=None):
    """flash_attn's varlen forward, without autograd. block_table: paged keys (flash_attn_varlen_func's);
    seqused_k (batch,) int32: sequence b uses only the first seqused_k[b] keys of its cu_seqlens_k range;
    leftpad_k (batch,) int32: its keys start leftpad_k[b] rows into that range (flash_attn's: sequence b
    attends to rows cu_seqlens_k[b] + leftpad_k[b] up to cu_seqlens_k[b + 1], or to cu_seqlens_k[b] +
    seqused_k[b]; not with block_table, as in flash_attn); each costs a device-to-host copy; zero_tensors:
    the rows of out past cu_seqlens_q[-1] are 0 and their softmax_lse -inf (else left unspecified);
    num_splits 0 or 1 (the split count is the kernels' choice)."""
    if leftpad_k is not None and block_table is not None:
        raise FlashAttnError("leftpad_k with block_table (paged keys) is not supported, as in flash_attn; "
                             "pass leftpad_k=None (flash_attn_with_kvcache takes cache_leftpad with pages)")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise FlashAttnError(f"num_splits must be an int >= 0, got {num_splits!r}")
    if num_splits > 1:
        raise FlashAttnError(f"num_splits > 1 is not supported by the varlen forward (got {num_splits}); "
                             f"pass 0, the kernels choose their own split")
    q, k, v = (maybe_contiguous(x) for x in (q, k, v))
    used = None
    if seqused_k is not None or leftpad_k is not None:
        used = _used_key_ranges(cu_seqlens_k, seqused_k, leftpad_k, q)
        ends = itertools.accumulate((b - a for a, b in used), initial=0)
        cu_used = torch.tensor(list(ends), dtype=torch.int32, device=cu_seqlens_k.device)
    if block_table is None:
        max_seqlen_q, max_seqlen_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  max_seqlen_k)
        if used is not None:
            (k, v), cu_seqlens_k = _used_keys(k, v, used), cu_used
    else:
        # the pages hold positions [0, length) of each sequence: its first keys are the ones it uses
        cu_seqlens_k = cu_seqlens_k if used is None else cu_used
        max_seqlen_q, max_seqlen_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  max_seqlen_k, block_table)
    scale = _scale(softmax_scale, q)
    window = check_options(q, dropout_p, scale, _window(window_size_left, window_size_right, window_size),
                           softcap, alibi_slopes, None, cu_seqlens_q.shape[0] - 1)
    with torch.no_grad():
        if block_table is not None and dropout_p == 0 and not return_softmax:
            # the pools read in place where the route can (flashattn.paged)
            out, lse = paged_forward(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, scale, causal, window, softcap, alibi_slopes, None)
            s_dmask, rng_state = q.new_empty(0), NO_RNG
        else:
            if block_table is not None:
                k, v = paged.gather_pages(k, v, block_table, cu_seqlens_k)
            out, lse, s_dmask, rng_state = forward(
                q, k, v, dropout_p, scale, bool(causal), window, softcap, alibi_slopes, False,
                bool(return_softmax), None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if zero_tensors:
            rows = _covered_rows(cu_seqlens_q, q.shape[0])
            out = torch.where(rows.view(-1, 1, 1), out, 0.0)
            lse = torch.where(rows.view(1, -1), lse, -torch.inf)
    return out, lse, s_dmask, rng_state


def _index_list(name, t, batch, q) -> list[int]:
    check_index_tensor(name, t, batch, q)
    return t.tolist()


def _used_key_ranges(cu_seqlens_k, seqused_k, leftpad_k, q) -> list[tuple[int, int]]:
    """Each sequence's rows of the packed keys, [start, end): cu_seqlens_k[b] + leftpad_k[b] up to
    cu_seqlens_k[b] + seqused_k[b] (or cu_seqlens_k[b + 1]), checked against cu_seqlens_k (device-to-host
    copies of the three)."""
    _validate.check_cu_seqlens_shapes(cu_seqlens_k, cu_seqlens_k, q)
    batch = cu_seqlens_k.shape[0] - 1
    cu = cu_seqlens_k.tolist()
    lengths = [cu[b + 1] - cu[b] for b in range(batch)]
    used = lengths if seqused_k is None else _index_list("seqused_k", seqused_k, batch, q)
    pads = [0] * batch if leftpad_k is None else _index_list("leftpad_k", leftpad_k, batch, q)
    for b, (n, length) in enumerate(zip(used, lengths, strict=True)):
        if not 0 <= n <= length:
            raise FlashAttnError(f"seqused_k[{b}] is {n}; expected 0 <= seqused_k[b] <= the sequence's "
                                 f"{length} keys (cu_seqlens_k[b + 1] - cu_seqlens_k[b])")
    bound = "seqused_k[b]" if seqused_k is not None else "the sequence's keys"
    for b, (pad, n) in enumerate(zip(pads, used, strict=True)):
        if not 0 <= pad <= n:
            raise FlashAttnError(f"leftpad_k[{b}] is {pad}; expected 0 <= leftpad_k[b] <= {bound}, {n}")
    return [(cu[b] + pads[b], cu[b] + used[b]) for b in range(batch)]


def _used_keys(k, v, ranges):
    """The rows of packed k, v in the given [start, end) ranges, in order."""
    rows = torch.cat([torch.arange(a, b, device=k.device) for a, b in ranges]
                     + [torch.zeros(0, dtype=torch.long, device=k.device)])
    return k[rows], v[rows]


def _covered_rows(cu_seqlens, total):
    """bool (total,): the rows some sequence of cu_seqlens holds (no device sync)."""
    rows = torch.arange(total, device=cu_seqlens.device)
    return (rows >= cu_seqlens[0]) & (rows < cu_seqlens[-1])


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
    return type(t).__name__


def _check_backward(dout, out, softmax_lse, grads, inputs, lse_shape, rng_state, dropout_p):
    """The backward's own arguments against the forward's inputs (q, k, v)."""
    q, v = inputs[0], inputs[2]
    want = (*q.shape[:-1], v.shape[-1])
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or t.shape != want or t.dtype != q.dtype or t.device != q.device:
            raise FlashAttnError(f"{name} has {_describe(t)}; expected shape {want} in q's dtype {q.dtype} "
                                 f"on {q.device}")
    if (not isinstance(softmax_lse, torch.Tensor) or tuple(softmax_lse.shape) != lse_shape
            or softmax_lse.dtype != torch.float32 or softmax_lse.device != q.device):
        raise FlashAttnError(f"softmax_lse has {_describe(softmax_lse)}; expected the forward's: float32 of "
                             f"shape {lse_shape} on {q.device}")
    for name, g, x in zip(("dq", "dk", "dv"), grads, inputs, strict=True):
        if g is not None and (not isinstance(g, torch.Tensor) or g.shape != x.shape or g.dtype != x.dtype
                              or g.device != x.device):
            raise FlashAttnError(f"{name} has {_describe(g)}; expected None or {_describe(x)} like {name[1]}")
    if dropout_p > 0 and (not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2):
        raise FlashAttnError(f"rng_state is {_describe(rng_state)}; dropout_p > 0 needs the forward's "
                             f"rng_state, (2,) int64, to regenerate its dropout mask")


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window,
              softcap, alibi_slopes, deterministic, rng_state, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None):
    """Computes the gradients into dq, dk, dv (allocated where None); returns (dq, dk, dv) as written."""
    scale = _scale(softmax_scale, q)
    if rng_state is None:
        rng_state = torch.zeros(2, dtype=torch.int64)
    varlen = cu_seqlens_q is not None
    if not varlen:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    with torch.no_grad():
        gq, gk, gv, _ = attn_bwd(dout, q, k, v, out, softmax_lse, rng_state.cpu(), cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, scale, bool(causal), window[0], window[1],
                                 float(softcap), alibi_slopes, float(dropout_p), None, bool(deterministic))
        written = []
        for g, new, cu in ((dq, gq, cu_seqlens_q), (dk, gk, cu_seqlens_k), (dv, gv, cu_seqlens_k)):
            if g is None:
                g = torch.empty_like(new)
            if varlen:
                # rows no sequence holds keep what they held, as flash_attn's kernels never write them
                new = torch.where(_covered_rows(cu, new.shape[0]).view(-1, 1, 1), new, g)
            written.append(g.copy_(new))
    return written


def _softmax_d(dout, out, cu_seqlens_q=None):
    """flash_attn's softmax_d: rowsum(dout * out) in float32, laid out as its backward returns it."""
    d = (dout.float() * out.float()).sum(-1)  # (b, sq, h) or (total_q, h)
    if cu_seqlens_q is None:
        b, sq, h = d.shape
        full = d.new_zeros(b, h, round_multiple(sq, 128))
        full[:, :, :sq] = d.transpose(1, 2)
        return full
    total, h = d.shape
    batch = cu_seqlens_q.shape[0] - 1
    rows = torch.arange(total, device=d.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True).clamp_(max=max(batch - 1, 0))
    full = d.new_zeros(h, total + 128 * batch)
    covered = _covered_rows(cu_seqlens_q, total)
    full[:, rows + 128 * seq] = torch.where(covered.view(-1, 1), d, 0.0).t()
    return full


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                         rng_state=None, *, window_size=None):
    """flash_attn's backward of the padded layout: writes dq, dk, dv (any strides; None: not returned, as
    flash_attn's op) and returns softmax_d; see the module docstring."""
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    _validate.check_qkv(q, k, v)
    window = check_options(q, dropout_p, softmax_scale, _window(window_size_left, window_size_right,
                                                                window_size), softcap, alibi_slopes, None,
                           q.shape[0])
    _check_backward(dout, out, softmax_lse, (dq, dk, dv), (q, k, v), (q.shape[0], q.shape[2], q.shape[1]),
                    rng_state, dropout_p)
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window, softcap,
              alibi_slopes, deterministic, rng_state)
    return _softmax_d(dout, out)


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                rng_state=None, zero_tensors=False, *, window_size=None):
    """flash_attn's varlen backward: writes dq, dk, dv and returns softmax_d. zero_tensors: rows no sequence
    holds get zero gradients (else they keep what dq, dk, dv held)."""
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    max_seqlen_q, max_seqlen_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    window = check_options(q, dropout_p, softmax_scale, _window(window_size_left, window_size_right,
                                                                window_size), softcap, alibi_slopes, None,
                           cu_seqlens_q.shape[0] - 1)
    _check_backward(dout, out, softmax_lse, (dq, dk, dv), (q, k, v), (q.shape[1], q.shape[0]), rng_state,
                    dropout_p)
    if zero_tensors:
        for g in (dq, dk, dv):
            if g is not None:
                g.zero_()
    _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window, softcap,
              alibi_slopes, deterministic, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _softmax_d(dout, out, cu_seqlens_q)


def _no_generator(gen) -> None:
    if gen is not None:
        raise FlashAttnError("the `generator` argument is no longer supported (flash_attn 2.8 keeps the "
                             "slot for its position only): pass None; dropout draws from torch's default "
                             "generator")


def _into(buffer, value):
    """value written into a caller's buffer (flash_attn's out_ / dq_ arguments), or value itself."""
    return value if buffer is None else buffer.copy_(value)


class _FlashAttnGPU:
    """flash_attn 2.8's extension entry points (`flash_attn_interface.flash_attn_gpu`, the
    `flash_attn_2_cuda` module): fwd, varlen_fwd, bwd, varlen_bwd with its positional arguments and
    returned lists, for code that calls them directly. The unused generator slot must be None, as there."""

    @staticmethod
    def fwd(q, k, v, out_, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left,
            window_size_right, softcap, return_softmax, gen_):
        _no_generator(gen_)
        out, lse, s_dmask, rng = _flash_attn_forward(q, k, v, p_dropout, softmax_scale, is_causal,
                                                     window_size_left, window_size_right, softcap,
                                                     alibi_slopes, return_softmax)
        return [_into(out_, out), lse, s_dmask, rng]

    @staticmethod
    def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                   window_size_left, window_size_right, softcap, return_softmax, gen_, num_splits=0):
        _no_generator(gen_)
        out, lse, s_dmask, rng = _flash_attn_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
            is_causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax,
            block_table, leftpad_k, seqused_k, zero_tensors, num_splits)
        return [_into(out_, out), lse, s_dmask, rng]

    @staticmethod
    def bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes, p_dropout, softmax_scale, is_causal,
            window_size_left, window_size_right, softcap, deterministic, gen_, rng_state):
        _no_generator(gen_)
        grads = [torch.empty_like(x) if g is None else g for g, x in ((dq_, q), (dk_, k), (dv_, v))]
        softmax_d = _flash_attn_backward(dout, q, k, v, out, softmax_lse, *grads, p_dropout, softmax_scale,
                                         is_causal, window_size_left, window_size_right, softcap,
                                         alibi_slopes, deterministic, rng_state)
        return [*grads, softmax_d]

    @staticmethod
    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                   max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
                   window_size_left, window_size_right, softcap, deterministic, gen_, rng_state):
        _no_generator(gen_)
        grads = [torch.empty_like(x) if g is None else g for g, x in ((dq_, q), (dk_, k), (dv_, v))]
        softmax_d = _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, *grads, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap, alibi_slopes,
            deterministic, rng_state, zero_tensors)
        return [*grads, softmax_d]


flash_attn_gpu = _FlashAttnGPU()
