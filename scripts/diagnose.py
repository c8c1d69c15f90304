"""What happened to a run that failed: read every rank's records in RUN_DIR/failures and say where.

    python scripts/diagnose.py runs/x

Prints, from the files the ranks wrote when the run ended (failures/comm_rank<R>.json: each rank's
recent collectives and every rank's last heartbeat; stacks_rank<R>.txt: a stalled rank's threads):
- why the run ended (the first reason published) and each rank's last step, phase and op;
- the first op where the ranks' records disagree (kind, group, shape, sequence number);
- the ranks that never arrived at the op the others waited in, or left no record at all;
- the stalled rank's stack (its main thread);
- the checkpoint to resume from.
Exits 1 if RUN_DIR has no failure records.
"""

import argparse
import json
import sys
from pathlib import Path


def load_dumps(folder: Path) -> dict[int, dict]:
    dumps = {}
    for path in sorted(folder.glob("comm_rank*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"  (skipped {path.name}: {e})")
            continue
        dumps[int(data["rank"])] = data
    return dumps


def signature(record: dict) -> tuple:
    return record["kind"], record["group"], tuple(record["shape"]), record["dtype"]


def first_disagreement(dumps: dict[int, dict]) -> tuple[int, dict[int, dict]] | None:
    """The lowest sequence number that every rank recorded but not all alike: (seq, {rank: record})."""
    by_rank = {r: {rec["seq"]: rec for rec in d["records"]} for r, d in dumps.items()}
    if len(by_rank) < 2:
        return None
    common = set.intersection(*(set(records) for records in by_rank.values()))
    for seq in sorted(common):
        records = {r: by_rank[r][seq] for r in by_rank}
        if len({signature(rec) for rec in records.values()}) > 1:
            return seq, records
    return None


def in_flight(dump: dict) -> dict | None:
    """The op the rank waited in: as the comm layer judged it when it wrote the dump (waiting_seq), or,
    in an older dump, its newest op if it had not ended (transfers posted ahead of time excepted)."""
    records = dump["records"]
    if "waiting_seq" in dump:
        return next((r for r in records if r["seq"] == dump["waiting_seq"]), None)
    if records and (
        records[-1].get("error") or (records[-1]["end"] is None and not records[-1].get("posted"))
    ):
        return records[-1]
    return None


def describe(record: dict) -> str:
    shape = "x".join(map(str, record["shape"])) or "-"
    error = f", failed: {record['error']}" if record.get("error") else ""
    dtype = record["dtype"] or "-"
    return f"{record['kind']} on {record['group']} (seq {record['seq']}, shape {shape}, {dtype}{error})"


def heartbeats(dumps: dict[int, dict]) -> dict[int, dict]:
    """Every rank's last heartbeat, as the survivors saw it (the newest copy of each)."""
    beats: dict[int, dict] = {}
    for dump in dumps.values():
        for rank, beat in (dump.get("heartbeats") or {}).items():
            rank = int(rank)
            if rank not in beats or beat.get("beat", 0) > beats[rank].get("beat", 0):
                beats[rank] = beat
    return beats


def main_thread_stack(path: Path) -> str:
    """The main thread's part of a stacks_rank<R>.txt (parallel/lifecycle/watchdog.py names each thread)."""
    text = path.read_text(errors="replace")
    for block in text.split("--- thread ")[1:]:
        if block.startswith("MainThread"):
            return "thread " + block.split("\n---")[0].strip()
    return text.strip()


def diagnose(run_dir: Path) -> int:
    folder = run_dir / "failures"
    dumps = load_dumps(folder) if folder.is_dir() else {}
    if not dumps:
        print(
            f"{run_dir}: no failure records in {folder} (the run did not fail, or failed before its process "
            f"groups existed: see its log)"
        )
        return 1
    beats = heartbeats(dumps)
    world = max([*dumps, *beats]) + 1
    reasons = [d.get("reason", "") for d in dumps.values() if d.get("reason")]
    print(f"run {run_dir}: {world} ranks, records from {len(dumps)}")
    if reasons:
        print(f"why it ended: {min(reasons, key=len)}")
    print("\nranks:")
    for rank in range(world):
        beat, dump = beats.get(rank, {}), dumps.get(rank)
        where = f"step {beat.get('step')} (phase: {beat.get('phase')})" if beat else "?"
        if dump is not None:
            op = in_flight(dump)
            where = f"step {dump.get('step')} (phase: {dump.get('phase')})"
            print(
                f"  rank {rank} ({dump.get('host', '?')}:{dump.get('pid')}): {where}; "
                f"{'waiting in ' + describe(op) if op else 'in no collective'}"
            )
        else:
            print(
                f"  rank {rank} ({beat.get('host', '?')}:{beat.get('pid', '?')}): no record (killed, stopped "
                f"or lost); its last heartbeat: {where}, state {beat.get('state', '?')}"
            )

    print()
    disagreement = first_disagreement(dumps)
    if disagreement:
        seq, records = disagreement
        print(f"first op where the ranks disagree: seq {seq}")
        for rank, record in sorted(records.items()):
            print(f"  rank {rank}: {describe(record)}")
    else:
        print("the ranks' records agree on every op they share")

    waits = {r: in_flight(d) for r, d in dumps.items() if in_flight(d)}
    if waits:
        groups: dict[tuple, list[int]] = {}
        for rank, record in waits.items():
            groups.setdefault((record["seq"], *signature(record)), []).append(rank)
        for ranks in groups.values():
            record = waits[ranks[0]]
            absent = [r for r in range(world) if r not in ranks]
            print(
                f"ranks {', '.join(map(str, sorted(ranks)))} waited in {describe(record)}; "
                f"never arrived there: {', '.join(map(str, absent)) if absent else 'none'}"
            )

    for stacks in sorted(folder.glob("stacks_rank*.txt")):
        print(f"\nstalled rank's stack ({stacks.name}, main thread):")
        print("  " + main_thread_stack(stacks).replace("\n", "\n  "))

    pointer = run_dir / "checkpoints" / "latest"
    print()
    if pointer.is_file():
        print(
            f"resume from: {run_dir / 'checkpoints' / pointer.read_text().strip()} (run the same command: "
            f"train.resume=auto takes it)"
        )
    else:
        print("resume from: no checkpoint was written; the run starts again from step 0")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", help="the run directory (run.output_dir)")
    args = parser.parse_args(argv)
    return diagnose(Path(args.run_dir))


if __name__ == "__main__":
    sys.exit(main())
