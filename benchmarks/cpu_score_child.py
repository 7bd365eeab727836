"""The child process of ``benchmarks/cpu_score.py``: one measurement of CPU scoring speed inside the checkout measured.

    python -c "<harness.run_in_checkout>" benchmarks/cpu_score_child.py SPEC_JSON   # started by cpu_score

The parent starts this file with the checkout as the working directory, which is first on sys.path, so ``mmgeo`` is
that checkout's, whatever commit it is; this file imports nothing from ``benchmarks`` (only the standard library at
import time, numpy, torch and the checkout's mmgeo inside ``child``). Writes ``result.json`` next to the spec.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def child(spec_path: str) -> None:
    """One measurement in the checkout that is the working directory; writes result.json next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    import numpy as np
    import torch

    from mmgeo.kernels.pair_score import pair_score_reference
    from mmgeo.search.store import Gallery
    from mmgeo.search.two_stage import rerank_candidates

    d = torch.load(spec["inputs"], weights_only=True)  # tensors only
    torch.set_num_threads(spec["threads"])
    args = (d["q"], d["q_mask"], d["u"], d["k"], d["k_mask"], d["v"])
    with torch.inference_mode():
        pair_score_reference(*(x[:8] for x in args[:3]), *args[3:])  # warm-up
        t = time.perf_counter()
        scores = pair_score_reference(*args)  # (N_t, N_i)
        exact_s = time.perf_counter() - t
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rerank = {}
    with torch.inference_mode():
        for codec, root in spec["galleries"].items():
            gal = Gallery(root)
            ids = [rng.choice(gal.count, size=min(100, gal.count), replace=False) for _ in range(spec["queries"])]
            times = []
            for i, c in enumerate([ids[0]] * 3 + ids):  # 3 warm-up calls
                row = i % len(d["q"])
                t = time.perf_counter()
                rerank_candidates(d["q"][row], d["q_mask"][row], d["u"][row], gal, c)
                times.append(time.perf_counter() - t)
            rerank[codec] = statistics.median(times[3:]) * 1e3
    out = {"exact_s": exact_s, "checksum": float(scores.double().sum()), "rerank_ms": rerank}
    Path(spec_path).with_name("result.json").write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    child((sys.argv[1:] if argv is None else argv)[0])


if __name__ == "__main__":
    main()
