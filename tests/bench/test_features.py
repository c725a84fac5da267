"""The `features` bench suite on the CPU: its cases, FLOP counting for windows and packed sequences, the
oracle's window / per-sequence slices, the providers on tiny tensors, and an end-to-end smoke run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from flashattn.bench import cli, providers, results, suites
from flashattn.bench.case import Case, window_pairs
from flashattn.bench.check import Oracle, choose_slice
from flashattn.bench.flops import MODE_FACTOR
from flashattn.bench.providers.features import cu_seqlens, mask_mod_for
from flashattn.bench.suites.features import (
    FeatureGrid,
    annotate,
    applies,
    build_cases,
    nearest_equal,
    packed_lengths,
)
from flashattn.reference import attention_ref, attention_ref_varlen

SUITE = suites.get("features")


def _extra(feature, tokens, window=(-1, -1), lengths=None):
    return {
        "feature": feature,
        "window_left": window[0],
        "window_right": window[1],
        "lengths": None if lengths is None else list(lengths),
        "tokens": tokens,
    }


def _packed(lengths, causal, h=2, hk=2, d=8, window=(-1, -1), dtype="float32"):
    t = sum(lengths)
    return Case(1, h, hk, t, t, d, causal, dtype, _extra("varlen", t, window, lengths))


def _windowed(n, window, causal=False, b=1, h=2, sk=None, dtype="float32"):
    return Case(b, h, h, n, sk or n, 8, causal, dtype, _extra("window", b * n, window))


# -- the cases


def test_default_cases():
    cases = SUITE.build_cases(SUITE.grid(False))
    packed = [c for c in cases if c.lengths is not None]
    assert len(cases) == 8 and len(packed) == 2
    lengths = packed[0].lengths
    assert lengths == (394, 4808, 3641, 7541) and sum(lengths) == 16384
    assert all(128 <= n <= 8192 for n in lengths)
    for c in packed:
        assert (c.batch, c.seqlen_q, c.seqlen_k, c.nheads, c.headdim, c.dtype) == (
            1,
            16384,
            16384,
            16,
            128,
            "bfloat16",
        )
        assert c.extra == _extra("varlen", 16384, lengths=lengths)
    assert {c.causal for c in packed} == {False, True}
    equal = sorted(
        (c.batch, c.seqlen_q, c.causal) for c in cases if c.extra["feature"] == "varlen" and not c.masked
    )
    assert equal == [(2, 8192, False), (2, 8192, True), (4, 4096, False), (4, 4096, True)]
    window = [c for c in cases if c.extra["feature"] == "window"]
    assert [(c.batch, c.seqlen_q, c.causal, c.window) for c in window] == [
        (1, 16384, False, (1024, 1024)),
        (1, 16384, False, (-1, -1)),
    ]
    assert all(c.extra["tokens"] == 16384 and c.extra["lengths"] is None for c in window)
    # the fields a row gets from the case
    row = results.new_row("features", "flashattn-window", "fwd", window[0])
    assert {"feature", "window_left", "window_right", "lengths", "tokens"} <= set(row)


def test_quick_cases_keep_one_packed_case_and_its_baseline():
    grid = SUITE.grid(True)
    assert isinstance(grid, FeatureGrid) and grid.quick
    cases = SUITE.build_cases(grid)
    labels = [(c.extra["feature"], c.batch, c.seqlen_q, c.causal, c.window) for c in cases]
    assert labels == [
        ("varlen", 1, 16384, True, (-1, -1)),
        ("varlen", 4, 4096, True, (-1, -1)),
        ("window", 1, 16384, False, (1024, 1024)),
        ("window", 1, 16384, False, (-1, -1)),
    ]


def test_overrides_shape_every_feature():
    grid = SUITE.grid(False).override(seqlens=(256,), tokens=512, headdims=(16,), nheads=2, causal=(True,))
    cases = build_cases(grid)
    assert sum(cases[0].lengths) == 512
    # causal only: the causal sliding window, (left, 0), with batch = tokens // N
    window = [c for c in cases if c.extra["feature"] == "window"]
    assert [(c.batch, c.causal, c.window) for c in window] == [(2, True, (16, 0)), (2, True, (-1, -1))]
    assert {c.headdim for c in cases} == {16} and {c.nheads for c in cases} == {2}


@pytest.mark.parametrize("tokens", [64, 512, 1000, 16384, 65536])
@pytest.mark.parametrize("seed", [0, 1, 10])
def test_packed_lengths_sum_exactly_within_range(tokens, seed):
    lengths = packed_lengths(tokens, seed)
    assert sum(lengths) == tokens
    lo, hi = max(1, tokens // 128), max(2 * max(1, tokens // 128), tokens // 2)
    assert all(lo <= n <= hi for n in lengths), lengths
    assert packed_lengths(tokens, seed) == lengths  # deterministic


def test_nearest_equal_is_on_a_log_scale():
    assert nearest_equal(16384, (394, 4808, 3641, 7541), (4096, 8192)) == 4096
    assert nearest_equal(16384, (8000, 8384), (4096, 8192)) == 8192
    # mean 5461: 4096 is 1.33x away, 8192 1.5x
    assert nearest_equal(16384, (5000, 5000, 6384), (4096, 8192)) == 4096


def test_applies_pairs_providers_with_their_cases():
    packed, window = _packed((3, 5), True), _windowed(16, (2, 2))
    plain = Case(1, 2, 2, 16, 16, 8, False, "float32", _extra("window", 16))
    for name in ("flashattn-varlen", "flex-document"):
        assert applies(packed, name) and not applies(window, name) and not applies(plain, name)
    for name in ("flashattn-window", "flex-window"):
        assert applies(window, name) and not applies(packed, name) and not applies(plain, name)
    for name in ("flashattn", "flex", "sdpa-flash"):
        assert applies(plain, name) and not applies(packed, name) and not applies(window, name)


# -- FLOP counting


def test_window_pairs_by_hand():
    # N=8, left=right=2: rows 0,1 see 3,4 keys; rows 2-5 five each; rows 6,7 four and three
    assert window_pairs(8, 8, False, (2, 2)) == 3 + 4 + 5 * 4 + 4 + 3 == 34
    # causal forces right=0: rows see 1, 2, then 3 keys
    assert window_pairs(8, 8, True, (2, 2)) == 1 + 2 + 3 * 6 == 21
    # the target's shape: 16K rows of 2049 keys, less the two clipped triangles of 1+2+...+1024
    assert window_pairs(16384, 16384, False, (1024, 1024)) == 16384 * 2049 - 1024 * 1025
    # one side unbounded: left=-1, right=1 on N=4 -> 2, 3, 4, 4
    assert window_pairs(4, 4, False, (-1, 1)) == 13
    # no window: the papers' convention, half the square when causal
    assert window_pairs(6, 6, True) == 18 and window_pairs(6, 6, False) == 36


@pytest.mark.parametrize(
    "sq,sk,causal,window",
    [
        (8, 8, False, (2, 2)),
        (5, 9, False, (1, 3)),
        (9, 5, True, (2, -1)),
        (7, 7, False, (0, 0)),
        (6, 10, True, (3, 3)),
    ],
)
def test_window_pairs_match_the_reference_mask(sq, sk, causal, window):
    left, right = window
    right = 0 if causal else right
    i = torch.arange(sq).view(-1, 1) + sk - sq
    j = torch.arange(sk).view(1, -1)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    assert window_pairs(sq, sk, causal, window) == keep.sum().item()


def test_varlen_pairs_by_hand():
    # lengths 3 and 5: 9 + 25 pairs; causal halves each square as the train suite does for sq = sk
    assert _packed((3, 5), False).visible_pairs() == 34
    assert _packed((3, 5), True).visible_pairs() == 4.5 + 12.5
    # a window inside each sequence: (1, 1) on 3 -> 2+3+2, on 5 -> 2+3+3+3+2
    assert _packed((3, 5), False, window=(1, 1)).visible_pairs() == 7 + 13
    # the default packing at 16K, non-causal: sum of squares, well under the 16K^2 of one sequence
    sizes = (394, 4808, 3641, 7541)
    assert _packed(sizes, False).visible_pairs() == sum(n * n for n in sizes) == 93395662
    # a plain batch still counts batch x pairs
    assert _windowed(8, (2, 2), b=3).visible_pairs() == 3 * 34


# -- the oracle: window bands and per-sequence slices


def _full_reference(case, q, k, v):
    """attention_ref over the whole problem, float64, with the case's mask."""
    q, k, v = (x.double() for x in (q, k, v))
    if case.lengths is not None:
        cu = cu_seqlens(case.lengths, q.device)
        out = attention_ref_varlen(q[0], k[0], v[0], cu, cu, causal=case.causal, window_size=case.window)[0]
        return out.unsqueeze(0)
    return attention_ref(q, k, v, causal=case.causal, window_size=case.window)[0]


def _verdict(case, provider_fn, budget=None):
    torch.manual_seed(0)
    q = torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim)
    k, v = (torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim) for _ in range(2))
    dout = torch.randn_like(q)
    kw = {} if budget is None else {"budget_bytes": budget}
    oracle = Oracle(case, q, k, v, dout, grads=True, **kw)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = provider_fn(case, *leaves)
    grads = torch.autograd.grad(out, leaves, oracle.masked_dout(dout).to(out.dtype))
    return oracle, oracle.check(out.float(), [g.float() for g in grads])


CASES = [
    _windowed(200, (5, 5)),
    _windowed(200, (5, 5), causal=True),
    _windowed(150, (4, 2), sk=220),  # more keys than queries: the band is aligned bottom-right
    _windowed(220, (3, 6), sk=150),  # fewer keys: the first rows see nothing
    _windowed(150, (7, 7), causal=True, sk=220),
    _packed((7, 150, 2, 90), False),
    _packed((7, 150, 2, 90), True),
    _packed((90, 150, 2, 7), True, window=(3, 3)),
    _packed((0, 130, 13, 5), False, h=4, hk=2),  # an empty sequence first, GQA
]


# all rows, or the smallest row blocks (64 rows: 32 first and 32 last of each problem or sequence)
@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_oracle_accepts_the_right_mask(case, budget):
    oracle, verdict = _verdict(case, lambda c, q, k, v: _full_reference(c, q, k, v), budget)
    assert verdict.fwd_error is None and verdict.bwd_error is None, (verdict, oracle.checked_on)
    assert verdict.out_err < 1e-6 and verdict.grad_err < 1e-6


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_oracle_rejects_attention_without_the_mask(case):
    def unmasked(c, q, k, v):
        return attention_ref(q.double(), k.double(), v.double(), causal=c.causal)[0]

    _, verdict = _verdict(case, unmasked)
    assert verdict.fwd_error is not None and verdict.fwd_error.startswith("wrong result")


def test_varlen_slice_checks_the_first_two_sequences():
    case = _packed((0, 300, 200, 50), True)
    slc = choose_slice(case)
    assert slc.row_blocks == ((0, 300), (300, 500))
    # a small budget slices each sequence into its first and last rows, never across sequences; rows per
    # sequence follow its own key count (64 rows of 300 keys fit, so 96 of 200)
    slc = choose_slice(case, budget_bytes=8 * 2 * 300 * 64)
    assert slc.row_blocks == ((0, 32), (268, 300), (300, 348), (452, 500))
    assert "sequences 1, 2 of 4" in slc.describe(case)
    # keys: the block's own sequence only, up to the diagonal when causal
    assert slc.key_range(case, 300, 348)[:2] == (300, 348)
    assert slc.key_range(case, 468, 500)[:2] == (300, 500)


def test_window_slice_reads_only_the_band():
    case = _windowed(1000, (16, 16))
    # 3 blocks of R rows against R + 32 keys: 3 * 2 heads * 8 bytes * R * (R + 32) <= budget gives R = 167
    slc = choose_slice(case, budget_bytes=8 * 2 * 1000 * 100)
    assert slc.row_blocks == ((0, 167), (417, 584), (833, 1000))
    assert slc.key_range(case, 0, 167)[:2] == (0, 183)
    assert slc.key_range(case, 417, 584)[:2] == (401, 600)  # the middle: neither edge clips the band
    assert slc.key_range(case, 833, 1000)[:2] == (817, 1000)
    assert "window (16, 16)" in slc.describe(case)
    # full attention at the same budget only affords 50 + 50 rows against all 1000 keys
    assert choose_slice(_windowed(1000, (-1, -1)), budget_bytes=8 * 2 * 1000 * 100).row_blocks == (
        (0, 50),
        (950, 1000),
    )
    # the target's shape: three blocks of 1553 rows, each well within the default budget
    big = choose_slice(_windowed(16384, (1024, 1024), h=16))
    assert [b - a for a, b in big.row_blocks] == [1553] * 3


# -- providers on tiny CPU tensors


def _inputs(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim, generator=g)
    k, v = (
        torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim, generator=g) for _ in range(2)
    )
    return q, k, v


@pytest.mark.parametrize(
    "name,case",
    [
        ("flashattn-window", _windowed(48, (5, 7))),
        ("flashattn-window", _windowed(48, (5, 7), causal=True)),
        ("flashattn-varlen", _packed((7, 23, 2, 16), False)),
        ("flashattn-varlen", _packed((7, 23, 2, 16), True, h=4, hk=2)),
        ("flashattn-varlen", _packed((7, 23, 2, 16), True, window=(4, 4))),
    ],
    ids=lambda x: x if isinstance(x, str) else x.label(),
)
def test_flashattn_providers_match_the_reference(name, case):
    q, k, v = _inputs(case)
    prep = providers.get(name).setup(case, q, k, v)
    with prep.context():
        out = prep.fwd()
    assert out.shape == q.shape
    assert (out.double() - _full_reference(case, q, k, v)).abs().max() < 1e-5


def test_varlen_provider_refuses_a_plain_case():
    case = _windowed(16, (2, 2))
    with pytest.raises(ValueError, match="no lengths"):
        providers.get("flashattn-varlen").setup(case, *_inputs(case))


@pytest.mark.parametrize(
    "case",
    [
        _windowed(160, (20, 20)),
        _windowed(160, (20, 0), causal=True),
        _windowed(96, (8, 8), sk=160),
        _packed((37, 150, 3, 66), False),
        _packed((37, 150, 3, 66), True),
    ],
    ids=lambda c: c.label(),
)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_mask_mod_is_the_case_mask(case):
    """flex on the CPU runs eager and forward only (no flex backward there); the mask is what is checked."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = _inputs(case)
    block_mask = create_block_mask(
        mask_mod_for(case, q.device), None, None, case.seqlen_q, case.seqlen_k, "cpu"
    )
    out = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask).transpose(1, 2)
    assert (out.double() - _full_reference(case, q, k, v)).abs().max() < 1e-5


def test_flex_mask_mod_is_none_for_full_attention():
    assert mask_mod_for(Case(1, 2, 2, 8, 8, 8, False, "float32"), torch.device("cpu")) is None


# -- annotate: the target ratios


def _row(provider, mode, case, ms, tflops):
    row = results.new_row("features", provider, mode, case)
    row.update(ms=ms, tflops=tflops)
    return row


def test_annotate_computes_the_target_ratios():
    lengths = packed_lengths(16384)
    packed = Case(1, 16, 16, 16384, 16384, 128, True, "bfloat16", _extra("varlen", 16384, lengths=lengths))
    eq4 = Case(4, 16, 16, 4096, 4096, 128, True, "bfloat16", _extra("varlen", 16384))
    eq8 = Case(2, 16, 16, 8192, 8192, 128, True, "bfloat16", _extra("varlen", 16384))
    win = Case(1, 16, 16, 16384, 16384, 128, False, "bfloat16", _extra("window", 16384, (1024, 1024)))
    full = Case(1, 16, 16, 16384, 16384, 128, False, "bfloat16", _extra("window", 16384))
    rows = [
        _row("flashattn-varlen", "fwd", packed, 1.0, 380.0),
        _row("flex-document", "fwd", packed, 2.0, 200.0),
        _row("flashattn", "fwd", eq4, 1.0, 400.0),
        _row("flashattn", "fwd", eq8, 1.0, 450.0),
        _row("flashattn-window", "fwd+bwd", win, 1.5, 300.0),
        _row("flex-window", "fwd+bwd", win, 3.0, 150.0),
        _row("flashattn", "fwd+bwd", full, 10.0, 400.0),
    ]
    annotate(rows)
    by = {(r["provider"], r["seqlen_q"], r["feature"]): r for r in rows}
    v = by[("flashattn-varlen", 16384, "varlen")]
    assert v["target_ratio"] == pytest.approx(380 / 400) and v["meets_target"] is True  # mean 4K: vs b=4
    assert "b=4 N=4096" in v["target"]
    d = by[("flex-document", 16384, "varlen")]
    assert d["target_ratio"] == pytest.approx(0.5) and "meets_target" not in d
    w = by[("flashattn-window", 16384, "window")]
    assert w["target_ratio"] == pytest.approx(10 / 1.5) and w["meets_target"] is True
    assert by[("flex-window", 16384, "window")]["target_ratio"] == pytest.approx(10 / 3)
    assert "target_ratio" not in by[("flashattn", 4096, "varlen")]
    # a slow run misses the target; annotating again replaces the earlier verdict
    rows[0]["tflops"] = 300.0
    annotate(rows)
    assert rows[0]["meets_target"] is False


# -- end to end on the CPU


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_features_suite_smoke_on_cpu(tmp_path):
    args = _parse(
        "--suite", "features", "--device", "cpu", "--quick", "--quiet", "--no-plots",
        "--seqlens", "64", "--tokens", "128", "--headdims", "16", "--nheads", "2", "--dtype", "fp32",
        "--providers", "flashattn-varlen,flashattn,flashattn-window", "--modes", "fwd,fwd+bwd",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert cli.run(args) == 0
    doc = json.loads((tmp_path / "features.json").read_text())
    rows = doc["rows"]
    # quick: packed causal + its b=4 baseline, window + full; one provider each, two modes
    assert len(rows) == 4 * 2
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["ms"] > 0 and row["tflops"] > 0 and row["max_abs_err"] < 1e-4
        assert {"feature", "window_left", "window_right", "lengths", "tokens"} <= set(row)
    varlen = [r for r in rows if r["provider"] == "flashattn-varlen"]
    assert all(sum(r["lengths"]) == 128 and r["causal"] for r in varlen)
    assert all(r["checked_on"].startswith("batch 0 (packed)") for r in varlen)
    for r in varlen:
        # TFLOP/s from the useful pairs only
        case = _packed(tuple(r["lengths"]), True, d=16)
        flops = 4 * 2 * case.visible_pairs() * 16 * MODE_FACTOR[r["mode"]]
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
        assert r["target_ratio"] > 0 and "b=4 N=32" in r["target"]
    window = [r for r in rows if r["provider"] == "flashattn-window"]
    assert all((r["window_left"], r["window_right"]) == (4, 4) for r in window)
    assert all(r["target_ratio"] > 0 for r in window)
    md = (tmp_path / "features.md").read_text()
    assert "## fwd: vs baseline" in md and "## fwd+bwd: TFLOP/s" in md
