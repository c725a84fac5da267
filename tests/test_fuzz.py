"""Every public function driven with random valid and invalid inputs (tests/fuzz_run.py): each accepted
call matches its oracle under the tolerance rule, each invalid one raises FlashAttnError, nothing crashes.
Covered: the dense, packed and varlen forwards (16-bit and FP8) and their backwards (flash_attn 2.8's private
ones too), flash_attn_with_kvcache on contiguous and paged caches (device indices out of range, checked and
unchecked), DecodePlan, block-sparse attention, merge_attention_states and the rotary layers.

CI: 2,000 calls on the torch backend and 350 through the Triton interpreter (which turns an access out of
bounds into a crash or a wrong result), plus the Triton launchers handed cu_seqlens the checks would reject
(the kernels' clamps). `-m slow` runs 50,000 on the torch backend and 5,000 under the interpreter. The GPU
test runs a sample on CUDA under compute-sanitizer memcheck. FLASHATTN_TEST_SEED explores other inputs.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import fuzz_cases
import fuzz_defects
import fuzz_run
import pytest
import torch
from conftest import SEED
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from utils import INTERPRET

from flashattn import config

_SETTINGS = dict(deadline=None, database=None, derandomize=False, print_blob=True,
                 suppress_health_check=list(HealthCheck))
TORCH_ENV = fuzz_cases.Env("cpu", (torch.float16, torch.bfloat16, torch.float32), max_len=70,
                           max_batch_heads=8, grad_chance=0.6)
# the interpreter: fp16 / fp32 (it emulates bf16 wrongly), fewer and shorter rows (its cost is per tile)
INTERPRETER_ENV = fuzz_cases.Env("cpu", (torch.float16, torch.float32), max_len=33, max_batch_heads=2,
                                 grad_chance=0.5)


def _fuzz(backend, env, n, invalid_share):
    # Hypothesis draws each call's seed, and the case is built from it (fuzz_cases draws dozens of numbers
    # a call: through st.randoms() that costs as much as the torch backend's calls themselves); a failure
    # reports the seed, which rebuilds the case: fuzz_run.draw_call(random.Random(seed), env)
    @seed(SEED)
    @settings(max_examples=n, **_SETTINGS)
    @given(st.integers(0, 2**63 - 1))
    def one(case_seed):
        fuzz_run.run_call(fuzz_run.draw_call(random.Random(case_seed), env, invalid_share))

    with config.use_backend(backend):
        one()


def test_fuzz_torch_backend():
    _fuzz("torch", TORCH_ENV, 2000, 0.35)


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter needs TRITON_INTERPRET=1 at startup")
def test_fuzz_triton_interpreter():
    _fuzz("triton", INTERPRETER_ENV, 350, 0.4)


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter needs TRITON_INTERPRET=1 at startup")
@pytest.mark.parametrize("case_seed", [8206])
def test_fuzz_cases_other_seeds_found(case_seed):
    # 8206 (FLASHATTN_TEST_SEED=12): an FP8 call with a learnable sink above its two keys' scores, whose
    # numerators the Triton forward rounded to e4m3 against the keys' max alone (3x plain PyTorch's error).
    # The case as its draw made it when there were 15 makers, independent of the makers added since
    from fuzz_cases import Draw
    from fuzz_cases_fp8 import fp8_call

    d = Draw(random.Random(case_seed))
    assert not d.chance(0.4)  # valid
    d.pick(range(15))
    call = fp8_call(d, INTERPRETER_ENV)
    assert call.name == "fp8-dense"
    with config.use_backend("triton"):
        fuzz_run.run_call(call)


@pytest.fixture
def selected_slow(request):
    # CI runs `-m "not gpu"`, which includes slow tests (the sm_90 compile check is one): the long fuzz
    # runs only when a -m expression asks for slow tests
    if "slow" not in (request.config.getoption("markexpr") or "").replace("not slow", ""):
        pytest.skip("50,000 calls: select with -m slow")


@pytest.mark.slow
def test_fuzz_torch_backend_long(selected_slow):
    _fuzz("torch", TORCH_ENV, 50_000, 0.35)


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter needs TRITON_INTERPRET=1 at startup")
def test_fuzz_triton_interpreter_long(selected_slow):
    _fuzz("triton", INTERPRETER_ENV, 5_000, 0.4)


@pytest.mark.skipif(not INTERPRET, reason="the Triton interpreter needs TRITON_INTERPRET=1 at startup")
@pytest.mark.parametrize("cu", fuzz_defects.BAD_CU_SEQLENS, ids=str)
def test_kernels_clamp_unchecked_cu_seqlens(cu):
    # the values of CUDA cu_seqlens are not checked by default (a device sync): handed straight to the
    # launchers, rows past the tokens, negative or decreasing offsets must stay inside the tensors. Without
    # the clamps the interpreter reads and writes far outside them (it aborted: heap corruption)
    fuzz_defects.launch_with_bad_cu_seqlens(cu, "cpu", torch.float16)


@pytest.mark.gpu
@pytest.mark.big_memory  # not itself, but a worker's float64 oracle beside it left it none (on the H200)
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer on the PATH")
def test_fuzz_sample_under_memcheck():
    # a sample of the same calls on CUDA (fp16 / bf16, every function, valid and invalid) and the unchecked
    # cu_seqlens, with the caching allocator off so that an access past a tensor is past its allocation;
    # in SHARDS processes side by side (compiling is the cost, and it runs on the host's cores)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root / "tests"), env.get("PYTHONPATH", "")])
    shards = 4
    procs = [subprocess.Popen(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
         str(root / "tests" / "fuzz_run.py"), "--device", "cuda", "-n", "150", "--seed", str(SEED),
         "--shard", f"{i}/{shards}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(shards)]
    try:
        for i, proc in enumerate(procs):
            log = proc.communicate(timeout=1500)[0]
            tail = f"shard {i}/{shards}:\n" + log[-4000:]
            assert proc.returncode == 0, tail
            assert "ERROR SUMMARY: 0 errors" in log, tail
            assert "fuzz sample done" in log, tail
    finally:
        for proc in procs:  # the shards still running when one fails
            proc.kill()
