"""Print the clipping and mismatch metrics of the newest bench_vs_trl run on this machine, every 4th step."""

import glob
import json
import os

path = max(glob.glob("/tmp/vs-trl-marin-*/run/metrics.jsonl"), key=os.path.getmtime)
records = [json.loads(line) for line in open(path) if line.strip()]
for key in ("learner/clip_frac", "learner/tis_weight", "mismatch/addition/kl", "mismatch/addition/frac_capped", "batches/addition/reward_mean"):
    print(key, [round(r.get(key, float("nan")), 4) for r in records][::4])
