"""Data parallelism by hand and ZeRO-1 (helpers.parallel.data_parallel, helpers.parallel.zero): ddp_from_scratch.py
launched with torchrun on 2 CPU processes (gloo) and compared with one process; the bucket assignment, the ZeRO
partition and the gradient hooks tested without processes."""

import itertools
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.parallel.data_parallel import (
    BucketedOverlapDDP,
    FlatBufferAllReduce,
    PerParameterAllReduce,
    assign_buckets,
    trainable_parameters,
)
from helpers.parallel.zero import ZeroRedundancyAdamW, shard_range
from helpers.training.step import lm_loss

CH07 = Path(__file__).resolve().parents[1] / "ch07_parallel"
TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "256", "--ctx", "32"]
WORLD = 2
STEPS = 3
TOL64 = 1e-12  # float64 SGD: the ranks' sums differ from one process's only in summation order (~1e-16 a step)
ADAMW_TOL = 1e-10  # float64 AdamW: the same differences, divided by the gradients' running RMS
VERSIONS = ["torch_ddp", "per_parameter", "flat_buffer", "bucketed_blocking", "bucketed_overlap"]
FLOAT64 = 8  # bytes


@pytest.fixture(scope="module")
def run(torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_from_scratch") / "result.json"
    torchrun(CH07 / "ddp_from_scratch.py", ["--out", out, *TINY, "--dtype", "float64", "--steps", STEPS, "--warmup", 1,
                                            "--bucket-mb", 0.25, "--zero-steps", 3], nproc=WORLD, timeout=240)
    return json.loads(out.read_text())


def model_of(result: dict) -> GPT:
    return GPT(GPTConfig(**result["config"]))


@pytest.mark.parametrize("version", [*VERSIONS, "bucketed_accumulation"])
def test_every_version_equals_one_process_on_the_concatenated_batches(run, version):
    assert run["world_size"] == WORLD and run["backend"] == "gloo" and run["dtype"] == "float64"
    assert run[version]["max_param_change"] > 1e-3  # training moved the weights, so equality means something
    assert run[version]["max_param_diff"] < TOL64


def test_every_version_hands_every_gradient_byte_to_all_reduce_once_per_step(run):
    model = model_of(run)
    grad_bytes = sum(p.numel() for p in model.parameters()) * FLOAT64  # the tied embedding / LM head once
    sizes = [p.numel() * FLOAT64 for p in model.parameters()]
    calls = {"per_parameter": len(sizes), "flat_buffer": 1,
             "bucketed_blocking": len(assign_buckets(sizes, int(0.25 * 2**20))),
             "bucketed_overlap": len(assign_buckets(sizes, int(0.25 * 2**20)))}
    for version in VERSIONS:
        for rank in run[version]["per_rank"]:
            assert rank["bytes"] == [grad_bytes] * STEPS, version
            if version in calls:
                assert rank["calls"] == [calls[version]] * STEPS, version
    for rank in run["bucketed_accumulation"]["per_rank"]:  # no_sync: one set of buckets per optimizer step
        assert rank == [{"calls": calls["bucketed_overlap"], "bytes": grad_bytes}] * run["accumulation_steps"]


def test_buckets_hold_every_parameter_once_in_backward_order(run):
    names = [n for n, _ in model_of(run).named_parameters()]
    flat = [n for bucket in run["buckets"] for n in bucket]
    assert flat == names[::-1]
    assert len(run["buckets"]) > 1


def test_bucketed_launches_buckets_during_backward_and_waits_after_it(run):
    overlap = run["bucketed_overlap"]["overlap"]
    assert len(overlap["bucket_bytes"]) > 1
    assert sum(overlap["bucket_bytes"]) == run["gradient_bytes"]
    for t in overlap["timelines"]:
        launched = t["launched"]
        assert t["backward_start"] < launched[0] < t["backward_end"]  # the first bucket went out mid-backward
        assert launched == sorted(launched) and len(t["completed"]) == len(launched)
        assert all(done >= start for done, start in zip(t["completed"], launched, strict=True))
        assert t["backward_end"] <= t["completed"][-1] <= t["finished"]
    assert 0 < overlap["first_launch_in_backward"] < 1
    assert overlap["launched_before_backward_end"] > 0
    assert run["bucketed_overlap"]["exposed_s"]["median"] >= 0


def test_zero1_equals_one_process_adamw(run):
    zero = run["zero"]
    for name in ("zero1", "ddp_adamw"):
        assert zero[name]["max_param_change"] > 100 * ADAMW_TOL
        assert zero[name]["max_param_diff"] < ADAMW_TOL
    assert zero["zero1_vs_ddp_adamw"] < ADAMW_TOL


def test_zero1_holds_a_1_over_p_shard_of_the_adamw_moments(run):
    numel = sum(p.numel() for p in model_of(run).parameters())
    zero = run["zero"]
    assert zero["flat_numel"] == numel
    for r, rank in enumerate(zero["per_rank"]):
        start, stop = shard_range(numel, WORLD, r)
        assert rank["shard"] == [start, stop]
        assert rank["zero_state_bytes"] == 2 * (stop - start) * FLOAT64  # exp_avg and exp_avg_sq of the shard
        assert rank["ddp_state_bytes"] == 2 * numel * FLOAT64  # DDP: every rank both moments of everything
    assert sum(rank["zero_state_bytes"] for rank in zero["per_rank"]) == 2 * zero["padded_numel"] * FLOAT64


# ---- without processes ----


def test_buckets_are_reverse_order_within_the_size_limit_and_cover_each_parameter_once():
    sizes = [100, 30, 30, 500, 40, 20, 10]
    buckets = assign_buckets(sizes, 100)
    assert buckets == [[6, 5, 4], [3], [2, 1], [0]]  # 3 (500 bytes) alone: a parameter larger than the cap
    assert [i for b in buckets for i in b] == list(reversed(range(len(sizes))))
    assert all(sum(sizes[i] for i in b) <= 100 for b in buckets if len(b) > 1)
    assert assign_buckets(sizes, 10**6) == [list(reversed(range(len(sizes))))]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        BucketedOverlapDDP(torch.nn.Linear(2, 2), bucket_mb=bad)
    if bad <= 0:
        with pytest.raises(ValueError, match="pass bucket_mb > 0"):
            assign_buckets([4, 4], int(bad))


@pytest.mark.parametrize("numel, world", [(10, 4), (12, 4), (7, 7), (1001, 3)])
def test_zero_shards_are_equal_contiguous_and_cover_every_element(numel, world):
    shards = [shard_range(numel, world, r) for r in range(world)]
    assert shards[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(shards))  # contiguous, in order
    assert len({stop - start for start, stop in shards}) == 1  # every rank the same share of the state
    assert numel <= shards[-1][1] < numel + world  # everything covered; the padding under one element per rank


def test_zero_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank must be in 0..world_size-1"):
        shard_range(10, 2, 2)
    with pytest.raises(ValueError, match="world_size >= 1"):
        shard_range(10, 0, 0)
    with pytest.raises(ValueError, match="cannot be sharded over 4 ranks"):
        shard_range(3, 4, 0)


def test_flat_buffers_need_one_dtype():
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="flat buffers need one"):
        trainable_parameters(mixed.parameters())
    with pytest.raises(ValueError, match="no trainable parameters"):
        trainable_parameters(torch.nn.Linear(2, 2).requires_grad_(False).parameters())


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, context_length=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0)).double()


def test_tied_weight_hook_fires_once_after_both_contributions():
    """The embedding and the LM head are one tensor with one gradient accumulator: its post-accumulate hook fires
    once per backward, last, when the gradient already holds both uses' contributions."""
    model = tiny_gpt()
    tied = model.tok_emb.weight
    assert model.lm_head.weight is tied
    fired, seen = [], []

    def record(p: torch.nn.Parameter, name: str) -> None:
        fired.append(name)
        seen.append(p.grad.clone())

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
    x = torch.randint(0, 32, (2, 8))  # only ids below 32 are embedded: the other rows get only the LM head's share
    lm_loss(model(x), x).backward()
    assert fired.count("tok_emb.weight") == 1 and fired[-1] == "tok_emb.weight"
    torch.testing.assert_close(seen[-1], tied.grad, rtol=0, atol=0)
    assert tied.grad[32:].abs().sum() > 0 and tied.grad[:32].abs().sum() > 0


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process: the wrappers' code paths without torchrun."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("wrap", [PerParameterAllReduce, FlatBufferAllReduce,
                                  lambda m: BucketedOverlapDDP(m, bucket_mb=0.001)])
def test_wrappers_leave_one_ranks_gradients_and_accumulate_under_no_sync(one_rank_group, wrap):
    model, reference = tiny_gpt(), tiny_gpt()
    wrapper = wrap(model)
    x1, x2 = torch.randint(0, 64, (2, 2, 8))
    wrapper.zero_grad()
    with wrapper.no_sync():
        lm_loss(wrapper(x1), x1).backward()
        wrapper.finish()
    assert wrapper.log.calls == 0  # nothing communicated inside no_sync
    lm_loss(wrapper(x2), x2).backward()
    wrapper.finish()
    assert wrapper.log.bytes == sum(p.numel() for p in model.parameters()) * FLOAT64
    (lm_loss(reference(x1), x1) + lm_loss(reference(x2), x2)).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)


def test_flat_buffer_refuses_gradients_that_left_the_buffer(one_rank_group):
    model = tiny_gpt()
    wrapper = FlatBufferAllReduce(model)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()  # set_to_none: the views are gone
    x = torch.randint(0, 64, (2, 8))
    lm_loss(wrapper(x), x).backward()
    with pytest.raises(RuntimeError, match="no longer a view of the flat buffer"):
        wrapper.finish()


def test_zero1_on_one_rank_is_adamw(one_rank_group):
    model, reference = tiny_gpt(), tiny_gpt()
    zero = ZeroRedundancyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        x = torch.randint(0, 64, (2, 8))
        zero.zero_grad()
        lm_loss(model(x), x).backward()
        zero.step()
        adamw.zero_grad()
        lm_loss(reference(x), x).backward()
        adamw.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)
    assert zero.state_bytes() == 2 * sum(p.numel() for p in model.parameters()) * FLOAT64


def test_finish_reads_its_times_after_waiting_for_the_compute_stream(one_rank_group, monkeypatch):
    """On CUDA the host runs ahead of the GPU and NCCL's wait() does not block it: finish() waits for the compute
    stream before it reads the end of backward and after the gradients are averaged, and the overlap wrapper after
    each all_reduce it waits for. No GPU here: the waits are recorded in order with the times the log reads."""
    wrapper = BucketedOverlapDDP(tiny_gpt(), bucket_mb=0.001)
    waits = []
    monkeypatch.setattr(wrapper, "wait_for_compute", lambda: waits.append(time.perf_counter()))
    x = torch.randint(0, 64, (2, 8))
    wrapper.zero_grad()
    lm_loss(wrapper(x), x).backward()
    wrapper.finish()
    log = wrapper.log
    assert len(log.completed) > 1 and len(waits) == len(log.completed) + 2
    assert waits[0] <= log.backward_end <= waits[1]
    assert all(wait <= done for wait, done in zip(waits[1:-1], log.completed, strict=True))
    assert log.completed[-1] <= waits[-1] <= log.finished
