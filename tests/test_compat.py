"""flashattn.compat: `import flash_attn` resolving to flashattn, and a real client (ring-flash-attn 0.1.8,
unmodified) running its ring and zigzag attention on it over gloo (tests/compat_ring.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from compat_ring import CASES, run_world

import flashattn
import flashattn.compat as compat


@pytest.fixture
def installed():
    compat.install()
    try:
        yield
    finally:
        compat.uninstall()


def test_install_maps_flash_attn_onto_flashattn(installed):
    import flash_attn
    import flash_attn.layers.rotary
    from flash_attn import flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import _flash_attn_forward, _get_block_size_n

    import flashattn.bert_padding
    import flashattn.flash_attn_interface
    import flashattn.layers.rotary

    assert flash_attn.__version__ == compat.FLASH_ATTN_VERSION and compat.installed()
    assert flash_attn.flash_attn_func is flashattn.flash_attn_func
    # with flash_attn's capacity check on the paged path
    assert flash_attn.flash_attn_with_kvcache is flashattn.flash_attn_interface.flash_attn_with_kvcache
    assert flash_attn_varlen_func is flashattn.flash_attn_varlen_func
    assert _flash_attn_forward is flashattn.flash_attn_interface._flash_attn_forward
    assert _get_block_size_n is flashattn.flash_attn_interface._get_block_size_n
    assert (pad_input, unpad_input) == (flashattn.bert_padding.pad_input, flashattn.bert_padding.unpad_input)
    assert flash_attn.layers.rotary is flashattn.layers.rotary
    assert flash_attn.flash_attn_interface is flashattn.flash_attn_interface
    assert compat.install() is flash_attn  # idempotent
    import importlib.util

    assert importlib.util.find_spec("flash_attn") is not None


@pytest.mark.parametrize("append", [False, True], ids=["long-cache", "append-past-it"])
def test_paged_calls_past_block_tables_reach_raise_as_in_flash_attn(installed, append):
    # flash_attn 2.8.4's test_flash_attn_kvcache_paged_block_table_bounds, on the CPU: one page of 16 keys
    # addressable, a sequence of 17 (or 16 plus one appended key)
    from flash_attn import flash_attn_with_kvcache

    g = torch.Generator().manual_seed(0)
    page, d = 16, 32
    kc, vc = (torch.randn(4, page, 1, d, generator=g) for _ in range(2))
    q = torch.randn(1, 1, 1, d, generator=g)
    table = torch.zeros(1, 1, dtype=torch.int32)
    new = {}
    if append:
        new = dict(k=torch.randn(1, 1, 1, d, generator=g), v=torch.randn(1, 1, 1, d, generator=g))
    long = torch.full((1,), page if append else page + 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=long, block_table=table, **new)
    # the positive control: exactly at capacity
    at = torch.full((1,), page - 1 if append else page, dtype=torch.int32)
    assert flash_attn_with_kvcache(q, kc.clone(), vc.clone(), cache_seqlens=at, block_table=table,
                                   **new).isfinite().all()
    # flashattn's own entry leaves the check opt-in (no default call syncs), as does check_inputs=False here;
    # the kernels clamp what they read
    for call in (flashattn.flash_attn_with_kvcache,
                 lambda *a, **k: flash_attn_with_kvcache(*a, check_inputs=False, **k)):
        assert call(q, kc.clone(), vc.clone(), cache_seqlens=long, block_table=table, **new).isfinite().all()


def test_other_flash_attn_modules_say_what_exists(installed):
    with pytest.raises(ModuleNotFoundError, match=r"flash_attn\.ops.*flash_attn\.flash_attn_interface"):
        import flash_attn.ops.triton.rotary  # noqa: F401
    import flash_attn_2_cuda  # the extension's entry points: provided

    assert flash_attn_2_cuda.fwd == flashattn.flash_attn_interface.flash_attn_gpu.fwd


def test_uninstall_removes_it():
    compat.install()
    compat.uninstall()
    assert not compat.installed() and "flash_attn" not in sys.modules
    with pytest.raises(ImportError):
        import flash_attn  # noqa: F401


def test_code_written_for_flash_attn_runs(installed, tmp_path, monkeypatch, capsys):
    # `python -m flashattn.compat SCRIPT`: a script importing flash_attn, run as python would
    script = tmp_path / "user.py"
    script.write_text(
        "import sys, torch\n"
        "from flash_attn import flash_attn_func\n"
        "from flash_attn.flash_attn_interface import _flash_attn_forward\n"
        "q = torch.randn(1, 5, 2, 8)\n"
        "out = flash_attn_func(q, q, q, causal=True)\n"
        "alt = _flash_attn_forward(q, q, q, 0.0, 8 ** -0.5, True, -1, -1, 0.0, None, False)[0]\n"
        "assert torch.equal(out, alt)\n"
        "try:\n"
        "    flash_attn_func(q, q[..., :4], q)\n"
        "except RuntimeError as e:\n"  # flash_attn's C++ checks are RuntimeErrors: so are ours
        "    print('caught', sys.argv[1:], type(e).__name__)\n"
    )
    compat.uninstall()
    monkeypatch.setattr(sys, "argv", sys.argv[:])
    compat.main([str(script), "x", "y"])
    assert "caught ['x', 'y'] FlashAttnError" in capsys.readouterr().out


def test_flash_attn_func_through_compat_matches(installed):
    import flash_attn

    q, k, v = (torch.randn(2, 9, 2, 16) for _ in range(3))
    assert torch.equal(flash_attn.flash_attn_func(q, k, v, causal=True), flashattn.flash_attn_func(q, k, v,
                                                                                                  causal=True))


@pytest.mark.parametrize("world", [2, 4])
def test_ring_flash_attn_on_flashattn(world):
    # ring-flash-attn 0.1.8 calls flash_attn's private forward/backward with every argument by name; every
    # case of compat_ring.CASES (ring, zigzag, kvpacked; causal and not) on every rank, forward and backward
    outcomes = run_world(world)
    assert set(outcomes) == {c[0] for c in CASES}
    failed = {name: error for name, error in outcomes.items() if error is not None}
    if failed:
        pytest.fail("\n\n".join(f"{name}:\n{error}" for name, error in failed.items()), pytrace=False)
