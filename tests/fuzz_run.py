"""Draws and runs the fuzz calls (tests/fuzz_cases*.py: valid ones with their oracle; tests/fuzz_defects.py:
invalid ones). tests/test_fuzz.py runs them on the CPU; `python tests/fuzz_run.py --device cuda -n 150` is the
GPU sample its GPU test runs under compute-sanitizer memcheck (with the launchers' unchecked cu_seqlens).

`draw_call(r, env)` turns a random.Random into a `Call`; `run_call` runs it: a valid call must pass its
check (the unchecked out-of-range device indices of fuzz_defects.UNCHECKED are drawn among the valid calls),
an invalid one must raise FlashAttnError, nothing may crash.
"""

from __future__ import annotations

import random
from collections import Counter

import torch
from fuzz_cases import (
    Call,
    Draw,
    Env,
    dense_call,
    kvcache_call,
    merge_call,
    private_backward_call,
    rotary_call,
    sparse_call,
    varlen_call,
)
from fuzz_cases_api import paged_prefill_call, rotary_packed_call, varlen_backward_call
from fuzz_cases_decode import decode_plan_call, paged_kvcache_call
from fuzz_cases_fp8 import fp8_call
from fuzz_defects import BAD_CU_SEQLENS, INVALID, UNCHECKED, launch_with_bad_cu_seqlens

from flashattn.errors import FlashAttnError

# the valid calls' makers (dense and varlen twice: the most used)
VALID = [dense_call, dense_call, varlen_call, varlen_call, private_backward_call, kvcache_call, sparse_call,
         merge_call, rotary_call, paged_kvcache_call, decode_plan_call, fp8_call, varlen_backward_call,
         rotary_packed_call, paged_prefill_call]


def draw_call(r: random.Random, env: Env, invalid_share: float = 0.35) -> Call:
    d = Draw(r)
    makers = INVALID if d.chance(invalid_share) else VALID + UNCHECKED
    return d.pick(makers)(d, env)


# calls run per (name, valid or the defect's kind): how the fuzz shares its calls among the functions
COUNTS: Counter = Counter()


def run_call(call: Call) -> None:
    """Runs one call: a valid one passes its oracle check, an invalid one raises FlashAttnError (whose
    message names the argument where the call says which, Call.detail["names"])."""
    COUNTS[call.name, "invalid" if call.invalid else "valid"] += 1
    try:
        result = call.run()
    except FlashAttnError as e:
        if call.invalid is None:
            raise AssertionError(f"{call.name}: a valid call was rejected: {e}") from e
        msg = str(e)
        assert msg and len(msg) > 20, f"{call.name} ({call.invalid}): an unhelpful message {msg!r}"
        names = call.detail.get("names")
        assert names is None or names in msg, f"{call.name} ({call.invalid}): {msg!r} does not name {names!r}"
        return
    if call.invalid is not None:
        raise AssertionError(f"{call.name}: accepted an invalid call ({call.invalid})")
    try:
        call.check(result)
    except AssertionError as e:
        raise AssertionError(f"{call.name}: {e}") from e


def main(argv=None) -> None:
    """The GPU sample: `python tests/fuzz_run.py --device cuda -n 150 [--seed 0] [--shard i/n]` (under
    compute-sanitizer by test_fuzz.py, in shards run side by side: the sample's cost is compiling, on the
    host's cores), and the same calls with the kernels' own clamps (launchers given bad cu_seqlens; shard 0).
    Call i is drawn from its own seed, so a shard draws the calls the whole sample would; each is named before
    it runs, so that a fault's log ends with the call that caused it."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", default="0/1", help="i/n: the calls i, i + n, i + 2n, ...")
    args = parser.parse_args(argv)
    index, parts = (int(x) for x in args.shard.split("/"))
    on_cuda = args.device.startswith("cuda")
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if on_cuda else (torch.float32,)
    env = Env(args.device, dtypes, max_len=70, max_batch_heads=8, grad_chance=0.5, backward_16bit=True)
    for i in range(index, args.n, parts):
        call = draw_call(random.Random(args.seed * 1_000_003 + i), env)
        print(f"fuzz call {i}: {call.name} {call.invalid or 'valid'} {call.detail or ''}", flush=True)
        run_call(call)
        if on_cuda:
            torch.cuda.synchronize()
    if index == 0:
        for cu in BAD_CU_SEQLENS:
            launch_with_bad_cu_seqlens(cu, args.device, dtypes[0])
    if on_cuda:
        torch.cuda.synchronize()
    shard = f" (shard {args.shard})" if parts > 1 else ""
    print(f"fuzz sample done{shard}: {len(range(index, args.n, parts))} calls"
          f"{f', {len(BAD_CU_SEQLENS)} unchecked cu_seqlens' if index == 0 else ''}", flush=True)

if __name__ == "__main__":
    main()
