"""Worker-group futures and the split train step through the controller's DataParallelGroup
(one DP=2 gloo world of policy workers for the module).

The split step is fed the way a streaming controller would: prompt groups of rows, each to a
DP rank of its choosing (unevenly), its futures awaited only before ``finish_train_step``. Its
gradient must be ``train``'s on the same rows (fp32; the rows' gradient sums are taken in
another order, so up to round-off), and with SGD (its first step moves by ``lr x gradient``,
unlike Adam, which turns round-off in structurally zero gradients into lr-sized updates) so
must the parameters.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait

import pytest
import torch

from mcore_rl.algorithms.losses import ClippedPGLoss
from mcore_rl.config.schema import LossConfig, OptimizerConfig
from mcore_rl.data import batch as B
from mcore_rl.distributed.worker_group import DataParallelGroup, ProcessWorkerGroup, WorkerError
from mcore_rl.workers.policy import PolicyWorker
from test_policy_worker import _kwargs, _rollout

LOSS = ClippedPGLoss(LossConfig())
ROWS, MBS = 12, 2


class GroupProbe(PolicyWorker):
    """A policy worker with test-only read-outs and waits."""

    def local_params(self):
        return [p.detach().clone() for m in self.model for p in m.parameters()]

    def main_grads(self):
        return [p.main_grad.detach().clone() for m in self.model for p in m.parameters()]

    def set_local_params(self, params):
        """Back to ``params`` with a fresh optimizer (SGD's momentum empty)."""
        with torch.no_grad():
            for p, saved in zip((p for m in self.model for p in m.parameters()), params):
                p.copy_(saved)
        self.rebuild_optimizer()

    def wait_for(self, path):
        """Return this rank once ``path`` exists."""
        while not os.path.exists(path):
            time.sleep(0.01)
        return self.rank

    def rank_unless(self, failing_rank):
        if self.rank == failing_rank:
            raise ValueError(f"rank {self.rank} refuses")
        return self.rank


@pytest.fixture(scope="module")
def dp():
    kwargs = dict(_kwargs(), use_reference=False, global_batch_size=ROWS,
                  optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=0.0))
    group = DataParallelGroup(ProcessWorkerGroup(GroupProbe, 2, kwargs))
    yield group
    group.shutdown()


def test_calls_return_futures_per_rank_in_order(dp, tmp_path):
    group = dp.group
    gate = tmp_path / "gate"
    blocked = group.call_each_async("wait_for", [[str(gate)]], ranks=[1])
    free = group.call_each_async("layout", [[]], ranks=[0])
    done, _ = wait([blocked, free], return_when=FIRST_COMPLETED)
    assert free in done and not blocked.done()  # rank 0 does not wait for rank 1
    assert free.result()[0]["rank"] == 0
    queued = group.call_async("rank_unless", -1)  # behind the blocked call on rank 1
    gate.touch()
    assert blocked.result() == [1] and queued.result() == [0, 1]
    failed = group.call_async("rank_unless", 1)
    with pytest.raises(WorkerError, match=r"(?s)\[rank 1\].*rank 1 refuses") as e:
        failed.result()
    assert "[rank 0]" not in str(e.value)
    assert group.call("rank_unless", -1) == [0, 1]  # both ranks still serve
    by_dp = dp.call_per_dp_async("layout", [[]], dp_ranks=[1]).result()
    assert [lay["dp_rank"] for lay in by_dp] == [1]


def _close(actual, expected, what):
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max()), (what, i)


def test_split_step_through_the_dp_group_equals_train(dp):
    batch = _rollout(ROWS, seed=1)
    batch["prev_logprobs"] = dp.gather_rows("get_logprobs", batch, 4)
    start = dp.call("local_params")

    sync = dp.train(batch, LOSS, MBS)
    sync_grads, sync_params = dp.call("main_grads")[0], dp.call("local_params")[0]

    dp.group.call_each("set_local_params", [[p] for p in start])
    dp.begin_train_step(LOSS, ROWS, MBS)
    # prompt groups of 3 rows as they "arrive": DP rank 1 gets three, DP rank 0 one
    parts = [dp.train_microbatch(B.select(batch, slice(i, i + 3)), d)
             for i, d in zip(range(0, ROWS, 3), (1, 0, 1, 1))]
    assert [f.result() for f in parts] == [None] * 4
    split = dp.finish_train_step()
    _close(dp.call("main_grads")[0], sync_grads, "grad")
    _close(dp.call("local_params")[0], sync_params, "param")
    assert sync["grad_norm"] > 0 and split.keys() == sync.keys()
    for k in sync:
        if k not in ("microbatch_tokens_max", "padding_fraction"):  # micro-batches cut from other rows
            assert split[k] == pytest.approx(sync[k], rel=1e-5, abs=1e-7), k

    # a part that fails aborts its rank's step; abort closes the others; train is as before
    dp.group.call_each("set_local_params", [[p] for p in start])
    dp.begin_train_step(LOSS, ROWS, MBS)
    dp.train_microbatch(B.select(batch, slice(0, 3)), 0).result()
    bad = {k: v for k, v in B.select(batch, slice(3, 6)).items() if k != "advantages"}
    with pytest.raises(WorkerError, match="advantages"):
        dp.train_microbatch(bad, 1).result()
    dp.abort_train_step()
    again = dp.train(batch, LOSS, MBS)
    assert again == sync
    assert all(torch.equal(a, b) for a, b in zip(dp.call("local_params")[0], sync_params))


class Bare:
    """A worker without a model (the group's own behaviour)."""

    def __init__(self, **kwargs):
        self.rank = kwargs["rank"]

    def pid(self):
        return os.getpid()

    def exit(self):
        os._exit(3)

    def echo(self, value):
        """``value`` back, and what arrived: each tensor's dtype, shape, strides, whether it
        requires grad and whether its storage is shared memory (torch's reduction)."""
        tensors = value if isinstance(value, (list, tuple)) else [value]
        return value, [(t.dtype, tuple(t.shape), t.stride(), t.requires_grad, t.is_shared())
                       for t in tensors]

    def count(self, tag, n):
        """Send 0 .. n-1 under ``tag`` before answering (partial results)."""
        from mcore_rl.distributed.worker_group import send_partial

        sent = [send_partial(tag, (self.rank, i)) for i in range(n)]
        return n, all(sent)


def test_signals_ignored_and_a_dead_worker_fails_its_calls():
    """SIGTERM and SIGUSR1 (preemption: the controller's to handle) leave a worker running; a
    worker that exits fails its pending and later calls with WorkerError.gone naming it,
    instead of hanging, and the other ranks go on."""
    group = ProcessWorkerGroup(Bare, 2, {})
    try:
        pids = group.call("pid")
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            os.kill(pids[0], sig)
        assert group.call("pid") == pids
        dying = group.call_async("exit", ranks=[1])
        later = group.call_async("pid", ranks=[1])
        for f in (dying, later):
            with pytest.raises(WorkerError, match=r"\[rank 1\]\nthe worker process is gone") as err:
                f.result(timeout=120)
            assert err.value.gone == {1}
        with pytest.raises(WorkerError) as err:
            group.call("pid")
        assert err.value.gone == {1}
        assert group.call_async("pid", ranks=[0]).result() == pids[:1]
        assert group.gone_ranks() == [1]  # known without a call
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while group.gone_ranks() != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.gone_ranks() == [0, 1]
    finally:
        group.shutdown()


class Rendezvous:
    """Rank 0 hosts a TCPStore on the group's port, the others join it (the rendezvous of
    ``torch.distributed`` start-up); rank 0 raises first with ``fail``."""

    def __init__(self, rank, world_size, master_addr, master_port, fail=False, **kwargs):
        from datetime import timedelta

        if fail and rank == 0:
            raise ValueError("rank 0 cannot build")
        self.store = torch.distributed.TCPStore(master_addr, master_port, world_size,
                                                is_master=rank == 0,
                                                timeout=timedelta(seconds=300))
        self.rank = rank

    def port(self):
        return self.store.port


def _start_in_thread(*args, **kwargs):
    """ProcessWorkerGroup(*args, **kwargs) in a thread; returns (thread, outcome dict)."""
    outcome = {}

    def start():
        try:
            outcome["group"] = ProcessWorkerGroup(*args, **kwargs)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, outcome


STALL = 300  # a start-up that waits for a rank that will never answer waits forever


def test_start_up_fails_at_the_first_rank_that_fails_and_kills_the_others():
    """Rank 0 fails to build while rank 1 waits for the store rank 0 was to host: the group's
    start-up fails with rank 0's error at once instead of waiting for rank 1's rendezvous
    timeout, and rank 1's process is killed."""
    before = set(p.pid for p in multiprocessing.active_children())
    thread, outcome = _start_in_thread(Rendezvous, 2, {"fail": True})
    thread.join(STALL)
    assert not thread.is_alive()
    err = outcome["error"]
    assert isinstance(err, WorkerError) and "rank 0 cannot build" in str(err)
    assert "[rank 1]" not in str(err)
    assert not [p for p in multiprocessing.active_children() if p.pid not in before]


def test_start_up_takes_a_new_port_when_the_rendezvous_port_was_taken(monkeypatch):
    """Another process binds the port free_port() found before rank 0 listens on it
    (EADDRINUSE): the start-up is tried again on a new port and the group works."""
    from mcore_rl.distributed import worker_group

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = worker_group.free_port
    monkeypatch.setattr(worker_group, "free_port", lambda: next(ports, None) or real())
    try:
        thread, outcome = _start_in_thread(Rendezvous, 2, {})
        thread.join(STALL)
        assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
        group = outcome["group"]
        try:
            port = group.call("port")
            assert port[0] == port[1] != taken.getsockname()[1]
        finally:
            group.shutdown()
    finally:
        taken.close()


def test_tensors_cross_the_pipe_unchanged_small_ones_by_value():
    """A call's arguments and answer through the pipes: every tensor arrives equal (dtype,
    shape, values; bf16 and float8 reinterpreted on the way and back), small CPU tensors by
    value (not in shared memory: torch's reduction costs a segment per tensor), tensors over
    BY_VALUE_BYTES, tensors that require grad and tensors already shared by torch's reduction
    as before."""
    from mcore_rl.distributed.worker_group import BY_VALUE_BYTES

    g = torch.Generator().manual_seed(0)
    big = torch.zeros(BY_VALUE_BYTES // 4 + 1)
    sent = [torch.randint(0, 9, (183,), generator=g), torch.randn(5, 7, generator=g).t(),
            torch.randn(6, generator=g).bfloat16(), torch.randn(4, generator=g).half(),
            torch.randn(3, generator=g).to(torch.float8_e4m3fn), torch.tensor([True, False]),
            torch.zeros(0, 3), big, torch.ones(2, requires_grad=True),
            torch.arange(3).share_memory_()]
    group = ProcessWorkerGroup(Bare, 1, {})
    try:
        (answer,) = group.call("echo", sent)
    finally:
        group.shutdown()
    back, arrived = answer
    for t, u, (dtype, shape, stride, grad, shared) in zip(sent, back, arrived):
        assert u.dtype == t.dtype == dtype and tuple(u.shape) == tuple(t.shape) == shape
        assert torch.equal(u.detach().float(), t.detach().float())
        assert grad == t.requires_grad
        assert shared == (t is big or t.requires_grad or t.is_shared()), (t.dtype, t.shape)


def test_partial_results_come_before_the_answer_to_their_listener():
    """send_partial in a worker's call: the controller's listener for the tag gets each value,
    in order, before the call's future is done; other tags' and unlistened values are dropped;
    a listener that raises is logged and the call still answers; outside a worker process
    send_partial sends nothing."""
    from mcore_rl.distributed.worker_group import send_partial

    group = ProcessWorkerGroup(Bare, 2, {})
    got, before_answer = [], []
    try:
        assert group.listen("a", got.append)
        future = group.call_async("count", "a", 3)
        answers = future.result(timeout=120)
        before_answer.extend(got)
        assert answers == [(3, True), (3, True)]
        assert sorted(before_answer) == [(r, i) for r in (0, 1) for i in range(3)]
        assert [i for r, i in before_answer if r == 0] == [0, 1, 2]  # in order per rank
        group.call("count", "b", 2)  # nobody listens to "b"
        assert group.listen("a", None)
        group.call("count", "a", 2)
        assert len(got) == 6

        def broken(value):
            raise RuntimeError("listener bug")

        group.listen("c", broken)
        assert group.call("count", "c", 2) == [(2, True), (2, True)]
    finally:
        group.shutdown()
    assert send_partial("a", 1) is False
