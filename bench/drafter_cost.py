"""What drafting costs on the host, per sequence, without gRPC's transport: the n-gram proposal
alone, and one drafter-service message (parse, sessions, n-gram, reply) in one process.

    python bench/drafter_cost.py [--sequences 64] [--messages 500] [--against DIR]

`ngram`: `NGramIndex.propose(9)` (K=4 plus the look-ahead of 5) on three ~400-token sequences:
random ids from 200 (short matches, three searches), random ids from 49,152 (rarely any
match) and a period of 7 (a 3-gram match at once). Best of 7 rounds of 3 x 3,000 calls.
With `--against DIR` (another checkout, e.g. a `git worktree` of an older commit) that
checkout's `specwire/common/ngram.py` is loaded too and timed interleaved with this one, in
the same process: the machine's drift cannot favour either.

`service`: the drafter service's work for one message of `--sequences` sequences that each
commit one token (their sessions already hold 200 tokens), from the serialised request to the
serialised reply: `updates_from_proto`, `DraftEngine.draft`, `response_to_proto`. Microseconds
per sequence, averaged over `--messages` messages. Compare checkouts by running this file from
each, alternately.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specwire.common import ngram  # noqa: E402
from specwire.common.protogen import drafter_pb2  # noqa: E402
from specwire.drafter_service.drafters import NGramDrafter  # noqa: E402
from specwire.drafter_service.engine import DraftEngine  # noqa: E402
from specwire.drafter_service.server import response_to_proto, updates_from_proto  # noqa: E402
from specwire.drafter_service.sessions import SessionStore  # noqa: E402


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ngram_costs(against: Path | None) -> None:
    versions = {"this": ngram}
    if against is not None:
        versions["against"] = _load(against / "specwire/common/ngram.py", "ngram_against")
    rng = random.Random(0)
    cases = {
        "random ids < 200": [rng.randrange(200) for _ in range(400)],
        "random ids < 49152": [rng.randrange(49152) for _ in range(400)],
        "period 7": [1, 2, 3, 4, 5, 6, 7] * 57,
    }
    for name, tokens in cases.items():
        indexes = {}
        for label, module in versions.items():
            index = module.NGramIndex(3)
            index.extend(tokens)
            indexes[label] = index
        proposals = {label: index.propose(9) for label, index in indexes.items()}
        assert len({tuple(p) for p in proposals.values()}) == 1, proposals
        best = dict.fromkeys(versions, float("inf"))
        for _ in range(7):
            for label, index in indexes.items():
                t = min(timeit.repeat(lambda i=index: i.propose(9), number=3000, repeat=3))
                best[label] = min(best[label], t / 3000 * 1e6)
        line = ", ".join(f"{label} {us:.2f} us" for label, us in best.items())
        print(f"ngram propose(9), {name}: {line}", flush=True)


def service_cost(sequences: int, messages: int) -> None:
    rng = random.Random(0)
    engine = DraftEngine(NGramDrafter(), SessionStore(NGramDrafter()), max_draft_len=16)
    tokens = {f"r{i}": [rng.randrange(300) for _ in range(200)] for i in range(sequences)}

    def message(step: int, first: bool) -> bytes:
        msg = drafter_pb2.DraftRequest(step=step)
        for rid, toks in tokens.items():
            if first:
                msg.sequences.add(request_id=rid, base_len=0, new_tokens=toks, max_draft_tokens=9)
            else:
                new = rng.randrange(300)
                msg.sequences.add(
                    request_id=rid, base_len=len(toks), new_tokens=[new], max_draft_tokens=9
                )
                toks.append(new)
        return msg.SerializeToString()

    def serve(data: bytes) -> bytes:
        request = drafter_pb2.DraftRequest.FromString(data)
        drafts = engine.draft(updates_from_proto(request))
        return response_to_proto(request.step, drafts).SerializeToString()

    serve(message(0, True))
    wire = [message(step, False) for step in range(1, messages + 1)]
    t0 = time.perf_counter()
    for data in wire:
        serve(data)
    seconds = (time.perf_counter() - t0) / messages
    print(
        f"drafter service, {sequences}-sequence message: {seconds * 1e3:.3f} ms, "
        f"{seconds / sequences * 1e6:.1f} us per sequence",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--messages", type=int, default=500)
    ap.add_argument("--against", type=Path, default=None, help="another checkout's root")
    args = ap.parse_args()
    ngram_costs(args.against)
    service_cost(args.sequences, args.messages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
