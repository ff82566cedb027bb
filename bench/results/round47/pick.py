"""Round 47: the sweep's best setting, by the geometric mean of its attention times over the
steps below relative to the current setting's."""

import collections
import math
import re
import sys

LINE = re.compile(
    r"(\S+) B=(\d+) q=(\d+) seg=(\d+) tile=(\d+) st=(\d+) w=(\d+) r=(\S+) g=(\S+): "
    r"attn ([\d.]+) us"
)
t = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    m = LINE.match(line)
    if not m or m.group(9) != "None":
        continue
    step = (m.group(1), m.group(2), m.group(3))
    t[(m.group(4), m.group(5), m.group(6), m.group(8))][step] = float(m.group(10))
key = [
    ("llama3-8b", "32", "5"),
    ("llama3-8b", "64", "5"),
    ("smollm2", "32", "5"),
    ("smollm2", "64", "5"),
    ("llama3-8b", "1", "5"),
    ("llama3-8b", "8", "5"),
]
base = ("128", "128", "2", "None")
best, score = base, 1.0
for cfg, steps in t.items():
    if not all(k in steps for k in key) or base not in t:
        continue
    s = math.exp(sum(math.log(steps[k] / t[base][k]) for k in key) / len(key))
    print(cfg, round(s, 3), file=sys.stderr)
    if s < score:
        best, score = cfg, s
print(*best)
