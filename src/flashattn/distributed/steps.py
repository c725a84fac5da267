"""One rank's ring steps without any communication, to time them on a single device.

The bench suite ``cp`` predicts multi-GPU efficiency from the local attention time of each ring step and the
time of one transfer; this module runs exactly the single-device work a rank does at each step (the same
tasks as :mod:`.ring`, the same accumulators), with the local K/V standing in for every other rank's block
(all blocks have the same shape in the padded layouts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashattn.distributed import _checks, _plan_padded
from flashattn.distributed._geometry import check_layout, window_bounds
from flashattn.distributed._merge import finalize
from flashattn.distributed._tasks import Options, run_backward, run_forward
from flashattn.distributed.ring import split


@dataclass
class LocalSteps:
    """Rank ``rank``'s steps of a ring of ``world``.

    Attributes:
        world, rank: the ring and the rank it plays.
        down, up, rounds: the relays' lengths and the rounds per pass (as :class:`RingStats` reports them).
        kv_bytes: bytes of one K/V block (what one relay moves per round, each way).
        dkv_bytes: bytes of one block's float32 dK/dV accumulator (the backward moves it too).
    """

    world: int
    rank: int
    down: int
    up: int
    rounds: int
    kv_bytes: int
    dkv_bytes: int
    _specs: tuple
    _run: dict

    def signature(self, t: int) -> tuple:
        """A hashable description of step t's work (its calls' shapes and masks); ``()`` if skipped.
        Steps of equal signature take equal time, so a bench times each signature once."""
        return tuple((s["rows"][1] - s["rows"][0], s["keys"][1] - s["keys"][0], s["causal"], s["window"],
                      s["exact"]) for s in self._specs[t])

    def forward(self, t: int) -> None:
        """Step t's forward: its single-device calls and merges into the float32 accumulator."""
        self._run["forward"](t)

    def backward(self, t: int) -> None:
        """Step t's backward: its calls against the final statistics and the float32 dQ/dK/dV adds."""
        self._run["backward"](t)


def local_steps(q, k, v, *, world: int, rank: int, layout: str = "zigzag", causal: bool = False,
                softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                deterministic: bool = False) -> LocalSteps:
    """The steps rank ``rank`` of a ring of ``world`` runs, on local tensors.

    Args:
        q: ``(batch, seqlen_q / world, nheads, headdim)``; k, v: ``(batch, seqlen_k / world, nheads_k, ·)``:
            shards as :func:`context_parallel_attn` takes them (their values do not matter for timing).
        world, rank: ints, the ring to model and the rank whose steps to run.
        layout, causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic: as
            :func:`context_parallel_attn`.

    Returns a :class:`LocalSteps`; its ``forward(t)`` / ``backward(t)`` run step t.
    """
    _checks.qkv(q, k, v)
    check_layout(layout)
    scale = _checks.scale(softmax_scale, q.shape[-1])
    left, right = window_bounds(causal, _checks.window(window_size))
    sq, sk = q.shape[1] * world, k.shape[1] * world
    needed, specs = _plan_padded.plan(layout, sq, sk, world, rank, left, right, alibi_slopes is not None)
    down, up = split(needed, world)
    opts = Options(scale, _checks.softcap(softcap), alibi_slopes, deterministic, sk - sq, left, right)
    k, v = k.contiguous(), v.contiguous()
    acc_out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
    acc_lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -torch.inf, device=q.device)
    for t in range(world):  # the final statistics the backward recomputes against
        for task in _plan_padded.tasks(specs[t], q.device):
            run_forward(task, q, k, v, acc_out, acc_lse, opts, None)
    out32, lse = finalize(acc_out.clone(), acc_lse.clone(), None)
    out, dout = out32.to(q.dtype), torch.randn_like(out32).to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (k, v)]
    tasks = {t: _plan_padded.tasks(specs[t], q.device) for t in range(world)}

    def forward(t: int) -> None:
        for task in tasks[t]:
            run_forward(task, q, k, v, acc_out, acc_lse, opts, None)

    def backward(t: int) -> None:
        for task in tasks[t]:
            add_k, add_v = run_backward(task, dout, q, k, v, out, lse, dq, opts, None)
            add_k(dkv[0])
            add_v(dkv[1])

    kv_elems = k.numel() + v.numel()
    return LocalSteps(world, rank, down, up, max(down, up), kv_elems * k.element_size(), kv_elems * 4, specs,
                      {"forward": forward, "backward": backward})
