"""The backward kernels' cases for compute-sanitizer (scripts/sanitize_cases.py names them: ws_bwd,
ws_deterministic, ws_wide_bwd, ws_keys; its docstring says what each runs), and the helpers both files use."""

import contextlib
import dataclasses

import torch

from flashattn import flash_attn_func, flash_attn_varlen_func


def grad_check(out, *inputs):
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in inputs)


def qkv(*shapes):
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]


def ws_bwd():
    from flashattn.backends.triton import attention, routes

    # the Triton forward's route, so that only the backward is a Gluon kernel
    default, routes.forward_route = routes.forward_route, routes.triton_forward_route
    attention._forward_cache.clear()
    # the last: causal sq > sk leaves whole query tiles without keys, which no reduce-add reaches
    for b, sq, sk, h, hk, d in [(1, 200, 137, 4, 2, 128), (2, 67, 130, 4, 2, 64), (1, 300, 130, 4, 2, 64)]:
        for causal in (False, True):
            q, k, v = qkv((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
            grad_check(flash_attn_func(q, k, v, causal=causal), q, k, v)
    # varlen: empty sequences, keys no query sees (no queries), sequences ending inside a 64-key half (masked
    # dK / dV stores beside the next sequence's TMA stores) and inside a query tile (reduce-adds of zeros
    # into the next sequence's dQ rows), and programs past the key-tile list
    lens_q, lens_k = [0, 77, 1, 130, 64, 0, 191, 1], [5, 77, 0, 200, 64, 3, 150, 129]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = qkv((sum(lens_q), 4, d), (sum(lens_k), 2, d), (sum(lens_k), 2, d))
            grad_check(flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal),
                        q, k, v)
    routes.forward_route = default


def ws_deterministic():
    # deterministic=True on the Gluon backward: its dQ writer warp and counters (the order kept per 128 rows
    # over 64-row steps, per step over 128-row ones), under both orders (a right edge: the last key tile
    # first; none: the first), d = 64 (deferred dQ) and 128, GQA, and varlen with empty sequences and
    # programs past the key-tile list
    for b, sq, sk, h, hk, d, opts in [(1, 200, 300, 4, 2, 128, dict(causal=True)), (2, 130, 67, 4, 2, 64, {}),
                                      (1, 300, 200, 4, 4, 64, dict(window_size=(50, 20))),
                                      (1, 257, 257, 2, 1, 128, dict(window_size=(100, -1)))]:
        q, k, v = qkv((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
        grad_check(flash_attn_func(q, k, v, deterministic=True, **opts), q, k, v)
    lens = [0, 77, 1, 300, 0, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        q, k, v = qkv((sum(lens), 4, 128), (sum(lens), 2, 128), (sum(lens), 2, 128))
        grad_check(flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                           deterministic=True), q, k, v)

    from flashattn.backends.triton import routes

    default = routes.backward_route

    def fixed(**fields):
        """The default deterministic route with some fields replaced (the bench's explicit routes)."""
        return lambda spec: dataclasses.replace(default(dataclasses.replace(spec, deterministic=True)),
                                                **fields)

    # the fixed-order variant at padded head dims, on its explicit route (the default keeps Triton there)
    with _backward_route(routes.gluon_backward_route):
        _fixed_order(((96, 96, dict(causal=True)), (128, 96, dict(window_size=(50, 20)))))
    # the 128-key wide-head backward's fixed-order variant (attn_bwd_keys.py's units for the same writer)
    _fixed_order(((192, 128, dict(causal=True)), (160, 104, dict(window_size=(50, -1)))))
    _fixed_order_varlen(lens, cu, 192, 128)
    # the fixed-order variants with the GQA group split forced to 2 (the default splits groups of 4 or more):
    # each part's dK and dV into kv heads of its own
    with _backward_route(fixed(group_split=2)):
        _fixed_order(((d, dv, dict(causal=True)) for d, dv in ((128, 128), (192, 128), (256, 256))), hk=1)
    # the default split of packed documents' GQA groups (8 heads over 1: 4 parts)
    q, k, v = qkv((sum(lens), 8, 128), (sum(lens), 1, 128), (sum(lens), 1, 128))
    grad_check(flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                       deterministic=True), q, k, v)
    # the d-split wide-head backward's (attn_bwd_dsplit.py's two rounds of units for its own writer)
    _fixed_order(((256, 256, dict(causal=True)), (224, 128, dict(window_size=(50, -1)))))
    _fixed_order_varlen(lens, cu, 256, 256)


@contextlib.contextmanager
def _backward_route(make):
    """Every backward of the block on make(spec)'s route, no signature cached by the default one."""
    from flashattn.backends.triton import attention, routes

    default = routes.backward_route
    routes.backward_route = make
    attention._backward_cache.clear()
    try:
        yield
    finally:
        routes.backward_route = default
        attention._backward_cache.clear()


def _fixed_order(cases, hk=2):
    """deterministic=True forward and backward at each (d, dv, options): 4 query heads over hk, sq ≠ sk."""
    for d, dv, opts in cases:
        q, k, v = qkv((1, 300, 4, d), (1, 200, hk, d), (1, 200, hk, dv))
        grad_check(flash_attn_func(q, k, v, deterministic=True, **opts), q, k, v)


def _fixed_order_varlen(lens, cu, d, dv):
    q, k, v = qkv((sum(lens), 4, d), (sum(lens), 2, d), (sum(lens), 2, dv))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, deterministic=True)
    grad_check(out, q, k, v)


def _wide_backward_cases(backward, pairs, varlen_pairs):
    # a wide-head backward (`backward`: its route function) alone, after the Triton forward's route: each
    # (d, dv) pair's column units, d below the width (padding columns), GQA with and without the group split,
    # a window with softcap, ALiBi and a sink, and varlen with empty sequences, sequences ending inside a key
    # tile (masked dK / dV stores beside the next sequence's TMA stores) and programs past the key-tile list
    from dataclasses import replace

    from flashattn.backends.triton import attention, routes

    default = routes.forward_route, routes.backward_route
    routes.forward_route, routes.backward_route = routes.triton_forward_route, backward
    attention._forward_cache.clear()
    attention._backward_cache.clear()
    h = 4
    for d, dv in pairs:
        for (b, sq, sk), options in (((1, 200, 137), dict(causal=True)), ((2, 67, 130), {}),
                                     ((1, 257, 300), dict(window_size=(64, 20), softcap=5.0, alibi=True,
                                                          sink=True))):
            q, k, v = qkv((b, sq, h, d), (b, sk, 2, d), (b, sk, 2, dv))
            inputs = [q, k, v]
            options = dict(options)
            if options.pop("alibi", False):
                options["alibi_slopes"] = torch.rand(h, device="cuda")
            if options.pop("sink", False):
                options["learnable_sink"] = torch.randn(h, device="cuda", requires_grad=True)
                inputs.append(options["learnable_sink"])
            grad_check(flash_attn_func(q, k, v, **options), *inputs)
    routes.backward_route = lambda spec: replace(backward(spec), group_split=2)
    attention._backward_cache.clear()
    q, k, v = qkv((1, 150, 8, 192), (1, 190, 2, 192), (1, 190, 2, 128))
    grad_check(flash_attn_func(q, k, v, causal=True), q, k, v)
    routes.backward_route = backward
    attention._backward_cache.clear()
    lens_q, lens_k = [0, 77, 1, 130, 64, 0, 191, 1], [5, 77, 0, 200, 64, 3, 150, 129]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for ls in (lens_q, lens_k))
    for d, dv in varlen_pairs:
        q, k, v = qkv((sum(lens_q), h, d), (sum(lens_k), 2, d), (sum(lens_k), 2, dv))
        sink = torch.randn(h, device="cuda", requires_grad=True)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                     window_size=(50, -1), softcap=4.0, learnable_sink=sink)
        grad_check(out, q, k, v, sink)
    routes.forward_route, routes.backward_route = default
    attention._forward_cache.clear()
    attention._backward_cache.clear()


def ws_wide_bwd():
    # attn_bwd_dsplit.py (the default route at width 256, an explicit one at 192)
    from flashattn.backends.triton import routes

    _wide_backward_cases(routes.dsplit_backward_route, ((256, 256), (192, 128), (160, 128), (256, 128)),
                         ((256, 256), (160, 128)))


def ws_keys():
    # attn_bwd_keys.py (128 keys a program; the default route at width 192)
    from flashattn.backends.triton import routes

    _wide_backward_cases(routes.wide_keys_backward_route, ((192, 128), (160, 104), (192, 64)),
                         ((192, 128), (160, 104)))
