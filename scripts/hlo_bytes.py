"""Bytes an optimised XLA:GPU module moves per run, estimated from its HLO text.

In: the text of `compiled.as_text()` (a file, or a string to `bytes_moved`). Out: the bytes
every launched instruction reads and writes, times how often it runs, largest first, and the
custom calls (the Pallas/Triton kernels) apart, with their operands and results as an upper
bound: add what a kernel really reads yourself. Plain Python, no jax.

XLA's own HloCostAnalysis does not fit a paged KV cache: it counts a while body once whatever
its trip count, a scatter of 64 rows into a 134 MB cache as 268 MB, and a custom call as
nothing. The rules here, per launched instruction (its result plus its operands), are:
  - a while body counts `known_trip_count` times (its condition one time more); conditionals'
    branches and called computations count as often as their caller;
  - a fusion parameter read only through dynamic-slice / slice / gather (as their first
    operand) counts the slices' bytes, not the whole parameter;
  - a fusion whose root updates a parameter in place (dynamic-update-slice, scatter) counts
    the update written, not the whole buffer (the update's own inputs count as reads);
  - parameters, constants, tuples, bitcasts and control flow move nothing themselves.

    python3 scripts/hlo_bytes.py HLO_TEXT_FILE [--top N]
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from collections import defaultdict

_ITEMSIZE = dict(pred=1, s4=1, u4=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4,
                 f32=4, s64=8, u64=8, f64=8, f8e4m3fn=1, f8e5m2=1)
_SHAPE = re.compile(r"\b(pred|bf16|f8e4m3fn|f8e5m2|[suf]\d+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
         "conditional", "call", "after-all", "partition-id", "replica-id", "opt-barrier",
         "iota"}
_SLICERS = {"dynamic-slice", "slice", "gather"}
_VIEWS = {"bitcast", "reshape"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode -> position of the update


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: `operands` are names, `args` the text inside the parentheses
    (a parameter's index), `attrs` what follows them."""
    name: str
    type: str
    op: str
    operands: tuple
    args: str
    attrs: str
    bytes: int
    root: bool


@dataclasses.dataclass(frozen=True)
class Launch:
    """Bytes moved by one instruction over the whole run (`count` executions)."""
    bytes: int
    count: int
    name: str
    op: str
    type: str


@dataclasses.dataclass(frozen=True)
class Moved:
    """`total`: bytes of every launch but the custom calls; `launches` largest first;
    `custom_calls`: their operands + results (an upper bound), largest first."""
    total: int
    launches: list
    custom_calls: list


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a type, or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE.get(dtype, 4)
    return total


def _split_call(rest: str) -> tuple[tuple, str, str]:
    """The text after `opcode(` -> (operand names, the text inside the parentheses, the
    attributes after them)."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inside = rest[:i - 1]
    return tuple(re.findall(r"%([\w.\-]+)", inside)), inside, rest[i:]


def parse(text: str) -> tuple[dict, str]:
    """HLO text -> ({computation name: [Instr]}, the entry computation's name)."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and current:
            root, name, typ, op, rest = m.groups()
            operands, args, attrs = _split_call(rest)
            comps[current].append(Instr(name, typ, op, operands, args, attrs,
                                        shape_bytes(typ), bool(root)))
    assert entry is not None, f"no ENTRY computation among {len(comps)} computations"
    return comps, entry


def _through_views(name: str, by_name: dict) -> str:
    """The instruction `name` is a bitcast / reshape of, through any chain of them."""
    instr = by_name.get(name)
    while instr and instr.op in _VIEWS and instr.operands:
        name = instr.operands[0]
        instr = by_name.get(name)
    return name


def _readers(name: str, users: dict) -> list:
    """(user, operand position) of every use of `name`, looking through bitcasts / reshapes."""
    out = []
    for user in users.get(name, []):
        if user.op in _VIEWS:
            out.extend(_readers(user.name, users))
        else:
            out.extend((user, pos) for pos, o in enumerate(user.operands) if o == name)
    return out


def _written(instrs: list, by_name: dict) -> tuple[int, set]:
    """(bytes a fused computation writes, the parameters it updates in place)."""
    root = next(i for i in instrs if i.root)
    outs = [by_name[o] for o in root.operands] if root.op == "tuple" else [root]
    written, in_place = 0, set()
    for out in outs:
        base = by_name[_through_views(out.name, by_name)]
        if base.op in _IN_PLACE and base.operands:
            update = by_name.get(base.operands[_IN_PLACE[base.op]])
            in_place.add(_through_views(base.operands[0], by_name))
            written += update.bytes if update else 0
        else:
            written += out.bytes
    return written, in_place


def fusion_bytes(instrs: list, operand_bytes: list) -> int:
    """Bytes a fusion moves: what its computation `instrs` writes, plus each parameter read
    (its operand's size from `operand_bytes`, or only the slices taken of it)."""
    by_name = {i.name: i for i in instrs}
    users = defaultdict(list)
    for i in instrs:
        for o in i.operands:
            users[o].append(i)
    total, in_place = _written(instrs, by_name)
    for p in (i for i in instrs if i.op == "parameter" and i.name not in in_place):
        index = int(p.args)
        size = operand_bytes[index] if index < len(operand_bytes) else p.bytes
        readers = _readers(p.name, users)
        if readers and all(r.op in _SLICERS and pos == 0 for r, pos in readers):
            size = sum(r.bytes for r, _ in readers)
        total += size
    return total


def _attr(attrs: str, key: str) -> str:
    """The computation named by `key=%name` in an instruction's attributes."""
    m = re.search(rf"{key}=%([\w.\-]+)", attrs)
    assert m, f"no {key}= in {attrs[:80]!r}"
    return m.group(1)


def _branches(attrs: str) -> list:
    """The computations a conditional may run: `branch_computations={%a, %b}`, or
    `true_computation=%a, false_computation=%b`."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if listed:
        return re.findall(r"%([\w.\-]+)", listed.group(1))
    return [_attr(attrs, "true_computation"), _attr(attrs, "false_computation")]


def _executed(comps: dict, comp: str, count: int):
    """(instruction, executions) of every instruction that runs when `comp` runs `count`
    times, descending into while loops, conditionals and calls."""
    for i in comps.get(comp, []):
        if i.op == "while":
            n = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
            trips = int(n.group(1)) if n else 1
            yield from _executed(comps, _attr(i.attrs, "body"), count * trips)
            yield from _executed(comps, _attr(i.attrs, "condition"), count * (trips + 1))
        elif i.op == "conditional":
            for branch in _branches(i.attrs):
                yield from _executed(comps, branch, count)
        elif i.op == "call":
            yield from _executed(comps, _attr(i.attrs, "to_apply"), count)
        elif i.op not in _FREE:
            yield i, count


def bytes_moved(text: str) -> Moved:
    """The bytes the module in HLO `text` moves in one run (see the module docstring)."""
    comps, entry = parse(text)
    sizes = {i.name: i.bytes for instrs in comps.values() for i in instrs}
    launches, custom = [], []
    for i, count in _executed(comps, entry, 1):
        operand_bytes = [sizes.get(o, 0) for o in i.operands]
        if i.op == "custom-call":
            custom.append(Launch(count * (i.bytes + sum(operand_bytes)), count, i.name, i.op,
                                 i.type))
            continue
        moved = (fusion_bytes(comps[_attr(i.attrs, "calls")], operand_bytes)
                 if i.op == "fusion" else i.bytes + sum(operand_bytes))
        launches.append(Launch(count * moved, count, i.name, i.op, i.type))
    launches.sort(key=lambda r: -r.bytes)
    custom.sort(key=lambda r: -r.bytes)
    return Moved(sum(r.bytes for r in launches), launches, custom)


def report(moved: Moved, top: int) -> str:
    """Human-readable lines: the total, the `top` launches, every custom call."""
    lines = [f"total (without custom calls) {moved.total / 1e6:.1f} MB"]
    lines += [f"{r.bytes / 1e6:10.2f} MB  x{r.count:<3d} {r.op:14s} {r.name:36s} {r.type[:50]}"
              for r in moved.launches[:top]]
    lines += [f"custom call {r.name} x{r.count}: operands + results {r.bytes / 1e6:.1f} MB "
              f"(upper bound)" for r in moved.custom_calls]
    return "\n".join(lines)


def main(argv=None) -> Moved:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("hlo", help="a file of optimised HLO text (compiled.as_text())")
    p.add_argument("--top", type=int, default=15, help="launches to list (default: %(default)s)")
    args = p.parse_args(argv)
    with open(args.hlo) as f:
        moved = bytes_moved(f.read())
    print(report(moved, args.top))
    return moved


if __name__ == "__main__":
    main()
