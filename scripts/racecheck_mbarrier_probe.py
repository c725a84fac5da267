"""Does compute-sanitizer's racecheck follow an mbarrier hand-off? (H200 only; NOTES v23.)

The Gluon forward's loader warp writes each tile index to shared memory and releases it to the consumer
warpgroups with an mbarrier arrive; racecheck reports those reads and writes as races. This kernel does only
that hand-off, with no TMA or wgmma around it: a 1-warp producer partition writes ROUNDS values into two
slots, each after waiting for the slot's `empty` barrier and before arriving on its `full` barrier; the
4-warp consumer partition waits on `full`, reads, and arrives on `empty`. The hand-off is ordered by the PTX
memory model (arrive: release, wait: acquire), and the sums the kernel writes check that every value was read
after its write. If racecheck reports this kernel too, it does not model the mbarrier's ordering, and its
reports on the forward's tile slots say nothing about a race there.

    compute-sanitizer --tool racecheck python scripts/racecheck_mbarrier_probe.py
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROUNDS = 64


@gluon.jit
def _producer(slots, full, empty, out, ROUNDS: gl.constexpr):
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    for i in range(ROUNDS):
        s = i % 2
        mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)
        slots.index(s).store(gl.full([1], i + 1, gl.int32, one))
        gl.thread_barrier()
        mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _consumer(slots, full, empty, out, ROUNDS: gl.constexpr):
    rows: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    total = 0
    for i in range(ROUNDS):
        s = i % 2
        mbarrier.wait(full.index(s), (i // 2) & 1)
        total += gl.max(slots.index(s).load(rows), 0)
        mbarrier.arrive(empty.index(s), count=1)
    gl.store(out + gl.program_id(0), total)


@gluon.jit
def handoff_kernel(out, ROUNDS: gl.constexpr):
    slots = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (slots, full, empty, out, ROUNDS)),
        (_producer, (slots, full, empty, out, ROUNDS)),
    ], [1], [24])


if __name__ == "__main__":
    out = torch.zeros(8, dtype=torch.int32, device="cuda")
    handoff_kernel[(8,)](out, ROUNDS, num_warps=4)
    torch.cuda.synchronize()
    expected = ROUNDS * (ROUNDS + 1) // 2
    print("sums", out.tolist(), "expected", expected, "ok" if (out == expected).all() else "WRONG")
