"""What the failure handling costs a training step (parallel/lifecycle/watchdog.py): the per-step stop-flag
exchange on the gloo control group, and the watchdog thread's work each second (publish a heartbeat,
read the abort key and the watched peers' heartbeats on the c10d store).

    python scripts/bench_watchdog.py [--ranks 2] [--calls 300] [--json FILE]
    python scripts/bench_watchdog.py --tiny      # 5 calls each

Spawns the ranks itself (gloo on 127.0.0.1, a TCPStore as torchrun's agent would host it) and prints
the median cost of each, next to the demo's step time for scale.
"""

import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

DEMO_STEP_S = 0.25  # the demo's median step time on the 2-core CPU machine (BENCHMARKS.md)


def worker(rank, world, port, calls, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=30)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from parallel.lifecycle.faults import Faults
    from parallel.lifecycle.preemption import StopRequest
    from parallel.lifecycle.rendezvous import connect_store
    from parallel.lifecycle.runtime import Runtime
    from parallel.lifecycle.watchdog import Deadlines, Watchdog

    control = dist.new_group(backend="gloo")
    client = connect_store(world, 5.0)
    dog = Watchdog(
        rank, world, client, Path(out).parent, Deadlines(600, 300, 10), interval_s=3600
    )  # ticks by hand
    cpu, stop = torch.device("cpu"), StopRequest()
    runtime = Runtime(
        rank, world, 0, cpu, "gloo", None, None, control, None, dog, stop, dog.comm, Faults(rank)
    )

    flag = benchlib.measure(runtime.agreed_stop_signal, calls, warmup=0, before=lambda: dist.barrier(control))
    dog.start()
    tick = benchlib.measure(dog._tick, calls, warmup=0)
    publish = benchlib.measure(
        dog._publish, calls, warmup=0
    )  # a phase change (at most PUBLISH_EVERY_S apart)
    dog.finish()
    if rank == 0:
        medians = {"flag_ms": flag.median, "tick_ms": tick.median, "publish_ms": publish.median}
        Path(out).write_text(json.dumps({key: 1e3 * seconds for key, seconds in medians.items()}))
    dist.barrier(control)
    dist.destroy_process_group()


def main(argv=None):
    parser = benchlib.parser(__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = benchlib.parse_args(parser, argv, tiny=dict(calls=5))
    out = Path("/tmp") / f"bench_watchdog_{os.getpid()}.json"
    torch.set_num_threads(1)
    spawned = (args.ranks, benchlib.free_port(), args.calls, str(out))
    mp.spawn(worker, args=spawned, nprocs=args.ranks, join=True)
    result = json.loads(out.read_text())
    out.unlink()
    from parallel.lifecycle.watchdog import PUBLISH_EVERY_S

    flag, tick, publish = result["flag_ms"], result["tick_ms"], result["publish_ms"]
    thread = tick + publish / PUBLISH_EVERY_S  # ms of the thread's work per second, at most
    print(f"{args.ranks} ranks, gloo on 127.0.0.1, median of {args.calls} calls")
    print(
        f"stop-flag exchange per step: {flag:.3f} ms = {100 * flag / 1e3 / DEMO_STEP_S:.2f}% of a "
        f"{DEMO_STEP_S:.2f} s demo step"
    )
    print(
        f"watchdog tick (once a second, on its own thread): {tick:.3f} ms; a phase published at once: "
        f"{publish:.3f} ms, at most {1 / PUBLISH_EVERY_S:.0f} a second: "
        f"at most {thread / 10:.3f}% of one core"
    )
    together = 100 * (flag + thread * DEMO_STEP_S) / 1e3 / DEMO_STEP_S
    print(f"together, per demo step: {together:.2f}%")
    if args.json:
        benchlib.write_json(
            args.json, {"ranks": args.ranks, "calls": args.calls, **result, "percent": together}
        )


if __name__ == "__main__":
    from parallel.lifecycle.exits import leave_finished

    main()
    leave_finished()  # gloo threads must not outlive the interpreter
