"""Training on real data with the sample cursor: a small text corpus (written here, a few hundred
lines), byte-level tokens packed into 32-token sequences by `TokenStream`, the repo's TinyGpt.
Every step takes the next global batch of samples at the runtime's sample cursor, so when a
failure shrinks the global batch (below: 2 replicas x TP2, 4 samples each, lose a rank and then
get it back: 8 -> 6 -> 8) no sample is skipped or trained twice. Rank 0 prints the data position.

    .venv/bin/ntp-run --nproc 4 --replicas 2 --fail-at 2 --repair-at 5 --max-restarts 1 \\
        examples/train_on_data.py --steps 8 --check

`--check`: at the end, the first rank reads every step's (cursor, global batch) back from the
store and checks that the steps' samples follow one another with no gap and no overlap.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQ = 32


def write_corpus(path: Path) -> None:
    """A few hundred short documents of small sums, one per line ("17 plus 5 is 22.")."""
    lines = [f"{a} plus {b} is {a + b}." for a in range(0, 40, 3) for b in range(0, 30, 2)]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)  # every rank may write it: each writes whole and renames


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--data", default=None, help="directory for the corpus (default: a temporary one)")
    p.add_argument("--check", action="store_true", help="check the cursor ran on without gap or overlap")
    args = p.parse_args()
    if "NTP_STORE" not in os.environ:
        p.error("start it with ntp-run (see the docstring)")

    import structlog
    import torch

    from ntp_manager.worker import TokenStream, worker_env
    from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tiny_loss, tp_plan

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    env = worker_env()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    corpus = Path(args.data or tempfile.gettempdir()) / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    docs = [list(line.encode()) for line in corpus.read_text().splitlines()]
    stream = TokenStream(docs, seq_len=SEQ, seed=0, eos=ord("\n"), name="sums corpus")
    cfg = GptConfig(vocab=256, seq=SEQ, d_model=48, heads=6, mlp=96, layers=2)
    rt = env.runtime(lambda: TinyGpt(cfg), lambda ps: torch.optim.AdamW(ps, lr=3e-3), tp_plan(cfg),
                     reconfigure_timeout_s=300)
    try:
        rt.start()
        while rt.step < args.steps:
            r = rt.train_step(loss_fn=tiny_loss, samples=stream)
            env.store.set(f"ntp/{env.job}/example/samples/{r.step}", f"{r.cursor},{r.global_batch}")
            if env.local_rank == 0:
                epoch, pos = stream.position(r.cursor)
                print(f"step {r.step:3d}  layout v{r.version}  global batch {r.global_batch:3d}  samples "
                      f"[{r.cursor}, {r.cursor + r.global_batch})  epoch {epoch} position {pos}/{len(stream)}  "
                      f"loss {r.loss:.4f}", flush=True)
    finally:
        rt.close()
        stream.close()
    if not args.check or env.local_rank != 0:
        return 0
    cursor = 0
    for s in range(args.steps):
        c, gb = map(int, env.store.get(f"ntp/{env.job}/example/samples/{s}").decode().split(","))
        if c != cursor:
            print(f"check FAILED: step {s} starts at sample {c}, the one before ended at {cursor}", flush=True)
            return 1
        cursor += gb
    print(f"check ok: {args.steps} steps trained samples [0, {cursor}) once each", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
