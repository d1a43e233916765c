"""Exits 0 when two saved result files are bitwise equal, else prints the first difference."""
import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
if a.keys() != b.keys():
    sys.exit(f"different result sets: {sorted(a)} vs {sorted(b)}")
for key in a:
    for i, (x, y) in enumerate(zip(a[key], b[key])):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            sys.exit(f"{key}[{i}] differs")
print(f"bitwise equal: {sum(len(v) for v in a.values())} tensors")
