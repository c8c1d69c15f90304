"""The store channel of the watchdog (parallel/lifecycle/watchdog.py): every rank's heartbeat under hb/<rank>
and the shared abort key on the c10d store, and what they tell about the peers (silent, stopped, gone).
"""

import json
import os
import time

from parallel.lifecycle.exits import one_line

# A store call that failed this way found no server: the store's host process is gone (not slow).
STORE_CLOSED_WORDS = (
    "broken pipe",
    "connection reset",
    "connection refused",
    "got 0 bytes",
    "connection was likely closed",
)


class HeartbeatChannel:
    """Reading and writing the store for a Watchdog, which provides store, rank, world_size, watched,
    interval, deadlines, _peers, _peers_checked and _payload()."""

    def _publish(self) -> None:
        if self.store is not None:
            self._published_at = time.monotonic()
            self.store.set(f"hb/{self.rank}", json.dumps(self._payload()))

    def _publish_quietly(self) -> None:
        try:
            self._publish()
        except Exception:  # the next beat reports a store that stays unreachable
            pass

    def _read_all(self) -> dict[int, dict]:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        present = [r for r, k in zip(range(self.world_size), keys) if self.store.check([k])]
        return {r: json.loads(v) for r, v in zip(present, self.store.multi_get([f"hb/{r}" for r in present]))}

    def _read_abort(self) -> str | None:
        if self.store is None or not self.store.check(["abort"]):
            return None
        return self.store.get("abort").decode()

    def _claim_abort(self, reason: str) -> str:
        """Write `reason` unless another rank's is there already; return the one that stands."""
        if self.store is None:
            return reason
        try:
            return self.store.compare_set("abort", "", reason).decode() or reason
        except Exception:
            return reason

    def outlast_peers(self, wait_s: float) -> None:
        """Where rank 0 hosts the store (no torchrun agent runs it: srun), it leaves last: it waits, at most
        `wait_s`, until every other rank has published that it leaves, so that none finds the store gone
        while it ends (its next beat would name a lost store, and fail a run that succeeded)."""
        if self.store is None or self.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return
        deadline = time.monotonic() + wait_s
        try:
            while time.monotonic() < deadline:
                states = [b.get("state") for r, b in self._read_all().items() if r != self.rank]
                if len(states) == self.world_size - 1 and "running" not in states:
                    return
                time.sleep(0.02)
        except Exception:  # the store answers no more: nothing to outlast
            return

    def peers_stopped(self) -> bool:
        """Whether another rank left on a stop signal (its state `stopped`): a collective that fails then is
        a user's stop reaching the ranks at different moments, not a failure."""
        try:
            return any(b["state"] == "stopped" for r, b in self._read_all().items() if r != self.rank)
        except Exception:
            return False

    def _stopped_peer(self, wait_s: float) -> str | None:
        """torchrun stopped this rank, which it does to every rank when one failed or died: the reason a
        failed rank published, or a rank whose heartbeat did not advance for `wait_s` while every live
        rank beats each interval (a killed rank publishes nothing). None: nobody failed."""
        try:
            before, deadline = self._read_all(), time.monotonic() + wait_s
            while time.monotonic() < deadline:
                reason = self._read_abort()
                if reason:
                    return reason
                time.sleep(self.interval / 2)
            reason, after = self._read_abort(), self._read_all()
        except Exception as e:  # the store went with its host
            return self.store_gone(e)
        if reason:
            return reason
        frozen = [
            (beat.get("time", 0.0), r, beat)
            for r, beat in after.items()
            if r != self.rank and beat["state"] == "running" and before.get(r, {}).get("beat") == beat["beat"]
        ]
        absent = [r for r in range(self.world_size) if r not in after]
        if not frozen and absent and getattr(self, "phase", None) == "rendezvous":
            # waiting for ranks that never sent a heartbeat when torchrun stopped this one: torchrun does that
            # when a rank exits, so one of them died (or failed) before its start-up got that far
            which = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {', '.join(map(str, absent))}"
            one = "it" if len(absent) == 1 else "one of them"
            return (
                f"{which} never reached start-up (no heartbeat on the store) and torchrun then stopped the "
                f"other ranks: {one} most likely died or failed while starting (killed, out of memory; its "
                "own output says why if it printed anything)"
            )
        if not frozen:
            return None
        _, r, beat = min(frozen)  # the heartbeat that stopped first
        return (
            f"rank {r} ({beat['host']}:{beat['pid']}) stopped responding {where(beat)}: its heartbeat "
            f"stopped (killed, or its host lost), and torchrun then stopped the other ranks"
        )

    @staticmethod
    def store_gone(error: BaseException) -> str:
        host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
        return (
            f"the rendezvous store at {host}:{port} stopped answering ({one_line(error)}); it runs in "
            f"the torchrun agent of the first node (or in rank 0): that node or process is gone"
        )

    def _check_peers(self) -> str | None:
        """A watched peer whose heartbeat has not changed while this rank watched for the silence
        deadline. Only the time this process ran counts: a gap between two checks longer than away_cap()
        (this process suspended, or frozen, with its peers) counts nothing, or every rank of a job resumed
        after SIGSTOP would name another dead before their first beats arrive."""
        now = time.monotonic()
        gap = now - self._peers_checked if self._peers_checked is not None else 0.0
        counted = gap if gap <= self.away_cap() else 0.0
        self._peers_checked = now
        keys = [f"hb/{r}" for r in self.watched]
        present = [r for r, k in zip(self.watched, keys) if self.store.check([k])]
        if not present:
            return None
        for r, raw in zip(present, self.store.multi_get([f"hb/{r}" for r in present])):
            beat = json.loads(raw)
            seen = self._peers.get(r)
            if seen is None or seen[0] != beat["beat"]:
                self._peers[r] = (beat["beat"], 0.0, beat)
                continue
            silent = seen[1] + counted
            self._peers[r] = (seen[0], silent, beat)
            if beat["state"] == "running" and silent > self.deadlines.silence_s:
                return (
                    f"rank {r} ({beat['host']}:{beat['pid']}) stopped responding {where(beat)}: its "
                    f"heartbeat has been silent for {silent:.0f} s (killed, stopped or its host lost)"
                )
        return None

    def away_cap(self) -> float:
        """A pause longer than this between two of this rank's checks means the process did not run: it is
        not counted as a peer's silence (a slow store call is shorter: it counts)."""
        return max(3 * self.interval, self.deadlines.silence_s / 2, 2.0)


def where(beat: dict) -> str:
    """Where a rank is, for messages: 'at step 5 (phase: forward)', 'during sampling (step 3 of 30)',
    'at step 200 (phase: preview, sampling step 3 of 30)', 'at start-up (phase: ...)'."""
    step, phase, sampling = beat.get("step"), beat.get("phase"), beat.get("sampling")
    if step is None and sampling:
        k, n = sampling
        return (
            f"during sampling ({f'step {k} of {n}' if phase == 'sampling' else f'{phase}, after step {n}'})"
        )
    if step is None:
        return f"at start-up (phase: {phase})"
    preview = f", sampling step {sampling[0]} of {sampling[1]}" if sampling else ""
    return f"at step {step} (phase: {phase}{preview})"
