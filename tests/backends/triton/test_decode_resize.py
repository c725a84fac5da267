"""A decode launch resized to a longer or shorter contiguous cache (DecodeLaunch.resized, which the Hugging
Face integration's decode steps take as a dynamic cache grows) is the launch `prepare` makes for that length:
the same route, grid, constexprs and scalar arguments, or None exactly where the length takes another route.
The kernel's results through a resized launch: tests/integrations/test_transformers.py."""

from __future__ import annotations

import pytest
import torch

from flashattn.backends.triton import decode, tma
from flashattn.backends.triton import launch as launch_mod


@pytest.fixture(autouse=True)
def _h200(monkeypatch):
    # route as on the H200 (132 SMs, sm90), where the split count follows the length (the CPU's: fewer splits)
    monkeypatch.setattr(tma, "device_facts", lambda device: (True, (9, 0)))
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)


def _prepare(b, h, hk, d, length, mask, layout, **options):
    """prepare() for q (b, 1, h, d) against caches of `length` keys (on the meta device: only their shapes and
    strides are read); layout "bhsd": the caches are
    transformers' (b, h_k, s, d) tensors seen through a transpose (strides that move with the length)."""
    q = torch.zeros(b, 1, h, d, dtype=torch.float16)
    if layout == "bhsd":
        k = torch.empty(b, hk, length, d, dtype=torch.float16, device="meta").transpose(1, 2)
    else:
        k = torch.empty(b, length, hk, d, dtype=torch.float16, device="meta")
    key_mask = torch.ones(b, length, dtype=torch.bool) if mask else None
    launch = decode.prepare(q, k, k, None, None, None, None, None, None, None, None, None, key_mask, None,
                            None, softmax_scale=0.1, **options)
    return launch, k, key_mask


@pytest.mark.parametrize("b, h, hk, d", [(1, 32, 8, 128), (16, 32, 8, 128), (2, 4, 4, 64), (1, 6, 1, 256)])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_resized_is_the_prepared_launch(b, h, hk, d, mask, layout):
    base, _, _ = _prepare(b, h, hk, d, 1000, mask, layout)
    resized_some = rerouted = 0
    for length in (1, 2, 17, 63, 64, 65, 127, 128, 129, 999, 1001, 1024, 4095, 4097, 65536 + 3):
        fresh, k, key_mask = _prepare(b, h, hk, d, length, mask, layout)
        mask_stride = 0 if key_mask is None else key_mask.stride(0)
        got = base.resized(length, k.stride()[:3], k.stride()[:3], mask_stride)
        if fresh.route != base.route:
            assert got is None, f"length {length}: another route, yet resized"
            rerouted += 1
            continue
        assert got is not None, f"length {length}: the same route, yet not resized"
        resized_some += 1
        kept = ("route", "grid", "kwargs", "out_shape", "lse_shape", "floats", "counters")
        assert [getattr(got, name) for name in kept] == [getattr(fresh, name) for name in kept]
        assert got.consts == fresh.consts, f"length {length}"
        # a launch resized from a resized one: the chain keeps the length it was resized to
        back = _prepare(b, h, hk, d, 1000, mask, layout)[1].stride()[:3]
        again = got.resized(1000, back, back, 0 if key_mask is None else 1000)
        assert again is not None and again.consts == base.consts
    assert resized_some and rerouted  # both outcomes seen at every shape


def test_resized_windows_and_plans():
    # a sliding window caps the keys a step walks: past it every length takes the route, so any resize holds
    base, _, _ = _prepare(1, 8, 2, 64, 4096, False, "bshd", window_size=(255, 0), causal=True)
    for length in (300, 5000, 100_000):
        fresh, k, _ = _prepare(1, 8, 2, 64, length, False, "bshd", window_size=(255, 0), causal=True)
        assert fresh.route == base.route
        assert base.resized(length, k.stride()[:3], k.stride()[:3], 0).consts == fresh.consts
    # a plan's route (DecodePlan's) is the plan's, for its max_seqlen_k: never resized
    planned, _, _ = _prepare(1, 8, 2, 64, 4096, False, "bshd", route=base.route)
    assert planned.resized(4000, (1, 1, 1), (1, 1, 1), 0) is None


def test_same_specialisation():
    assert launch_mod.same_specialisation((16, 3, 1, 0.5), (32, 5, 1, 0.25))
    assert not launch_mod.same_specialisation((16,), (17,))  # divisible by 16, then not
    assert not launch_mod.same_specialisation((2,), (1,))  # 1 is a constant
    assert not launch_mod.same_specialisation((5,), (2**31 + 1,))  # i32, then i64
