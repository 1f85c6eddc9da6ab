"""What each kernel of a compiled XLA program does, from its optimized HLO: for a kernel table
(bench.cuda_trace.kernel_table), the entry instruction that launched each kernel, with the bytes it
reads and writes, the bandwidth that gives at the measured time, the op mix of its fused computation and
the jax operation it came from (the HLO's op_name metadata).

XLA names a GPU kernel after its instruction, '.' replaced by '_' (`loop_add_fusion.3` launches
`loop_add_fusion_3`); cuBLAS and cuDNN kernels and Pallas calls carry their libraries' or their own names
and stay unannotated. Bytes are the instruction's operands plus its outputs, each counted once per
launch: a lower bound on the traffic (a fusion may read an operand twice), so a kernel far below the
GPU's bandwidth here is doing something else than streaming (recomputation, a poor tiling, a reduction
across rows).

    text = jitted.lower(*args).compile().as_text()
    annotated = annotate(kernel_table(trace, calls), text)
"""

from __future__ import annotations

import collections
import re

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")


def shape_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (a shape, or a tuple of shapes)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _ITEM_BYTES[dtype]
    return total


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """Each computation's instruction lines, and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            match = _COMPUTATION.match(line)
            current = match.group(2) if match else None
            if match:
                computations[current] = []
                entry = current if match.group(1) else entry
            continue
        if current is not None and line.strip():
            computations[current].append(line)
    return computations, entry


def _operands(arguments: str) -> list[str]:
    """The %names an instruction's operand list (up to its closing parenthesis) refers to."""
    depth, end = 1, len(arguments)
    for i, char in enumerate(arguments):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", arguments[:end])


def entry_kernels(hlo_text: str) -> dict[str, dict]:
    """Per kernel name (an entry instruction's name, '.' as '_'): its opcode, bytes read and written, the
    op mix of the computation it calls (opcode -> count), and its op_name metadata."""
    computations, entry = _computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    sizes: dict[str, int] = {}
    kernels = {}
    for line in computations[entry]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, result_type, opcode, arguments = match.groups()
        sizes[name] = shape_bytes(result_type)
        if opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        called = re.search(r"calls=%([\w.\-]+)", arguments)
        ops: collections.Counter = collections.Counter()
        for inner in computations.get(called.group(1), []) if called else []:
            inner_match = _INSTRUCTION.match(inner)
            if inner_match and inner_match.group(3) not in ("parameter", "constant", "bitcast"):
                ops[inner_match.group(3)] += 1
        op_name = re.search(r'op_name="([^"]*)"', arguments)
        kernels[name.replace(".", "_")] = {
            "instruction": name, "opcode": opcode,
            "read_mb": sum(sizes.get(operand, 0) for operand in _operands(arguments)) / 1e6,
            "written_mb": sizes[name] / 1e6,
            "ops": dict(ops.most_common(8)),
            "op_name": op_name.group(1) if op_name else ""}
    return kernels


def annotate(table: dict, hlo_text: str) -> dict:
    """kernel_table's result with each row the program's HLO launched given its instruction's facts and
    `gb_per_s` (bytes read and written per launch over the time per launch); rows without a matching
    instruction (library kernels, Pallas calls, "(other)") are left as they are."""
    kernels = entry_kernels(hlo_text)
    rows = []
    for row in table["kernels"]:
        facts = kernels.get(row["kernel"])
        if facts is None:
            rows.append(dict(row))
            continue
        per_launch_us = row["us_per_call"] / max(row["launches_per_call"], 1e-9)
        megabytes = facts["read_mb"] + facts["written_mb"]
        rows.append({**row, **facts, "gb_per_s": megabytes * 1e-3 / (per_launch_us * 1e-6) if per_launch_us else None})
    return {**table, "kernels": rows}
