"""Where the dev server spends its CPU, from a `perf record -g` of its process.

`perf script -F ip -i PERF_DATA | python -m bench.server_profile [--binary PATH] [--top N]`

The `temporal` binary of the pip package is stripped, so perf names none of its functions. A Go binary keeps its
function table for its own stack traces (`.gopclntab`), and this reads it: each sample's call chain gets Go names.
It prints the functions that most samples pass through (inclusive), and the time inside SQLite split by what asked
for it: the visibility store's writes (`visibility ...`) or the history's own persistence operations.

    perf record -F 299 -g -p SERVER_PID -o server.data -- sleep 10
    perf script -F ip -i server.data | python -m bench.server_profile
"""

from __future__ import annotations

import argparse
import bisect
import collections
import re
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from workers.devserver import temporal_binary

PCLNTAB_MAGIC = 0xFFFFFFF1  # the table's layout since Go 1.20
KERNEL = 0xFFFF_0000_0000_0000  # addresses above are the kernel's
SQLITE = "modernc.org/sqlite"
ASKERS = re.compile(
    r"\((?:\*VisibilityStore|\*sqlExecutionStore|\*sqlTaskManager|\*sqlShardStore|\*sqlHistoryStore)\)\."
)


class GoSymbols:
    """Function names by address, from an executable's `.gopclntab`."""

    def __init__(self, binary: Path) -> None:
        sections, self.load_address = _elf(binary)  # perf tells addresses from the load address
        text, (_, table_offset, table_size) = sections[".text"][0], sections[".gopclntab"]
        with binary.open("rb") as f:
            f.seek(table_offset)
            table = f.read(table_size)
        (magic,) = struct.unpack_from("<I", table, 0)
        if magic != PCLNTAB_MAGIC:
            raise ValueError(f"{binary}: .gopclntab magic {magic:#x}, not Go 1.20's {PCLNTAB_MAGIC:#x}")
        functions, _, _, names, _, _, _, pcln = struct.unpack_from("<8Q", table, 8)
        entries = []
        for i in range(functions):
            entry, func = struct.unpack_from("<II", table, pcln + i * 8)
            _, name = struct.unpack_from("<Ii", table, pcln + func)
            start = names + name
            entries.append((text + entry, table[start : table.index(b"\0", start)].decode(errors="replace")))
        entries.sort()
        self._starts = [start for start, _ in entries]
        self._names = [name for _, name in entries]

    def start_of(self, name: str) -> int:
        start: int = self._starts[self._names.index(name)]
        return start

    def name(self, address: int) -> str:
        i = bisect.bisect_right(self._starts, address) - 1
        return self._names[i] if i >= 0 else "?"


def _elf(binary: Path) -> tuple[dict[str, tuple[int, int, int]], int]:
    """From an ELF-64 executable's headers: each section's address, file offset and size, and where its first
    loaded segment goes (0x400000 for Go's static binaries)."""
    with binary.open("rb") as f:
        header = f.read(64)
        if header[:5] != b"\x7fELF\x02":
            raise ValueError(f"{binary}: not a 64-bit ELF executable")
        (segments_at,) = struct.unpack_from("<Q", header, 0x20)
        (sections_at,) = struct.unpack_from("<Q", header, 0x28)
        segment_size, segment_count, section_size, section_count, names_index = struct.unpack_from(
            "<HHHHH", header, 0x36
        )
        f.seek(segments_at)
        segments = [struct.unpack_from("<IIQQ", f.read(segment_size)) for _ in range(segment_count)]
        f.seek(sections_at)
        sections = [struct.unpack_from("<IIQQQQ", f.read(section_size)) for _ in range(section_count)]
        _, _, _, _, names_at, names_size = sections[names_index]
        f.seek(names_at)
        names = f.read(names_size)
    loaded = [address for kind, _, _, address in segments if kind == 1]  # PT_LOAD
    if not loaded:
        raise ValueError(f"{binary}: no loaded segment")
    by_name = {
        names[name : names.index(b"\0", name)].decode(): (address, at, length)
        for name, _, _, address, at, length in sections
    }
    return by_name, int(loaded[0])


def call_chains(perf_script: Iterable[str], symbols: GoSymbols) -> list[list[str]]:
    """Each sample's frames, innermost first, from `perf script -F ip`; perf gives the binary's addresses from
    where it is loaded."""
    chains: list[list[str]] = []
    chain: list[str] = []
    for line in perf_script:
        line = line.strip()
        if not line:
            if chain:
                chains.append(chain)
            chain = []
        elif re.fullmatch(r"[0-9a-f]+", line):
            address = int(line, 16)
            chain.append("[kernel]" if address >= KERNEL else symbols.name(address + symbols.load_address))
    if chain:
        chains.append(chain)
    return chains


def report(chains: Sequence[list[str]], top: int) -> list[str]:
    total = max(len(chains), 1)
    through = collections.Counter(name for chain in chains for name in set(chain))
    lines = [f"samples: {len(chains)}", "", "functions most samples pass through:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in through.most_common(top)]
    in_sqlite = [chain for chain in chains if any(SQLITE in frame for frame in chain)]
    askers = collections.Counter(_asker(chain) for chain in in_sqlite)
    lines += ["", f"inside SQLite: {100 * len(in_sqlite) / total:.1f}% of the samples, asked for by:"]
    lines += [f"  {100 * n / max(len(in_sqlite), 1):5.1f}%  {name}" for name, n in askers.most_common(top)]
    return lines


def _asker(chain: list[str]) -> str:
    """The store's method a SQLite sample ran for, its outermost: `visibility UpsertWorkflowExecution`."""
    for frame in reversed(chain):
        if ASKERS.search(frame):
            method = frame.rsplit(").", 1)[-1]
            return f"visibility {method}" if "VisibilityStore" in frame else method
    return "other"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, help="the server's executable (the pip package's temporal)")
    parser.add_argument("--top", type=int, default=30, help="lines in each list (30)")
    args = parser.parse_args(argv)
    symbols = GoSymbols(args.binary or Path(temporal_binary()).resolve())
    print("\n".join(report(call_chains(sys.stdin, symbols), args.top)))


if __name__ == "__main__":
    main()
