"""SASS listings of many cubins from one disassembler process (`lockstep gpu-audit`).

nvdisasm spends about half a second setting itself up, whatever the size of the cubin, against
milliseconds for the instructions of a typical kernel, so an audit of hundreds of binaries would
spend most of its disassembly starting the tool. Triton writes one kernel per cubin; this module
copies the code sections of many cubins of one architecture into one ELF file, as functions k0,
k1, ..., disassembles that file once, and cuts the listing back into one per cubin.

A listing is what `cuobjdump -sass` prints for the cubin (cuobjdump runs nvdisasm with the same
options, -pb -hex -novliw): each function's code is its own section, so its addresses start at 0
and its branch targets are the ones a lone disassembly prints. Only the padding before each
instruction's encoding depends on the widest instruction in the file, so it is set per listing.
tests/test_gpu_audit.py compares the instructions with cuobjdump's.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile

_SECTION = "<IIQQQQIIQQ"      # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
_SYMBOL = "<IBBHQQ"           # Elf64_Sym: name, info, other, shndx, value, size
_SHT_PROGBITS, _SHT_SYMTAB, _SHT_STRTAB = 1, 2, 3
_HEADER = 64
# Sections nvdisasm needs besides the code: the toolkit and CUDA notes and the compatibility
# section (without them it refuses the file), copied from the first cubin; the merged cubins all
# target one architecture.
_KEPT = (".note.nv.tkinfo", ".note.nv.cuinfo", ".nv.compat")
_FUNCTION = re.compile(r"^\t\tFunction : k(\d+)\n", re.M)
_ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/$")


def sections(cubin: bytes) -> list[tuple[str, tuple]]:
    """(name, Elf64_Shdr fields) of each section of an ELF64 little-endian file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("cubin: expected a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from(_SECTION, cubin, shoff + i * size) for i in range(count)]
    strings = headers[names][4]
    return [(cubin[strings + h[0]:cubin.index(b"\0", strings + h[0])].decode(), h) for h in headers]


def _code(cubin: bytes) -> tuple[str, tuple, bytes]:
    """The function name, section header and bytes of a Triton cubin's one code section."""
    code = [(name, h) for name, h in sections(cubin) if name.startswith(".text.")]
    if len(code) != 1:
        raise ValueError(f"cubin: expected one code section, found {[name for name, _ in code]}")
    name, h = code[0]
    return name[len(".text."):], h, cubin[h[4]:h[4] + h[5]]


def merge(cubins: list[bytes]) -> bytes:
    """One ELF file whose function k<i> is the code of cubins[i] (all of one architecture)."""
    first = cubins[0]
    body, names, strings = bytearray(), bytearray(b"\0"), bytearray(b"\0")

    def string(table: bytearray, text: str) -> int:
        table += text.encode() + b"\0"
        return len(table) - len(text) - 1

    def place(data: bytes, align: int) -> int:
        body.extend(b"\0" * (-(_HEADER + len(body)) % max(align, 1)))
        body.extend(data)
        return _HEADER + len(body) - len(data)

    table: list = [(0,) * 9, None, None, None]       # null, .shstrtab, .strtab, .symtab (placed last)
    moved = {}
    for index, (name, h) in enumerate(sections(first)):
        if name in _KEPT:
            moved[index] = len(table)
            table.append([string(names, name), h[1], h[2], place(first[h[4]:h[4] + h[5]], h[8]), h[5], h[6],
                          h[7], h[8], h[9]])
    for entry in table[4:]:
        entry[5] = moved.get(entry[5], 0)            # a note's link names another kept section
    symbols = bytearray(b"\0" * struct.calcsize(_SYMBOL))
    for i, cubin in enumerate(cubins):
        _, h, code = _code(cubin)
        symbols += struct.pack(_SYMBOL, string(strings, f"k{i}"), 0x12, 0x10, len(table), 0, len(code))  # global FUNC
        table.append((string(names, f".text.k{i}"), _SHT_PROGBITS, h[2], place(code, h[8]), len(code), 3, i + 1,
                      h[8], 0))
    labels = [string(names, n) for n in (".shstrtab", ".strtab", ".symtab")]
    table[1] = (labels[0], _SHT_STRTAB, 0, place(bytes(names), 1), len(names), 0, 0, 1, 0)
    table[2] = (labels[1], _SHT_STRTAB, 0, place(bytes(strings), 1), len(strings), 0, 0, 1, 0)
    table[3] = (labels[2], _SHT_SYMTAB, 0, place(bytes(symbols), 8), len(symbols), 2, 1, 8, struct.calcsize(_SYMBOL))
    shoff = place(b"", 8)
    header = bytearray(first[:_HEADER])
    struct.pack_into("<QQ", header, 0x20, 0, shoff)                    # no program headers
    struct.pack_into("<HHHHHH", header, 0x34, _HEADER, 0x38, 0, struct.calcsize(_SECTION), len(table), 1)
    entries = b"".join(struct.pack(_SECTION, n, t, f, 0, o, s, link, info, a, e) for n, t, f, o, s, link, info, a, e
                       in table)
    return bytes(header) + bytes(body) + entries


def _aligned(lines: list[str]) -> list[str]:
    """Instruction lines with their encodings in one column, as a lone disassembly aligns them."""
    split = [(line[:m.start()].rstrip(), m.group()) if (m := _ENCODING.search(line)) else None for line in lines]
    width = max((len(s[0]) for s in split if s and s[0].strip()), default=0)
    out = []
    for line, s in zip(lines, split):
        if s is None:
            out.append(line.rstrip())
        else:
            text, encoding = s
            out.append((text.ljust(width) if text.strip() else " " * width) + "  " + encoding)
    return out


def listings(nvdisasm: str, arch: str, cubins: list[bytes]) -> list[str]:
    """The SASS listing of each cubin (one of `arch`, e.g. "sm_90a"), from one nvdisasm process."""
    if not cubins:
        return []
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(merge(cubins))
        done = subprocess.run([nvdisasm, "-pb", "-hex", "-novliw", "-c", path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm -pb -hex -novliw -c on {len(cubins)} merged cubins failed: {done.stderr.strip()}")
    parts = _FUNCTION.split(done.stdout)
    found = {int(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}
    if sorted(found) != list(range(len(cubins))):
        raise RuntimeError(f"nvdisasm listed functions {sorted(found)} of {len(cubins)} merged cubins")
    out = []
    for i, cubin in enumerate(cubins):
        lines = found[i].rstrip("\n").split("\n")
        out.append("\n".join([f"\tcode for {arch}", f"\t\tFunction : {_code(cubin)[0]}", *_aligned(lines)]) + "\n")
    return out
