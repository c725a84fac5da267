"""Routing of deterministic=True backwards (flashattn.backends.triton.routes): the Gluon backward's
fixed-order variants (attn_bwd.py's dQ writer with its order kept per 128 rows on 64-row steps, the
128-key and d-split wide-head kernels' writers) with the default order's GQA group split, and the Triton
programs where no Gluon variant holds the order (a learnable sink, padded head dims). Pure host logic; the
kernels run on the GPU in test_gluon_bwd*_gpu.py (deterministic in their names)."""

from __future__ import annotations

import dataclasses

import pytest
from route_specs import CAUSAL
from route_specs import spec as _spec

from flashattn.backends.triton import routes


@pytest.mark.parametrize("d, dv", [(96, 96), (40, 40), (128, 96), (80, 64)])
def test_a_deterministic_backward_at_padded_head_dims_keeps_triton(d, dv):
    # the fixed-order dQ variant runs its GPU tests at d = dv = 64 and 128 only; the default order takes the
    # padded head dims
    spec = _spec(headdim=d, headdim_v=dv, window=CAUSAL)
    assert isinstance(routes.backward_route(spec), routes.GluonBackward)
    fixed = dataclasses.replace(spec, deterministic=True)
    assert isinstance(routes.backward_route(fixed), routes.TritonBackward)
    assert isinstance(routes.backward_route(_spec(deterministic=True)), routes.GluonBackward)


@pytest.mark.parametrize("kw", [dict(), dict(window=CAUSAL, nheads=32, nheads_k=1), dict(varlen=True)],
                         ids=str)
def test_deterministic_backward_takes_the_gluon_fixed_order_variant(kw):
    # its dQ adds in a fixed order, kept per 128 rows over 64-row steps; the group split as the default
    # order's (each part's dK/dV into kv heads of its own)
    spec = _spec(deterministic=True, **kw)
    route = routes.backward_route(spec)
    default = routes.backward_route(_spec(**kw))
    assert isinstance(route, routes.GluonBackward) and route.deterministic
    assert route.group_split == default.group_split == (8 if spec.group == 32 else 1)
    assert route.dq_order_rows == (128 if route.tiles.block_m == 64 else 0)
    assert not default.deterministic and default.dq_order_rows == 0


def test_deterministic_dq_order_per_128_rows_on_64_row_steps():
    # d = 64 without a mask steps 128 rows (one step: the order per step), the others 64
    for d, window, rows in ((64, (-1, -1), 0), (64, CAUSAL, 128), (128, CAUSAL, 128), (128, (-1, -1), 128)):
        route = routes.backward_route(_spec(headdim=d, headdim_v=d, window=window, deterministic=True))
        assert route.tiles.block_m == (64 if rows else 128) and route.dq_order_rows == rows


def test_the_deterministic_group_split_counts_its_buffers_once_a_part():
    # each part adds into kv heads of its own: 8 parts of MQA 32/1 at 64K keys (8 x 64 MiB) pass the cap,
    # 2 (128 MiB) fit; the default order's atomics share one buffer and keep 8
    spec = _spec(nheads=32, nheads_k=1, seqlen_q=65536, seqlen_k=65536, window=CAUSAL)
    assert routes.gluon_backward_route(spec).group_split == 8
    assert routes.gluon_backward_route(dataclasses.replace(spec, deterministic=True)).group_split == 4


@pytest.mark.parametrize("kw", [dict(window=CAUSAL), dict(headdim=160, headdim_v=104),
                                dict(window=CAUSAL, nheads=32, nheads_k=1),
                                dict(varlen=True, window=(300, -1))], ids=str)


def test_deterministic_wide_heads_take_the_128_key_fixed_order_variant(kw):
    # d_qk 129..192 beside dv up to 128: attn_bwd_keys.py's three dQ units, staged in tiles of their own for
    # the dQ writer, the default order's group split; d 193..256 the d-split kernel's (its two rounds of dQ
    # units)
    spec = _spec(deterministic=True, **{"headdim": 192, "headdim_v": 128, **kw})
    route = routes.backward_route(spec)
    assert isinstance(route, routes.GluonBackward) and route.wide_keys and route.deterministic
    split = routes.backward_route(dataclasses.replace(spec, deterministic=False)).group_split
    assert route.group_split == split == (8 if spec.group == 32 else 1) and route.dq_order_rows == 0
    assert not routes.backward_route(dataclasses.replace(spec, deterministic=False)).deterministic
    wider = routes.backward_route(dataclasses.replace(spec, headdim=256, headdim_v=256))
    assert isinstance(wider, routes.GluonBackward) and wider.d_qk == 256 and not wider.wide_keys
    assert wider.deterministic and wider.group_split == split
    assert isinstance(routes.backward_route(dataclasses.replace(spec, sink=True)), routes.TritonBackward)


def test_deterministic_backward_with_a_sink_takes_the_triton_programs():
    # the Gluon programs add the sink's gradient in no fixed order
    spec = _spec(deterministic=True, sink=True)
    assert isinstance(routes.forward_route(spec), routes.GluonForward)
    assert isinstance(routes.backward_route(spec), routes.TritonBackward)
