"""Text encoder speed side by side: a BERT tower's own forward over padded captions against ``packed_bert_states``
(the same weights over the real tokens only, what ``encode_text`` runs), per batch size, in one process.

    python -m benchmarks.text_encode [--ckpt model.pt] [--batch-sizes 1 8 32 256] [--batches 40] [--rounds 5]
                                     [--threads 1] [--json out.json]

Captions are the synthetic test split's (``ShapesWorld``), drawn at random (seeded) into ``--batches`` batches of
each size; both ways run on the same batches under ``torch.inference_mode``, alternating, ``--rounds`` times, and
the table gives each way's median ms per batch, their ratio and the largest difference of a real token's state
(padding positions are not compared: nothing reads them). Without --ckpt the default ``geo-tiny`` model (random
init) is timed: the arithmetic is the same as a trained one's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.harness import add_json, alternate, environment, write_json


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint (default: geo-tiny, random init)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--batches", type=int, default=40, help="batches per size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    add_json(p)
    args = p.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.batches < 1 or args.rounds < 1:
        p.error("--batch-sizes, --batches and --rounds must be positive")

    import torch

    import mmgeo
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.models import bert_packed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = mmgeo.load_model(args.ckpt) if args.ckpt else mmgeo.create_model("geo-tiny").eval()
    encoder = model.text_encoder
    if not bert_packed.supports(encoder):
        p.error(f"{type(encoder).__name__} is not a BERT encoder packed_bert_states computes (bert_packed.supports)")
    ds = ShapesWorld("test", image_size=model.cfg.image_size, size=500)
    captions = [c for i in range(len(ds)) for c in ds[i][1]]
    rng = random.Random(0)

    def own(tok):
        return encoder(**tok).last_hidden_state

    def packed(tok):
        return bert_packed.packed_bert_states(encoder, tok["input_ids"], tok["attention_mask"])

    rows = []
    with torch.inference_mode():
        for B in args.batch_sizes:
            toks = [model.tokenize(rng.sample(captions, B)) for _ in range(args.batches)]
            diff = max(float((own(t) - packed(t))[t["attention_mask"].bool()].abs().max()) for t in toks[:4])

            def per_batch_ms(name: str, r: int, toks=toks) -> float:
                """One round of one way: ms per batch over all the batches, after a warm call."""
                fn = {"own": own, "packed": packed}[name]
                fn(toks[0])  # warm
                start = time.perf_counter()
                for t in toks:
                    fn(t)
                return (time.perf_counter() - start) / len(toks) * 1e3

            times = alternate(("own", "packed"), args.rounds, per_batch_ms)
            pad = 1 - sum(int(t["attention_mask"].sum()) for t in toks) / sum(t["attention_mask"].numel() for t in toks)
            own_ms, packed_ms = statistics.median(times["own"]), statistics.median(times["packed"])
            rows.append({"batch": B, "padding": round(pad, 3), "own_ms": round(own_ms, 3),
                         "packed_ms": round(packed_ms, 3), "ratio": round(own_ms / packed_ms, 2),
                         "max_abs_diff": diff, "own_all": times["own"], "packed_all": times["packed"]})
    print(f"text encoder states, {'geo-tiny (random init)' if not args.ckpt else args.ckpt}, {args.threads} thread(s), "
          f"median of {args.rounds} alternated rounds of {args.batches} batches")
    print(f"{'batch':>6} {'padding':>8} {'own ms':>8} {'packed ms':>10} {'own/packed':>11} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['batch']:>6} {r['padding']:>8.1%} {r['own_ms']:>8.2f} {r['packed_ms']:>10.2f} {r['ratio']:>11.2f} "
              f"{r['max_abs_diff']:>11.2e}")
    out = {"ckpt": args.ckpt, "threads": args.threads, "rounds": args.rounds, "rows": rows,
           "environment": environment()}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
