"""Exits 0 when two saved result files are bitwise equal, else prints the first difference.

    python3 compare_results.py A.pt B.pt

A result file is a dict of lists of tensors. Equal means: the same keys, each list as long in
both, every tensor of the same dtype and shape and the same bytes; and no list empty, since a
result the program failed to produce (a capture that threw, say) must not read as equal.
"""
import sys


def difference(a: dict, b: dict, same_tensor) -> str:
    """The first difference between two result sets, or "" when they are bitwise equal.
    same_tensor(x, y) says whether two tensors have the same dtype, shape and bytes."""
    if a.keys() != b.keys():
        return f"different result sets: {sorted(a)} vs {sorted(b)}"
    for key in sorted(a):
        if len(a[key]) != len(b[key]):
            return f"{key}: {len(a[key])} tensors vs {len(b[key])}"
        if not a[key]:
            return f"{key}: no tensors on either side (the program produced none)"
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            if not same_tensor(x, y):
                return f"{key}[{i}] differs"
    return ""


def same_tensor(x, y) -> bool:
    import torch

    return (x.dtype == y.dtype and x.shape == y.shape and
            torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


def main(argv) -> int:
    import torch

    a, b = torch.load(argv[1]), torch.load(argv[2])
    diff = difference(a, b, same_tensor)
    if diff:
        print(diff, file=sys.stderr)
        return 1
    print(f"bitwise equal: {sum(len(v) for v in a.values())} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
