"""The comm layer waits on the host only between the chunks of an oversized message (issue 12).

Run on one gloo process: `_host_sync` (the only place the host waits for a CUDA stream) is replaced by
a counter, and every op is run once under the cap and once above it. The expected counts come from
the message sizes alone: zero under the cap, one per chunk above it.
"""

import pytest
import torch
import torch.distributed as dist

from parallel.compute import comm
from parallel.lifecycle.runtime import _free_port


@pytest.fixture
def world_of_one(monkeypatch):
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    syncs = []
    monkeypatch.setattr(comm, "_host_sync", lambda tensor: syncs.append(tensor.numel()))
    yield syncs
    comm.configure(256)
    if started:
        dist.destroy_process_group()


CAP_ELEMENTS = 1024  # float32: 4 KiB


def _ops(n):
    """Each comm op on n float32 elements, checking its result, in one process."""
    x = torch.arange(n, dtype=torch.float32)
    yield "all_reduce", lambda: torch.testing.assert_close(comm.all_reduce(x.clone()), x)
    yield "broadcast", lambda: torch.testing.assert_close(comm.broadcast(x.clone(), 0, None), x)
    out = torch.empty(n)
    yield "all_gather", lambda: torch.testing.assert_close(comm.all_gather_into_tensor(out, x, None), x)
    yield "reduce_scatter", lambda: torch.testing.assert_close(comm.reduce_scatter_tensor(out, x, None), x)
    yield "all_to_all", lambda: torch.testing.assert_close(comm.all_to_all_single(out, x, None), x)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_host_waits_only_between_chunks(world_of_one, chunks):
    comm.configure(CAP_ELEMENTS * 4 / 2**20)
    for kind, run in _ops(chunks * CAP_ELEMENTS):
        world_of_one.clear()
        run()
        # world size 1: an oversized all-to-all has no peer rounds, so nothing to wait between
        expected = 0 if chunks == 1 or kind == "all_to_all" else chunks
        assert len(world_of_one) == expected, (kind, chunks, world_of_one)


class _Done:
    def wait(self):
        return True


def test_small_ring_exchange_stays_asynchronous(world_of_one, monkeypatch):
    # gloo cannot send to itself: a loopback pair stands in for the peer (one work for the send, one for the
    # receive)
    monkeypatch.setattr(
        comm, "_post_pair", lambda send, to, recv, source, group: (recv.copy_(send), [_Done(), _Done()])[1]
    )
    comm.configure(CAP_ELEMENTS * 4 / 2**20)
    send, recv = torch.arange(CAP_ELEMENTS, dtype=torch.float32), torch.empty(CAP_ELEMENTS)
    comm.exchange(send, 0, recv, 0, None).wait()
    torch.testing.assert_close(recv, send)
    assert world_of_one == []
    big_send, big_recv = torch.arange(5 * CAP_ELEMENTS, dtype=torch.float32), torch.empty(5 * CAP_ELEMENTS)
    comm.exchange(big_send, 0, big_recv, 0, None).wait()
    torch.testing.assert_close(big_recv, big_send)
    assert len(world_of_one) == 2 * 5  # a send and a receive per piece, each waited on


def test_transfers_posted_ahead_are_not_waited_in():
    """PipeFusion posts receives before it computes: a rank computing beside them is not 'in an op'
    (else a stalled stage would be taken for one waiting in a collective); waiting for them is."""
    log = comm.CommLog()
    record = comm.recorded("recv", None, torch.zeros(4), log=log).record
    record.posted = True  # as comm.post marks what it posts
    seen = []

    class Work:  # a transfer that completes when waited for, noting where the rank was meanwhile
        def wait(self):
            seen.append(log.blocked_in())

        def is_completed(self):
            return bool(seen)

    pending = comm.PendingOps([Work()], [record], log)
    assert log.blocked_in() is None  # posted, computing beside it
    pending.wait()
    assert seen == [record] and record.end is not None and log.blocked_in() is None


def test_two_runtimes_keep_their_own_records(world_of_one):
    """Each runtime's CommLog holds the ops of the groups it adopted, and only those: two in one
    process (as tests build them) need no global reset between them."""
    first, second = comm.CommLog(max_message_mb=1), comm.CommLog(max_message_mb=2)
    group_a, group_b = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    first.adopt(group_a, "a")
    second.adopt(group_b, "b")
    comm.all_reduce(torch.ones(3), group=group_a)
    comm.all_reduce(torch.ones(5), group=group_b)
    comm.all_reduce(torch.ones(7), group=group_b)
    assert [(r.group, r.shape) for r in first.snapshot()] == [("a", (3,))]
    assert [(r.group, r.shape) for r in second.snapshot()] == [("b", (5,)), ("b", (7,))]
    assert first.stats()["ops"] == {"all_reduce": 1} and second.stats()["ops"] == {"all_reduce": 2}
    assert comm.log_of(group_a) is first and comm.log_of(group_b) is second
