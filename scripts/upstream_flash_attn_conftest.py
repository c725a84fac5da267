"""pytest plugin for flash_attn 2.8's own tests/test_flash_attn.py run on flashattn
(scripts/upstream_flash_attn_tests.sh copies it next to that file as conftest.py).

It makes `import flash_attn` resolve to flashattn (flashattn.compat.install) before the test module is
imported, and with UPSTREAM_SUBSET=1 keeps a representative subset: of each test function's
parametrizations, the QUOTA[name] (times UPSTREAM_SCALE, default 1) whose node ids hash lowest (CRC-32: the
same subset on every run, spread uniformly over every parameter: dtypes, head dims, lengths, causal / window
/ ALiBi / dropout / softcap, GQA, packing); functions without a quota run whole. The quotas size the subset
at about 10 minutes on an H200 with 14 xdist workers; UPSTREAM_SHARD="i/n" keeps the i-th of n interleaved
shares of it (every n-th case in node-id order, from the i-th), so n shorter runs together run it all.
"""

import os
import zlib

import flashattn.compat

flashattn.compat.install()

# per test function, the parametrizations kept (of how many): ~720 cases. On the H200 host with 14 xdist
# workers the file's collection takes about a minute, then cases run at ~1.2 a second (compiles
# included), so this size fits 10 minutes.
QUOTA = {
    "test_flash_attn_output": 175,  # of 84,480
    "test_flash_attn_varlen_output": 150,  # of 92,928
    "test_flash_attn_kvcache": 125,  # of 304,128
    "test_flash_attn_qkvpacked": 60,  # of 6,144
    "test_flash_attn_varlen_qkvpacked": 60,  # of 5,760
    "test_flash_attn_splitkv": 30,  # of 6,912
    "test_flash_attn_causal": 15,  # of 960
    "test_flash_attn_varlen_causal": 15,  # of 2,880
    "test_flash_attn_deterministic": 8,  # of 1,920
    "test_flash_attn_varlen_deterministic": 8,  # of 1,920
    "test_flash_attn_race_condition": 6,  # of 672 (251 calls each at batch 60)
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("UPSTREAM_SUBSET") != "1":
        return
    by_function: dict[str, list] = {}
    for item in items:
        by_function.setdefault(item.originalname, []).append(item)
    keep = set()
    scale = float(os.environ.get("UPSTREAM_SCALE", "1"))  # a smaller subset: every quota scaled alike
    for name, group in by_function.items():
        quota = max(1, round(QUOTA[name] * scale)) if name in QUOTA else len(group)
        ranked = sorted(group, key=lambda it: zlib.crc32(it.nodeid.encode()))
        keep.update(id(it) for it in ranked[:quota])
    shard, shards = (int(x) for x in os.environ.get("UPSTREAM_SHARD", "0/1").split("/"))
    if not 0 <= shard < shards:
        raise ValueError(f"UPSTREAM_SHARD must be i/n with 0 <= i < n, got {shard}/{shards}")
    kept = sorted((it for it in items if id(it) in keep), key=lambda it: it.nodeid)
    keep = {id(it) for it in kept[shard::shards]}
    dropped = [it for it in items if id(it) not in keep]
    items[:] = [it for it in items if id(it) in keep]
    config.hook.pytest_deselected(items=dropped)
