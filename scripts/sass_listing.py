"""Reading an nvdisasm listing (`nvdisasm -c`): its instructions, its loops and the if/else arms inside them.
No side effects on import (scripts/sass_report.py, which compiles the kernel, imports it; so do the tests)."""

import collections
import re

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse(sass: str):
    """[(opcode, operands, branch target label or None)], {label: index of the instruction after it}."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _INSTR.search(line)
        if m:
            target = _TARGET.search(m.group(2)) if m.group(1).startswith("BRA") else None
            instrs.append((m.group(1), m.group(2).strip(), target and target.group(1)))
    return instrs, labels


def loops(instrs, labels) -> list[tuple[str, int, int]]:
    """(label, first, last instruction) of each loop: branches back to an earlier label, merged per label
    (the farthest one ends it). Left out: the mbarrier waits' retry spins (a few instructions around a
    SYNCS try-wait) and the out-of-line blocks after the last EXIT, which branch back into a loop's body."""
    exits = [i for i, (op, _, _) in enumerate(instrs) if op == "EXIT"]
    end = {}
    for i, (_, _, target) in enumerate(instrs):
        start = labels.get(target) if target else None
        if start is None or start > i or (exits and i > exits[-1]):
            continue
        if i - start < 6 and any(op.startswith("SYNCS") for op, _, _ in instrs[start:i + 1]):
            continue
        end[target] = max(end.get(target, i), i)
    return sorted(((t, labels[t], i) for t, i in end.items()), key=lambda x: (x[1], -x[2]))


def report(sass: str, top: int = 24) -> str:
    instrs, labels = parse(sass)
    ops = collections.Counter(op.split(".")[0] for op, _, _ in instrs)
    lines = [f"{len(instrs)} instructions; spill: {ops['STL']} STL, {ops['LDL']} LDL",
             "  " + "  ".join(f"{op} {n}" for op, n in ops.most_common(top))]
    for target, start, last in loops(instrs, labels):
        body = instrs[start:last + 1]
        mix = collections.Counter(op.split(".")[0] for op, _, _ in body)
        lines.append(f"loop {target}: instructions {start}..{last}, {len(body)} "
                     f"(HGMMA {mix['HGMMA']}, MUFU {mix['MUFU']}, STL {mix['STL']}, LDL {mix['LDL']})")
        for j in range(start, last + 1):
            skip_to = labels.get(instrs[j][2]) if instrs[j][2] else None
            if skip_to is not None and j < skip_to <= last + 1 and skip_to - j > 6:
                lines.append(f"  branch at {j} skips {skip_to - j - 1} (to {instrs[j][2]})")
    return "\n".join(lines)
