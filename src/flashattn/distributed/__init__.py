"""Context parallelism on torch.distributed: attention of sequences sharded over a group of ranks.

    shard(x, group, layout=...) / unshard(...)            this rank's part of a sequence, and back
    shard_varlen(x, cu_seqlens, group) / unshard_varlen   the same for packed documents
    context_parallel_attn(q, k, v, group, method=...)     ring, Ulysses or hybrid; autograd included
    context_parallel_attn_varlen(q, k, v, cu_seqlens, max_seqlen, group)

Results equal ``flashattn.flash_attn_func`` (``flash_attn_varlen_func``) on the unsharded tensors: causal
aligned bottom-right, sliding windows, softcap, ALiBi on global positions, learnable sinks, GQA/MQA, any
head dim. A group is a ``ProcessGroup``, a 1-D ``DeviceMesh``, a ``(DeviceMesh, dim)`` pair or None (the
default group). No state passes from call to call: the ring schedules are memoised, but they are pure
functions of the shapes, options and document boundaries.

Example (``torchrun --nproc-per-node 4 example.py``)::

    import torch, torch.distributed as dist
    from flashattn.distributed import context_parallel_attn, shard, unshard

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v = (torch.randn(1, 32768, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q_l, k_l, v_l = (shard(x, layout="zigzag").requires_grad_() for x in (q, k, v))
    out_l = context_parallel_attn(q_l, k_l, v_l, causal=True, layout="zigzag")  # (1, 8192, 16, 128)
    out_l.sum().backward()                    # q_l.grad, k_l.grad, v_l.grad: this rank's shards
    out = unshard(out_l, layout="zigzag")     # (1, 32768, 16, 128) on every rank

    # hybrid: Ulysses over 2 ranks inside, ring over 2 across (a 2-D mesh of the 4 ranks)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("ring", "ulysses"))
    q_l, k_l, v_l = (shard(shard(x, (mesh, "ring")), (mesh, "ulysses"), layout="contiguous")
                     for x in (q, k, v))
    out_l = context_parallel_attn(q_l, k_l, v_l, method="hybrid", ring_group=(mesh, "ring"),
                                  ulysses_group=(mesh, "ulysses"), causal=True)

Methods:
  * ring: K/V blocks go around the group in two relays, one each way (``batch_isend_irecv``, overlapped
    with the local attention; NCCL runs it on its own stream). Partials merge through their LSE in float32;
    the sink enters once at the end. The backward circulates K/V again, recomputes each block against the
    final LSE and output, and sends float32 dK/dV around with their block. Blocks no query can see (causal,
    or outside a window) are skipped without computing (``RingStats`` counts them), and each relay stops as
    soon as no rank needs farther blocks: a window narrower than a shard exchanges blocks with the two
    neighbouring ranks only (one with causal and the ``contiguous`` layout), for any world size.
  * ulysses: all-to-all to head shards, full-sequence attention, all-to-all back; nheads must be a multiple
    of the group size, K/V heads are replicated when there are fewer than ranks.
  * hybrid: Ulysses within ``ulysses_group``, ring across ``ring_group``.

Exactness and its one gap: each ring block is a single-device call whose causal/window mask is aligned
with that call's own bottom-right corner. A block between a query chunk and a key chunk at other global
offsets needs the band shifted; the planner cuts each block to the tight rectangle of rows and keys that
see anything, on which the shifted band is always expressible with non-negative window bounds (the kernels
cannot take negative ones: they read a negative bound as unbounded). ALiBi is the exception: its distance
``|i + sk − sq − j|`` is also aligned with the call's corner, and on a block off that diagonal no rectangle
makes the two agree. Those blocks run an exact float32 PyTorch path (``_exact``, counted in
``RingStats.exact_calls``): correct, but without the kernels' speed on a GPU. A kernel option for the
diagonal offset (query position − key position of element (0, 0), replacing ``seqlen_k − seqlen_q`` in the
masks and the ALiBi distance) would remove it; until then use ``method="ulysses"`` for ALiBi at full speed.

torch.compile: the ring (``method="ring"``, the ring part of ``"hybrid"``, and the varlen function) is
wrapped in ``torch.compiler.disable``: point-to-point transfers have no functional-collective form and the
schedule is planned on the host, so a compiled model breaks its graph around the call and runs it eagerly.
Ulysses is built from functional collectives (``all_to_all_single_autograd``), index_selects and the
registered ``flashattn`` custom op, so dynamo traces it when ``check_shards=False`` (the shard check reads
an all-gather on the host, which breaks the graph).

Tests run on the CPU with gloo (``tests/distributed``); the bench suite ``cp``
(``flashattn bench --suite cp``) measures and predicts multi-GPU efficiency.
"""

from flashattn.distributed._tasks import RingStats
from flashattn.distributed.api import context_parallel_attn, context_parallel_attn_varlen
from flashattn.distributed.layout import shard, shard_varlen, unshard, unshard_varlen

__all__ = [
    "RingStats",
    "context_parallel_attn",
    "context_parallel_attn_varlen",
    "shard",
    "shard_varlen",
    "unshard",
    "unshard_varlen",
]
