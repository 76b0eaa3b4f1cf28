"""experiments/device/split.py: the weights in as many calls as the transfer limit needs."""

import pytest

from experiments.device import split

MIB = 2**20


def _calls(tree, big, rest, sizes):
    """What each call sends: the tree and its part, the last one also the rest."""
    return [tree + s + (rest if i == len(sizes) - 1 else 0) for i, s in enumerate(sizes)]


def test_the_tree_of_the_issue_fits_where_two_calls_did_not():
    """The issue's numbers: a 16.6 MiB tree, MiniLM-L6's 87 MiB weights file, 4.3 MiB of data,
    wheels and the package's other files. Two calls (the old halves) send 64.4 MiB in the
    second; the split takes three, each under the limit less its margin."""
    tree, big, rest = int(16.6 * MIB), int(86.7 * MIB), int(4.3 * MIB)
    assert tree + big / 2 + rest > 64 * MIB  # the old second call: refused
    sizes = split.parts(tree, big, rest)
    assert len(sizes) == 3 and sum(sizes) == big
    assert max(_calls(tree, big, rest, sizes)) <= 63 * MIB
    assert max(sizes) - min(sizes) <= len(sizes)  # as equal as bytes allow


@pytest.mark.parametrize("tree_mib", [1, 10, 30, 50, 58])
def test_every_call_fits_and_the_parts_are_the_fewest(tree_mib):
    tree, big, rest = tree_mib * MIB, 87 * MIB, 4 * MIB
    sizes = split.parts(tree, big, rest)
    assert sum(sizes) == big and all(s > 0 for s in sizes)
    assert max(_calls(tree, big, rest, sizes)) <= 63 * MIB
    fewer = len(sizes) - 1
    if fewer:  # one call fewer cannot hold it: some call would be over
        size = -(-big // fewer)
        assert tree + size + rest > 63 * MIB


def test_no_room_is_one_line_and_the_command_line():
    with pytest.raises(ValueError, match="leave no room under 63 MiB"):
        split.parts(60 * MIB, 87 * MIB, 4 * MIB)
    assert split.main([str(MIB), str(10 * MIB), str(MIB)]) == 0
    assert split.main([str(62 * MIB), "10", str(MIB)]) == 1
