"""Train a small Hugging Face Llama (built from its config: nothing is downloaded) with the NTP
runtime. A training script like any other: `ntp-run` starts it once per rank.

    # ntp-run publishes the layouts: 2 replicas x TP4; replica 0 loses a rank after step 8 (TP3),
    # gets it back after step 16; every rank checks its losses and final shards against one process
    .venv/bin/ntp-run --nproc 8 --replicas 2 --fail-at 8 --repair-at 16 examples/train_hf_llama.py --steps 24 --check

    # under a running manager (layouts from its watch stream, one rank per GPU UUID)
    .venv/bin/ntp-run --manager 127.0.0.1:50051 --token-file worker.token --job llama \\
        --gpus GPU-a,...,GPU-h --max-restarts 1 examples/train_hf_llama.py --steps 100

    # the whole system on this machine: a manager, fake-GPU agents and ntp-run; a GPU fails
    # (XID 48, its rank's process dies), the replica goes on at TP3, the GPU is repaired and a
    # fresh process rejoins. The console shows what the ranks print (steps, events, the check);
    # the logs go to files in the demo's directory (--verbose: to the console)
    .venv/bin/python examples/train_hf_llama.py --demo

The model: Llama with grouped-query attention (8 query heads, 4 KV groups: the attention units),
a padding token and tied embeddings, as small Llama/Qwen configs have. `plan_for` (through the
runtime) shards the attention by KV group, the MLP by column and the vocabulary by entry. The
data: a fixed random bigram chain with 10% noise, so the loss falls; the global sample order
depends only on the step, so any layout sees the same samples.

The loss is HF's: a mean over the local batch's tokens. Every sample has the same number of
tokens here, so that is also a mean over samples, which is what the runtime's sample-weighted
gradient sync expects (docs/worker.md, "Loss averaging").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

JOB = "llama"
MAX_BATCH = 64
# --shape: "small" (the default, seconds on a CPU), "bench" (issue 42's failure benchmark:
# hidden 256, 2 layers, a 32,000-token vocabulary, 128-token sequences; bench/lost.py)
SHAPES = {"small": dict(vocab_size=256, hidden_size=64, intermediate_size=192, seq=32),
          "bench": dict(vocab_size=32000, hidden_size=256, intermediate_size=768, seq=128)}
SHAPE = dict(SHAPES["small"])


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"],
                       intermediate_size=SHAPE["intermediate_size"], num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(64, SHAPE["seq"]),
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_model() -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def make_optimizer(kind: str, params: Any) -> Any:
    import torch

    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # Llama 2's recipe (lr scaled down for a tiny model is not needed at this size)
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)


def batch(step: int, start: int, count: int, seq: int | None = None) -> Any:
    """Samples [start, start+count) of step `step`'s global batch: a bigram chain over tokens
    3..255 (0 is padding, 1 and 2 are bos/eos), 10% of positions random."""
    import torch

    vocab = SHAPE["vocab_size"]
    seq = seq or SHAPE["seq"]
    nxt = torch.randint(3, vocab, (vocab,), generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.empty(MAX_BATCH, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(3, vocab, (MAX_BATCH,), generator=g)
    noise = torch.rand(MAX_BATCH, seq, generator=g) < 0.1
    rand = torch.randint(3, vocab, (MAX_BATCH, seq), generator=g)
    for i in range(1, seq):
        ids[:, i] = torch.where(noise[:, i], rand[:, i], nxt[ids[:, i - 1]])
    return ids[start : start + count]


def loss_fn(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, labels=ids).loss  # HF shifts the labels: next-token loss


# ---- one rank (started by ntp-run) ---------------------------------------------------------------
def train(args: argparse.Namespace) -> int:
    import logging

    import torch

    from ntp_manager.contract.logs import configure_logging
    from ntp_manager.worker import TimelineEvent, worker_env

    # the runtime logs every event at info level (stderr); the lines printed below (stdout) say
    # what matters; ntp-run prefixes each line with the rank's worker id
    configure_logging("auto", level=logging.getLevelNamesMapping()[args.log_level.upper()],
                      fields={"worker": os.environ.get("NTP_WORKER_ID", "")})
    torch.set_num_threads(1)
    env = worker_env()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))

    def on_event(ev: TimelineEvent) -> None:
        if ev.what in ("failure detected", "reshard done", "joined", "no place"):
            print(f"{ev.what} (v{ev.version}) {ev.detail[:80]}", flush=True)

    rt = env.runtime(make_model, lambda ps: make_optimizer(args.optimizer, ps), on_event=on_event,
                     seed=args.seed, collective_timeout_s=args.collective_timeout, reconfigure_timeout_s=300,
                     abort_poll_s=args.abort_poll)
    losses: dict[int, float] = {}
    steps: list[tuple[int, int, float, float]] = []  # step, version, seconds, when it ended
    try:
        rt.start()
        while rt.step < args.steps:
            r = rt.train_step(batch, loss_fn)
            steps.append((r.step, r.version, r.seconds, time.time()))
            losses[r.step] = r.loss
            env.store.set(f"ntp/{env.job}/example/gb/{r.step}", str(r.global_batch))
            if env.worker_id == args.report_from or (not args.report_from and env.local_rank == 0):
                print(f"step {r.step:3d}  layout v{r.version}  tp {r.tp}  global batch {r.global_batch:3d}  "
                      f"loss {r.loss:.5f}", flush=True)
        if args.timeline:  # for bench/lost.py: this rank's timeline and steps
            Path(args.timeline).mkdir(parents=True, exist_ok=True)
            (Path(args.timeline) / f"{env.worker_id}.{os.getpid()}.json").write_text(json.dumps(
                {"events": [(e.what, e.version, e.at) for e in rt.timeline], "steps": steps}))
        if args.check:
            return check(env, rt, losses, args)
        return 0
    finally:
        rt.close()


def check(env: Any, rt: Any, losses: dict[int, float], args: argparse.Namespace) -> int:
    """Train one process on the same global batches and compare this rank's losses and its
    shards of the final parameters with it."""
    import torch

    from ntp_manager.worker import ShardedModule

    gbs = [int(env.store.get(f"ntp/{env.job}/example/gb/{s}")) for s in range(args.steps)]
    torch.manual_seed(args.seed)  # as the runtime does before building the model
    ref = make_model()
    opt = make_optimizer(args.optimizer, ref.parameters())
    ref_losses = []
    for s, gb in enumerate(gbs):
        opt.zero_grad()
        loss = loss_fn(ref, batch(s, 0, gb))
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    worst_loss = max(abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]) for s in losses)
    worst_param, seen = 0.0, set()
    for path, mod in rt.model.named_modules():
        rmod = ref.get_submodule(path)
        sharded = {n: mod.source_index(n) for n, _, _ in mod.sharded_params()} if isinstance(mod, ShardedModule) else {}
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name in sharded:
                src, dim, index = sharded[name]
                want = getattr(rmod, src).detach().index_select(dim, index)  # the reference is on the CPU
            else:
                want = getattr(rmod, name).detach()
            worst_param = max(worst_param, float((p.detach().cpu() - want).norm() / want.norm()))
    tied = rt.model.get_input_embeddings().weight is rt.model.get_output_embeddings().weight
    ok = worst_loss <= 1e-5 and worst_param <= 1e-5 and tied
    print(f"check {'ok' if ok else 'FAILED'}: {len(losses)} steps, worst loss {worst_loss:.1e}, "
          f"worst parameter {worst_param:.1e} (rel. to one process), embeddings tied: {tied}", flush=True)
    return 0 if ok else 1


# ---- the whole system on this machine --------------------------------------------------------------
def demo(args: argparse.Namespace) -> int:
    from ntp_manager.demos.demo import stop_on_signals

    with stop_on_signals():  # Ctrl-C or SIGTERM: every process stopped, quietly
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    import datetime as dt

    import httpx
    import torch.distributed as dist

    from ntp_agent.local import FakeFleet
    from ntp_manager.demos.demo import NODES, create_token, demo_logs, manager_process, wait
    from ntp_manager.worker.env import pid_key, progress_key

    root = Path(tempfile.mkdtemp(prefix="ntp-llama-"))
    logs = None if args.verbose else root / "logs"
    if logs is not None:
        logs.mkdir()
    print(f"data in {root}; " + (f"logs in {logs}/: manager.log, agent-<node>.log, ranks/ (ntp-run --log-dir: "
                                 "<job>_*/attempt_<restart>/<local rank>/{stdout,stderr}.log)" if logs
                                 else "logs on the console (--verbose)"), flush=True)
    tokens = {s: create_token(root, s) for s in ("worker", "operator")}
    agent_tokens = {n.name: create_token(root, "agent", n.name) for n in NODES}  # one per node
    (root / "worker.token").write_text(tokens["worker"])
    with demo_logs(logs), manager_process(root, logs / "manager.log" if logs else None) as (_proc, info):
        api = httpx.Client(base_url=f"http://{info['http']}", timeout=20,
                           headers={"Authorization": f"Bearer {tokens['operator']}"})
        agents = FakeFleet(info["grpc"], agent_tokens, NODES)
        run = None
        try:
            wait(agents.ready, 30, "the agents to register")
            c = llama_config()
            job = {"name": JOB, "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2,
                   "heads": c.num_key_value_heads, "mlp_columns": c.intermediate_size, "scheme": "ntp",
                   "domains": ["nvl-0", "nvl-1"]}
            api.post("/v1/jobs", json=job).raise_for_status()
            wait(lambda: api.get(f"/v1/jobs/{JOB}").json()["layout_version"], 30, "the first layout")
            gpus = agents.gpus("node-a") + agents.gpus("node-b")
            port = _free_port()
            # the ranks' logs (stderr) to files only, what they print (stdout) to files and the console
            output = ["--log-dir", str(logs / "ranks"), "--redirects", "2", "--tee", "1"] if logs else []
            cmd = [sys.executable, "-m", "ntp_manager.worker.run", "--manager", info["grpc"], "--token-file",
                   str(root / "worker.token"), "--job", JOB, "--gpus", ",".join(gpus), "--store-port", str(port),
                   "--max-restarts", "1", "--restart-delay", "1", *output, __file__, "--steps", str(args.steps),
                   "--check", "--optimizer", args.optimizer, "--log-level", "info"]
            print(f"$ ntp-run --manager {info['grpc']} --gpus <8 fake GPUs> {' '.join(output)} "
                  f"{Path(__file__).name} --steps {args.steps} --check", flush=True)
            run = subprocess.Popen(cmd)
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))

            def step() -> int:
                best = -1
                for g in gpus:
                    key = progress_key(JOB, g)
                    if store.check([key]):
                        best = max(best, int(json.loads(store.get(key))["step"]))
                return best

            victim = agents.gpus("node-a")[3]
            wait(lambda: step() >= args.fail_at or run.poll() is not None, 600, f"step {args.fail_at}")
            print(f"--- GPU node-a/3 fails (XID 48); its rank's process dies with it (step {step()})", flush=True)
            agents.inject("node-a", "xid", 3, xid=48)
            os.kill(int(store.get(pid_key(JOB, victim))), signal.SIGKILL)
            wait(lambda: step() >= args.repair_at or run.poll() is not None, 600, f"step {args.repair_at}")
            print(f"--- GPU node-a/3 repaired (step {step()}); ntp-run's fresh process rejoins", flush=True)
            agents.inject("node-a", "repair", 3)
            rc = run.wait(900)
            hist = api.get(f"/v1/jobs/{JOB}/layouts", params={"limit": 100}).json()["items"]
            for x in sorted(hist, key=lambda x: x["version"]):
                print(f"layout v{x['version']}: " + " ".join(f"TP{r['tp']}/{r['local_batch']}" for r in x["replicas"])
                      + f"  ({x['reason']})")
            print(f"ntp-run exited with {rc}; data and logs in {root}")
            return int(rc)
        finally:
            if run is not None and run.poll() is None:
                run.terminate()  # ntp-run stops its ranks
                try:
                    run.wait(30)
                except subprocess.TimeoutExpired:
                    run.kill()
                    run.wait()
            agents.stop()
            api.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="compare with one process at the end")
    p.add_argument("--collective-timeout", type=float, default=10.0)
    p.add_argument("--report-from", default="", help="the worker that prints the steps (default: ntp-run's first)")
    p.add_argument("--demo", action="store_true", help="run a manager, fake agents and ntp-run on this machine")
    p.add_argument("--fail-at", type=int, default=8, help="--demo: the GPU fails after this step")
    p.add_argument("--repair-at", type=int, default=16, help="--demo: and is repaired after this one")
    p.add_argument("--verbose", action="store_true", help="--demo: every log on the console instead of files")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the model and data (see SHAPES)")
    p.add_argument("--abort-poll", type=float, default=0.05, help="RuntimeConfig.abort_poll_s (0: no abort watch)")
    p.add_argument("--timeline", default="", help="write each rank's timeline and steps to DIR/<worker>.<pid>.json")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                   help="the ranks' log (stderr); the runtime logs every event at info")
    args = p.parse_args()
    SHAPE.update(SHAPES[args.shape])
    if args.demo:
        return demo(args)
    if "NTP_STORE" not in os.environ:
        p.error("start it with ntp-run (see the docstring), or pass --demo")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
