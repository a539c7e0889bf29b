"""Worker of tests/test_plan_cache.py: hammer one plan-store key with writes, reads and removals.

Prints one JSON line (reads that hit, writes that won, warnings); exits 1 if a read returned
an entry that is not one of the writers' whole entries, or a warning was raised (a torn entry).
"""

import argparse
import hashlib
import json
import sys
import warnings

from concerto_jax.plan_store import PlanCacheWarning, PlanStore, key_of


def content(writer: int) -> dict[str, bytes]:
    """Writer ``writer``'s blobs: large enough that writes interleave."""
    seed = hashlib.sha256(str(writer).encode()).digest()
    return {"a.bin": seed * 8192, "b.bin": bytes(reversed(seed)) * 4096 + bytes([writer])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--writer", type=int, required=True)
    ap.add_argument("--writers", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    store = PlanStore(args.root)
    parts = {"program": "the same step", "n": 1}
    valid = {w: content(w) for w in range(args.writers)}
    hits = wins = bad = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(args.rounds):
            entry = store.read("step", parts)
            if entry is not None:
                hits += 1
                if entry.blobs not in valid.values() or entry.meta != {"writer": valid_writer(entry, valid)}:
                    bad += 1
            if i % 7 == args.writer % 7:  # now and then remove it: the next writes race again
                store.remove("step", key_of(parts))
            wins += store.write("step", parts, valid[args.writer], {"writer": args.writer})
    print(json.dumps({"writer": args.writer, "hits": hits, "wins": wins, "bad": bad,
                      "warnings": [str(w.message)[:200] for w in caught
                                   if issubclass(w.category, PlanCacheWarning)]}))
    return 1 if bad or caught else 0


def valid_writer(entry, valid) -> int:
    return next(w for w, blobs in valid.items() if blobs == entry.blobs)


if __name__ == "__main__":
    sys.exit(main())
