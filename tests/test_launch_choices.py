"""What the launchers choose before a kernel runs: the tile row (long or short sequences) and whether the
streamed tiles go through TMA descriptors. Pure host logic, so it is tested on the CPU; the kernels on both
load paths are compiled for sm_90 by tests/test_sm90_compile.py and run on the GPU by `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET
from utils import LaunchRecorder

from flashattn import flash_attn_func
from flashattn.bench import providers
from flashattn.iomodel import AttnShape, forward_io, kernel_tiles
from flashattn.iomodel.tiled import ws_backward_tiles
from flashattn.ops import attention_ws, merge, tma
from flashattn.ops.attention import _problem
from flashattn.ops.configs import _H200, _H200_SHORT, _H200_SHORT_CAUSAL, TileConfig, tile_config

CUDA = torch.device("cuda")  # the table is read on the host: no GPU needed


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    monkeypatch.delenv("FLASHATTN_CONFIG", raising=False)
    monkeypatch.delenv("FLASHATTN_TMA", raising=False)


@pytest.mark.parametrize("kernel, d", sorted(_H200))
def test_short_rows_apply_up_to_their_limit_only(kernel, d):
    long_row = _H200[(kernel, d)]
    limit, short_row = _H200_SHORT.get((kernel, d), (0, long_row))
    assert tile_config(kernel, d, CUDA) == long_row  # no length given: the long row
    assert tile_config(kernel, d, CUDA, 1) == (short_row if limit else long_row)
    assert tile_config(kernel, d, CUDA, limit) == (short_row if limit else long_row)
    assert tile_config(kernel, d, CUDA, limit + 1) == long_row
    assert tile_config(kernel, d, CUDA, 10**6) == long_row


def test_short_rows_differ_where_tuned():
    # the rows the short-N sweep changed (results/h200-2026-11-29-s3/tune_short.json)
    assert tile_config("fwd", 128, CUDA, 1024) == TileConfig(64, 64, 4, 3)
    assert tile_config("fwd", 128, CUDA, 4096) == TileConfig(128, 128, 8, 3)
    assert tile_config("dq", 64, CUDA, 2048) == TileConfig(64, 64, 4, 3)
    assert tile_config("fwd", 64, CUDA, 1024) == TileConfig(64, 64, 4, 3)
    assert tile_config("fwd", 64, CUDA, 2048) == _H200[("fwd", 64)]  # measured slower at 2K
    assert tile_config("dkdv", 128, CUDA, 1024) == _H200[("dkdv", 128)]


@pytest.mark.parametrize("kernel, d", sorted(_H200_SHORT_CAUSAL))
def test_causal_short_rows_apply_to_causal_calls_up_to_their_limit(kernel, d):
    limit, causal_row = _H200_SHORT_CAUSAL[(kernel, d)]
    assert tile_config(kernel, d, CUDA, 1, causal=True) == causal_row
    assert tile_config(kernel, d, CUDA, limit, causal=True) == causal_row
    assert tile_config(kernel, d, CUDA, limit + 1, causal=True) == _H200[(kernel, d)]
    assert tile_config(kernel, d, CUDA, causal=True) == _H200[(kernel, d)]
    # without the mask the plain short rows hold
    assert tile_config(kernel, d, CUDA, limit) == _H200[(kernel, d)]


def test_d64_gluon_forward_takes_two_consumers_to_4k_causal():
    # NOTES v40: two consumer warpgroups (128-row tiles) win at 2K and 4K causal, three win past them and
    # without the mask past 1K
    two, three = TileConfig(128, 128, 4, 3), _H200[("fwd_ws", 64)]
    assert three.block_m == 192
    assert [attention_ws.forward_config(64, CUDA, n, causal=True) for n in (1024, 2048, 4096, 8192)] == \
        [two, two, two, three]
    assert [attention_ws.forward_config(64, CUDA, n) for n in (1024, 2048, 4096)] == [two, three, three]
    assert attention_ws.forward_config(128, CUDA, 2048, causal=True) == _H200[("fwd_ws", 128)]


def test_d64_gluon_backward_steps_by_mask():
    # NOTES v42: 128-row steps without the mask, 64-row ones under it; d = 128 has one row for both
    assert tile_config("bwd_ws", 64, CUDA) == TileConfig(128, 128, 4, 2)
    assert tile_config("bwd_ws", 64, CUDA, 1024) == TileConfig(128, 128, 4, 2)
    assert tile_config("bwd_ws", 64, CUDA, causal=True) == TileConfig(64, 128, 4, 3)
    assert tile_config("bwd_ws", 64, CUDA, 1024, causal=True) == TileConfig(64, 128, 4, 3)
    assert tile_config("bwd_ws", 128, CUDA, causal=True) == tile_config("bwd_ws", 128, CUDA)
    assert ws_backward_tiles(AttnShape(1, 16, 4096, 64)) == (128, 128)
    assert ws_backward_tiles(AttnShape(1, 16, 4096, 64, causal=True)) == (64, 128)


def test_override_beats_the_short_row(monkeypatch):
    monkeypatch.setenv("FLASHATTN_CONFIG", "fwd=32,32,4,2")
    assert tile_config("fwd", 128, CUDA, 1024) == TileConfig(32, 32, 4, 2)


def test_override_with_a_register_cap(monkeypatch):
    # a fifth number is maxnreg; the shipped table sets none (ptxas decides)
    monkeypatch.setenv("FLASHATTN_CONFIG", "dkdv=32,128,8,3,128")
    assert tile_config("dkdv", 64, CUDA, 4096) == TileConfig(32, 128, 8, 3, 128)
    assert all(cfg.maxnreg is None for cfg in _H200.values())


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_launches_carry_the_register_cap(monkeypatch):
    from flashattn.ops import attention as launchers

    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_kernel"):
        kernel = getattr(launchers, name)
        monkeypatch.setattr(launchers, name, LaunchRecorder(kernel, calls, options=("num_warps", "maxnreg")))
    monkeypatch.setenv("FLASHATTN_CONFIG", "fwd=32,16,4,1,96;dkdv=16,32,4,1,80")
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    # forward, then the backward's dK/dV role and its dQ role (no override: no cap)
    assert [opts["maxnreg"] for _, opts in calls] == [96, 80, None]


def test_io_model_follows_the_short_rows():
    assert kernel_tiles("fwd", 128, 1024) == (64, 64)
    assert kernel_tiles("fwd", 128, 8192) == (128, 128)


def test_io_model_follows_the_gluon_forward(monkeypatch):
    monkeypatch.delenv("FLASHATTN_WS", raising=False)
    gluon = (_H200[("fwd_ws", 128)].block_m, _H200[("fwd_ws", 128)].block_n)
    assert kernel_tiles("fwd", 128, 1024, causal=False) == gluon  # its launcher takes N = 1K non-causal
    assert kernel_tiles("fwd", 128, 1024, causal=True) == gluon
    assert kernel_tiles("fwd", 128, 4096, causal=True) == gluon
    # d = 64: two consumers up to 1K (the short row) and to 4K causal (NOTES v40), three past them (192-row
    # tiles)
    two = _H200_SHORT[("fwd_ws", 64)][1]
    assert kernel_tiles("fwd", 64, 1024, causal=False) == (two.block_m, two.block_n) == (128, 128)
    assert kernel_tiles("fwd", 64, 1024, causal=True) == (128, 128)
    assert kernel_tiles("fwd", 64, 2048, causal=False) == (192, 128)
    assert kernel_tiles("fwd", 64, 4096, causal=True) == (128, 128)
    assert kernel_tiles("fwd", 64, 8192, causal=True) == (192, 128)
    assert kernel_tiles("fwd", 64, 16384, causal=False) == (192, 128)
    assert forward_io(AttnShape(16, 16, 1024, 128)).detail["block_m"] == gluon[0]
    assert forward_io(AttnShape(16, 16, 1024, 128, window=(256, 0))).detail["block_m"] == 64
    monkeypatch.setenv("FLASHATTN_WS", "0")
    assert kernel_tiles("fwd", 128, 1024, causal=False) == (64, 64)


def _tensors(b=1, s=130, h=4, d=128, dtype=torch.bfloat16):
    return [torch.randn(b, s, h, d, dtype=dtype) for _ in range(3)]


def _descriptors(q, k, v, cfg):
    pb = _problem(q, k, v, 0.1, False, (-1, -1), 0.0, None, 0.0, 0, 0, None, 130, 130)
    return pb.descriptors(cfg, cfg.block_n, k, v)


@pytest.fixture
def fake_sm90(monkeypatch):
    monkeypatch.setattr(tma, "device_ok", lambda t: True)


def test_cpu_tensors_take_the_pointer_path():
    q, k, v = _tensors()
    use, descs = _descriptors(q, k, v, TileConfig(128, 128, 8, 3))
    assert use is False and descs == [None, None]


def test_descriptors_at_d128_with_three_stages(fake_sm90):
    q, k, v = _tensors()
    use, descs = _descriptors(q, k, v, TileConfig(128, 64, 8, 3))
    assert use is True
    assert descs[0].block_shape == [1, 64, 1, 128]
    assert descs[0].shape == list(k.shape) and descs[0].strides == list(k.stride())


@pytest.mark.parametrize("why, d, cfg, dtype", [
    ("d = 64 is faster on pointers", 64, TileConfig(128, 64, 8, 3), torch.bfloat16),
    ("d = 256 tiles pipeline over 2 stages", 256, TileConfig(128, 64, 8, 3), torch.bfloat16),
    ("2 stages crash ptxas", 128, TileConfig(128, 64, 8, 2), torch.bfloat16),
    ("fp32 has no descriptor path", 128, TileConfig(128, 64, 8, 3), torch.float32),
])
def test_pointer_path_kept(fake_sm90, why, d, cfg, dtype):
    q, k, v = _tensors(d=d, dtype=dtype)
    assert _descriptors(q, k, v, cfg)[0] is False, why


def test_env_switch_and_alignment(fake_sm90, monkeypatch):
    q, k, v = _tensors()
    cfg = TileConfig(128, 64, 8, 3)
    monkeypatch.setenv("FLASHATTN_TMA", "0")
    assert _descriptors(q, k, v, cfg)[0] is False
    monkeypatch.delenv("FLASHATTN_TMA")
    # a view starting one element in: its base is not 16-byte aligned
    flat = torch.randn(k.numel() + 1, dtype=torch.bfloat16)
    k_off = flat[1:].view(k.shape)
    assert _descriptors(q, k_off, v, cfg)[0] is False
    # aligned base, but a row stride of 129 elements (258 bytes): not a multiple of 16 bytes
    k_wide = torch.randn(*k.shape[:-1], k.shape[-1] + 1, dtype=torch.bfloat16)[..., :k.shape[-1]]
    assert _descriptors(q, k_wide, v, cfg)[0] is False
    assert _descriptors(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, cfg)[0] is True  # heads-major
    assert _descriptors(q, k, v, cfg)[0] is True


def test_varlen_takes_the_pointer_path(fake_sm90):
    # packed sequences: a tile past a sequence's end would read the next sequence, not zeros
    assert tma.usable(*_tensors(), varlen=True) is False


def test_pointer_provider_turns_descriptors_off():
    import os

    prepared = providers.get("flashattn-ptr").setup(_case(), *_tensors(d=64))
    with prepared.context():
        assert os.environ["FLASHATTN_TMA"] == "0"
    assert "FLASHATTN_TMA" not in os.environ


@pytest.mark.parametrize("name, var, value", [("flashattn-triton", "FLASHATTN_WS", "0"),
                                              ("flashattn-ws-tiles", "FLASHATTN_WS_GRID", "tiles")])
def test_gluon_ab_providers(name, var, value, monkeypatch):
    import os

    monkeypatch.delenv(var, raising=False)
    prepared = providers.get(name).setup(_case(), *_tensors(d=64))
    with prepared.context():
        assert os.environ[var] == value
    assert var not in os.environ


def _case():
    from flashattn.bench.case import Case

    return Case(1, 4, 4, 130, 130, 64, False, "bf16", {})


def test_bits_provider_turns_the_rule_off():
    import os

    from flashattn.bench.case import Case

    case = Case(1, 2, 2, 256, 256, 32, False, "fp32",
                {"pattern": "local_global", "target_density": 0.5, "window": 32, "global_tokens": 128})
    q, k, v = (torch.randn(1, 256, 2, 32) for _ in range(3))
    prepared = providers.get("flashattn-sparse-bits").setup(case, q, k, v)
    with prepared.context():
        assert os.environ["FLASHATTN_SPARSE_RULE"] == "0"
    assert "FLASHATTN_SPARSE_RULE" not in os.environ


# -------------------------------------------------------- the warp-specialised forward (ops/attention_ws.py)


def _ws_eligible(monkeypatch, sq=2048, sk=2048, d=128, causal=False, dtype=torch.bfloat16, q=None,
                 window_size=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, sink=None):
    monkeypatch.setattr(tma, "device_ok", lambda t: True)  # as on an H200
    q = torch.zeros(1, sq, 4, d, dtype=dtype) if q is None else q
    k = v = torch.zeros(1, sk, 2, d, dtype=dtype)
    pb = _problem(q, k, v, 0.1, causal, window_size, softcap, alibi, dropout_p, 0, 0, None, None, None)
    return attention_ws.eligible(pb, q, k, v, sink)


def test_ws_takes_the_plain_d128_case(monkeypatch):
    assert _ws_eligible(monkeypatch)
    assert _ws_eligible(monkeypatch, causal=True)
    assert _ws_eligible(monkeypatch, sq=1024, sk=1024)  # non-causal at 1K: measured +37%
    assert _ws_eligible(monkeypatch, sq=1, sk=1, dtype=torch.float16)
    assert _ws_eligible(monkeypatch, sq=100, sk=1100, causal=True)
    assert _ws_eligible(monkeypatch, sq=1024, sk=1024, causal=True)  # short causal: its dynamic tile order
    assert _ws_eligible(monkeypatch, window_size=(-1, 0))  # causal written as a window


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(d=96),
        dict(window_size=(64, 0)),
        dict(window_size=(-1, 8)),
        dict(softcap=5.0),
        dict(alibi=torch.ones(4)),
        dict(dropout_p=0.1),
        dict(sink=torch.zeros(4)),
        dict(dtype=torch.float32),
        dict(q=torch.zeros(1, 2048, 4, 129, dtype=torch.bfloat16)[..., :128]),  # rows not 16-byte aligned
    ],
    ids=lambda kw: ",".join(f"{k}" for k in kw),
)
def test_ws_leaves_everything_else_to_triton(monkeypatch, kwargs):
    assert not _ws_eligible(monkeypatch, **kwargs)


def test_ws_switch_off(monkeypatch):
    monkeypatch.setenv("FLASHATTN_WS", "0")
    assert not _ws_eligible(monkeypatch)


def test_ws_takes_d64_at_any_length(monkeypatch):
    # causal past 1K too, since three consumer warpgroups (NOTES v33)
    assert _ws_eligible(monkeypatch, d=64)
    assert _ws_eligible(monkeypatch, d=64, sq=16384, sk=16384)
    assert _ws_eligible(monkeypatch, d=64, sq=1024, sk=1024, causal=True)
    assert _ws_eligible(monkeypatch, d=64, causal=True)
    assert not _ws_eligible(monkeypatch, d=96, causal=True)


def test_ws_grid(monkeypatch):
    monkeypatch.setattr(merge, "sm_count", lambda device: 132)
    monkeypatch.delenv("FLASHATTN_WS_GRID", raising=False)
    assert attention_ws.programs(2048, CUDA) == 132  # persistent
    assert attention_ws.programs(100, CUDA) == 100
    monkeypatch.setenv("FLASHATTN_WS_GRID", "tiles")
    assert attention_ws.programs(2048, CUDA) == 2048


def _ws_bwd_eligible(monkeypatch, on=None, deterministic=False, d=128, sq=2048):
    monkeypatch.setattr(tma, "device_ok", lambda t: True)
    if on is None:
        monkeypatch.delenv("FLASHATTN_WS_BWD", raising=False)
    else:
        monkeypatch.setenv("FLASHATTN_WS_BWD", on)
    q = torch.zeros(1, sq, 4, d, dtype=torch.bfloat16)
    k = v = torch.zeros(1, sq, 2, d, dtype=torch.bfloat16)
    pb = _problem(q, k, v, 0.1, True, (-1, -1), 0.0, None, 0.0, 0, 0, None, None, None)
    return attention_ws.bwd_eligible(pb, q, k, v, q, None, deterministic)


def test_ws_backward_choice(monkeypatch):
    assert _ws_bwd_eligible(monkeypatch)  # on by default
    assert _ws_bwd_eligible(monkeypatch, d=64)
    assert _ws_bwd_eligible(monkeypatch, on="1")
    assert not _ws_bwd_eligible(monkeypatch, on="0")
    assert not _ws_bwd_eligible(monkeypatch, deterministic=True)  # dQ by reduce-adds: order varies
    assert not _ws_bwd_eligible(monkeypatch, d=96)
    # the float32 dQ buffer must stay under the cap (the 128K-token memory target has no room for it)
    monkeypatch.setattr(attention_ws, "_DQ_BUFFER_CAP", 2048 * 4 * 128 * 4)
    assert _ws_bwd_eligible(monkeypatch)
    assert not _ws_bwd_eligible(monkeypatch, sq=2049)


@pytest.mark.parametrize("spec", ["128,64,4,4", "192,64,4,3", "64,128,4,3", "256,128,4,3", "128,128,4,1"])
def test_gluon_forward_refuses_configs_it_cannot_run(monkeypatch, spec):
    # 64-key tiles gave wrong causal rows (NOTES v36): an override the kernel cannot run must fail loudly
    monkeypatch.setenv("FLASHATTN_CONFIG", f"fwd_ws={spec}")
    with pytest.raises(ValueError, match=f"fwd_ws={spec} is not a config of the Gluon forward"):
        attention_ws.forward_config(64, CUDA, 4096)


@pytest.mark.parametrize("spec", ["128,128,4,3", "192,128,4,3", "128,128,4,2"])
def test_gluon_forward_takes_its_configs(monkeypatch, spec):
    monkeypatch.setenv("FLASHATTN_CONFIG", f"fwd_ws={spec}")
    assert attention_ws.forward_config(128, CUDA, 1024) == TileConfig.parse(spec)
    monkeypatch.delenv("FLASHATTN_CONFIG")
    assert attention_ws.forward_config(64, CUDA, 1024) == _H200_SHORT[("fwd_ws", 64)][1]
    assert attention_ws.forward_config(64, CUDA, 4096) == _H200[("fwd_ws", 64)]
