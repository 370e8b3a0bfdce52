"""Chapter 7's parallel training, run for real: each script is launched with torchrun on 2 CPU processes (gloo) and
compared with the single-process GPT (which the scripts compute on rank 0, or every rank for its own shard)."""

import os
import re
import time
from pathlib import Path

import pytest
import torch

from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.parallel.comm import ring_all_reduce_bytes
from helpers.parallel.expert_parallel import (
    ExpertParallelMoE,
    exchange_bytes,
    expert_parallel_gpt,
    experts_owned,
    shard_of,
    slots_between_ranks,
)
from helpers.parallel.launch import DistributedRunError, first_traceback, launch, run_for_result
from helpers.parallel.pipeline import bubble_fraction, pipeline_stage, stage_layers
from helpers.parallel.runtime import pick_device_type
from helpers.parallel.tensor_parallel import shard_rows, tensor_parallel_gpt

CH07 = Path(__file__).resolve().parents[1] / "ch07_parallel"
TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "256", "--ctx", "32"]
TOL = 1e-5  # float32 logits and gradients: every parallel variant equals one process within this
# After AdamW steps only float64 is exact: Adam divides by sqrt(v), so a float32 rounding difference in a near-zero
# gradient (a sum computed in another order) can change that weight's update completely. The optimizer-step
# comparisons (DDP, FSDP) therefore run in float64, where summation order costs ~1e-16.
TOL64 = 1e-10
WORLD = 2


def run_script(torchrun, name: str, *args: str) -> dict:
    """`torchrun` (the fixture) marks the test distributed; run_for_result launches the same way."""
    return run_for_result(CH07 / f"{name}.py", [*TINY, *args], nproc=WORLD, timeout=240)


def model_of(result: dict) -> GPT:
    return GPT(GPTConfig(**result["config"]))


def param_bytes(result: dict) -> int:
    """Bytes of the parameters of the run's model, in the run's dtype."""
    element = torch.empty((), dtype=getattr(torch, result.get("dtype", "float32"))).element_size()
    return sum(p.numel() * element for p in model_of(result).parameters())


def close(measured: int, expected: float, rel: float = 0.02) -> bool:
    """Bytes written to a socket: the payload plus a few hundred bytes of headers per message."""
    return expected <= measured <= expected * (1 + rel) + 4096


# ---- data parallel ----


@pytest.fixture(scope="module")
def ddp(torchrun):
    return run_script(torchrun, "ddp", "--steps", "3", "--accumulation", "2", "--dtype", "float64")


@pytest.mark.parametrize("variant", ["ddp", "ddp_ring", "accum_no_sync", "accum_sync_every_micro", "ddp_adamw"])
def test_ddp_equals_single_process_on_concatenated_batches(ddp, variant):
    assert ddp["world_size"] == WORLD and ddp["backend"] == "gloo"
    assert ddp[variant]["max_param_change"] > 100 * TOL  # training moved the weights, so equality means something
    assert ddp[variant]["max_param_diff"] < TOL64


def test_ddp_hands_every_gradient_byte_to_all_reduce_once_per_step(ddp):
    grad_bytes = param_bytes(ddp)
    for variant in ("ddp", "ddp_ring", "accum_no_sync", "ddp_adamw"):
        for rank in ddp[variant]["per_rank"]:
            assert rank["bytes_handed"] == [grad_bytes] * ddp["steps"]
    for rank in ddp["accum_sync_every_micro"]["per_rank"]:  # without no_sync: one all-reduce per micro-batch
        assert rank["bytes_handed"] == [ddp["accum"] * grad_bytes] * ddp["steps"]


def test_ddp_sends_the_ring_all_reduce_volume(ddp):
    ring = 2 * (WORLD - 1) / WORLD * param_bytes(ddp)
    for rank in ddp["ddp_ring"]["per_rank"]:
        assert rank["ring_bytes_sent"] == [ring] * ddp["steps"]  # our send/recv ring, counted
    if ddp["ddp"]["per_rank"][0]["bytes_written"][0] is None:
        pytest.skip("no /proc/self/io here: the bytes written to sockets cannot be read")
    for variant in ("ddp", "ddp_ring"):
        for rank in ddp[variant]["per_rank"]:
            assert all(close(w, ring) for w in rank["bytes_written"]), rank["bytes_written"]


# ---- tensor parallel ----


@pytest.fixture(scope="module")
def tp(torchrun):
    return run_script(torchrun, "tensor_parallel", "--batch", "4")


@pytest.mark.parametrize("variant", ["from_scratch", "dtensor"])
def test_tensor_parallel_equals_single_process(tp, variant):
    assert tp[variant]["logits_max_diff"] < TOL
    assert tp[variant]["grad_max_diff"] < TOL


def test_tensor_parallel_all_reduces_one_activation_per_block_each_way(tp):
    layers, d = tp["config"]["n_layers"], tp["config"]["d_model"]
    activation = tp["batch"] * tp["seq"] * d * 4
    scratch = tp["from_scratch"]
    for phase in ("forward", "backward"):
        assert scratch[f"{phase}_allreduces"] == 2 * layers  # attention and MLP of every layer
        assert scratch[f"{phase}_allreduce_bytes"] == 2 * layers * activation
        assert tp["dtensor"][f"{phase}_collectives"] == {"c10d_functional.all_reduce": 2 * layers}
        if scratch[f"{phase}_bytes_written"] is not None:
            assert close(scratch[f"{phase}_bytes_written"], ring_all_reduce_bytes(2 * layers * activation, WORLD))


def test_tensor_parallel_splits_each_layer_while_ddp_replicates_it(tp):
    model = model_of(tp)
    d, layers = tp["config"]["d_model"], tp["config"]["n_layers"]
    block = sum(p.numel() for p in model.blocks.parameters())
    replicated = layers * (4 * d + 2 * d)  # two LayerNorms, and the row-parallel layers' biases
    for variant in ("from_scratch", "dtensor"):
        outside_blocks = model.num_parameters() - block
        assert tp[variant]["params_per_rank"] == (block - replicated) // WORLD + replicated + outside_blocks


# ---- pipeline parallel ----


@pytest.fixture(scope="module")
def pp(torchrun):
    return run_script(torchrun, "pipeline_parallel", "--batch", "4", "--micro", "2",
                      "--bubble-micro", "2", "--repeats", "1")


@pytest.mark.parametrize("variant", ["from_scratch_gpipe", "ScheduleGPipe", "Schedule1F1B"])
def test_pipeline_equals_single_process(pp, variant):
    assert pp[variant]["grad_max_diff"] < TOL
    assert pp[variant]["loss_diff"] < TOL


def test_pipeline_sends_activations_forward_and_gradients_back(pp):
    written = pp["from_scratch_gpipe"]["bytes_written_per_rank"]
    if written[0] is None:
        pytest.skip("no /proc/self/io here")
    activation = pp["batch"] * pp["config"]["context_length"] * pp["config"]["d_model"] * 4
    tied = pp["config"]["vocab_size"] * pp["config"]["d_model"] * 4
    for rank in written:  # rank 0 sends activations, rank 1 their gradients; both the tied embedding's gradient
        assert close(rank["send_recv"], activation)
        assert close(rank["tied_allreduce"], ring_all_reduce_bytes(tied, WORLD))


def test_gpipe_timeline_runs_all_forwards_then_backwards_in_dependency_order(pp):
    (row,) = pp["bubble"]
    m = row["micro_batches"]
    first, last = row["timeline"]
    for events in (first, last):
        assert [e["kind"] for e in events] == ["F"] * m + ["B"] * m
    for i in range(m):  # a stage starts a micro-batch only after its neighbour finished it
        f0, f1 = first[i], last[i]
        assert f1["start"] >= f0["end"]
        b1, b0 = last[m + (m - 1 - i)], first[m + (m - 1 - i)]
        assert b0["start"] >= b1["end"]
    assert 0 < row["measured_bubble"] < 1 and row["analytic_bubble"] == bubble_fraction(WORLD, m)


# ---- expert parallel ----


@pytest.fixture(scope="module")
def ep(torchrun):
    return run_script(torchrun, "expert_parallel", "--batch", "4", "--shared-expert")


def test_expert_parallel_equals_single_process(ep):
    assert ep["dtype"] == "float64" and ep["config"]["ffn_type"] == "moe" and ep["config"]["capacity_factor"] is None
    run = ep["expert_parallel"]
    assert run["logits_max_diff"] < TOL64
    assert run["grad_max_diff"] < TOL64  # every rank's own experts, and the replicated parameters averaged
    assert run["loss_diff"] < TOL64


def test_expert_parallel_sends_the_slots_whose_expert_lives_elsewhere(ep):
    layers = ep["config"]["n_layers"]
    for rank, analytic in zip(ep["expert_parallel"]["per_rank"], ep["analytic_bytes_per_rank"], strict=True):
        assert (rank["forward_calls"], rank["backward_calls"]) == (3 * layers, 2 * layers)  # counts, rows, outputs
        assert analytic["backward"] > 0  # the routing sent slots away, so the comparison means something
        for phase in ("forward", "backward"):
            assert rank[f"{phase}_bytes_sent"] == analytic[phase]
            assert rank[f"{phase}_bytes"] > rank[f"{phase}_bytes_sent"]  # its own experts' slots stay home
            if rank[f"{phase}_bytes_written"] is not None:
                assert close(rank[f"{phase}_bytes_written"], analytic[phase]), (phase, rank, analytic)


def test_expert_parallel_holds_each_expert_on_one_rank(ep):
    config = ep["config"]
    model = model_of(ep)
    experts = sum(p.numel() for b in model.blocks for p in (b.mlp.gate_up, b.mlp.down))
    per_rank = ep["expert_parallel"]["per_rank"]
    assert [r["experts"] for r in per_rank] == [list(experts_owned(config["n_experts"], r, WORLD))
                                                for r in range(WORLD)]
    assert all(r["params"] == model.num_parameters() - experts + experts // WORLD for r in per_rank)


# ---- fully sharded ----


@pytest.fixture(scope="module")
def fsdp(torchrun):
    return run_script(torchrun, "fsdp", "--strategy", "fsdp", "--steps", "3", "--dtype", "float64")


def test_fsdp_equals_single_process_training(fsdp):
    assert fsdp["max_param_change"] > 100 * TOL
    assert fsdp["max_param_diff"] < TOL64


def test_fsdp_holds_half_the_training_state_of_ddp(fsdp):
    full = param_bytes(fsdp)  # what every DDP rank holds, for parameters and for gradients
    for rank in fsdp["per_rank"]:
        state = rank["state_bytes"]
        for kind, replicas in (("parameters", 1), ("gradients", 1), ("optimizer", 2)):  # AdamW: two moments
            assert abs(state[kind] - replicas * full / WORLD) <= 0.02 * replicas * full / WORLD, (kind, state)


# ---- the launcher ----


def test_run_for_result_shows_the_command_and_returns_what_rank_0_wrote(torchrun, tmp_path, capsys):
    script = tmp_path / "writes.py"
    script.write_text("import json, os, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                      "if os.environ['RANK'] == '0':\n    open(out, 'w').write(json.dumps({'argv': sys.argv[1:]}))\n")
    result = run_for_result(script, ["--steps", 3], nproc=WORLD, timeout=60, show=True)
    assert result["argv"][:2] == ["--out", result["argv"][1]] and result["argv"][2:] == ["--steps", "3"]
    assert not Path(result["argv"][1]).exists()  # read, then removed with its folder
    shown = capsys.readouterr().out
    assert shown.startswith("python -m torch.distributed.run") and shown.rstrip().endswith(
        "writes.py --steps 3 --out RESULT.json") and str(tmp_path) not in shown


def test_a_finished_worker_exits_at_once_with_its_output_flushed(python_process):
    """finish_and_exit ends the process without the interpreter's shutdown (where freeing gloo's and FSDP's objects
    can deadlock), so nothing after it runs, not even atexit handlers; what the worker printed still arrives."""
    done = python_process("-c", "import atexit\nfrom helpers.parallel.runtime import finish_and_exit\n"
                          "atexit.register(print, 'interpreter shutdown')\nprint('results written', end='')\n"
                          "finish_and_exit()\nprint('after')\n", timeout=120)
    assert (done.returncode, done.stdout) == (0, "results written"), done.stderr[-2000:]


def test_launch_reports_the_failing_ranks_error(torchrun, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails on purpose')\n")
    with pytest.raises(DistributedRunError, match="rank 1 fails on purpose"):
        torchrun(script, nproc=WORLD, timeout=60)


@pytest.mark.serial  # its timeouts assume the machine is not shared with other tests
def test_launch_kills_a_hanging_run_and_shows_where_each_rank_waits(torchrun, tmp_path):
    """A rank waits for a message its peer never sends; the error shows each rank's own stack where it waits. The
    stacks can only be shown once both workers are past setup(), which on a loaded machine may take longer than the
    timeout: then the run is tried again with three times the timeout. Every attempt must kill every worker.
    The workers used to dump their stacks at once into torchrun's one pipe, and under load the two interleaved
    character by character ("in 2799<module> in \nrecv"): 1 attempt in 5 on a loaded 2-core machine showed no
    readable frame; they are now asked one at a time. The run prints 400 lines first: the first rank's stack used to
    begin with all of them."""
    script = tmp_path / "hangs.py"
    script.write_text("import os, pathlib, time\nimport torch, torch.distributed as dist\n"
                      "from helpers.parallel.runtime import setup\n"
                      "runtime = setup('cpu', timeout_s=600)\n"
                      f"pathlib.Path({str(tmp_path)!r}, 'pid' + os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "print(*(f'step {i}: warming up' for i in range(400)), sep='\\n', flush=True)\n"
                      "if runtime.rank == 0:\n    dist.recv(torch.zeros(1), 1)\n"
                      "else:\n    time.sleep(600)\n")
    messages = []
    for timeout in (20, 60):
        for old in tmp_path.glob("pid*"):
            old.unlink()
        start = time.perf_counter()
        with pytest.raises(DistributedRunError, match="did not finish within") as failure:
            torchrun(script, nproc=WORLD, timeout=timeout)
        assert time.perf_counter() - start < timeout + 60  # killed soon after the timeout
        for pid in (int(p.read_text()) for p in tmp_path.glob("pid*")):  # every worker that started is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        messages.append(str(failure.value))
        shown = re.search(r"^rank 0:\n(.*?)^rank 1:\n(.*?)^the run's last output:", messages[-1], flags=re.M | re.S)
        if shown and " in recv\n" in shown[1] and "hangs.py\", line 10 in <module>" in shown[2]:  # where each waits
            # what the run printed before it hung is its output, not part of a rank's stack
            assert "warming up" not in shown[1] + shown[2] and "step 399: warming up" in messages[-1]
            return
    pytest.fail("no attempt showed both ranks' stacks; the last message:\n" + messages[-1][:3000])


@pytest.mark.serial
def test_a_run_killed_before_its_workers_reach_setup_says_so(torchrun, tmp_path):
    """The workers never call setup(), as workers still importing on a busy machine. The message can only say so once
    torchrun has started them, which a slow machine may not do within the first timeout: then the run is tried again
    with three times the timeout, until the workers exist (the event the message describes), not a fixed time."""
    script = tmp_path / "slow_start.py"
    script.write_text("import time\ntime.sleep(600)\n")
    for timeout in (5, 15, 45, 135):
        with pytest.raises(DistributedRunError) as failure:
            torchrun(script, nproc=WORLD, timeout=timeout)
        if "No worker process had started yet" not in str(failure.value):
            break
    # every worker torchrun had started (it starts them together: both, or on a very slow start only the first)
    assert re.search(r"\b(\d) of \1 worker processes had not reached setup", str(failure.value)), str(failure.value)


def test_failure_message_shows_the_first_ranks_traceback_and_every_ranks_last_line():
    output = "\n".join(["[rank1]: Traceback (most recent call last):", "[rank1]:   File x.py", "[rank1]: KeyError: 'a'",
                        "[rank0]: Traceback (most recent call last):", "[rank0]: RuntimeError: peer closed",
                        "torchrun summary: rank 1 failed"])
    excerpt = first_traceback(output)
    assert excerpt.splitlines() == ["[rank1]: Traceback (most recent call last):", "[rank1]:   File x.py",
                                    "[rank1]: KeyError: 'a'", "[rank0]: RuntimeError: peer closed"]


def test_launch_rejects_a_missing_script(tmp_path):
    with pytest.raises(DistributedRunError, match="no script"):
        launch(tmp_path / "missing.py")


# ---- building blocks, without processes ----


def test_device_choice_needs_one_gpu_per_process():
    assert pick_device_type("auto", 2, 0) == "cpu"
    assert pick_device_type("auto", 2, 1) == "cpu"  # NCCL cannot put two ranks on one GPU
    assert pick_device_type("auto", 2, 2) == "cuda"
    with pytest.raises(RuntimeError, match="one GPU per process"):
        pick_device_type("cuda", 2, 1)


def test_fused_qkv_is_sharded_per_head_not_contiguously():
    rows = shard_rows(3 * 8, parts=3, rank=1, world_size=2)  # d_model 8: Q rows 0-7, K 8-15, V 16-23
    assert rows.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    with pytest.raises(ValueError, match="cannot be split evenly"):
        shard_rows(3 * 6, parts=3, rank=0, world_size=4)


def test_tensor_parallel_rejects_heads_it_cannot_split():
    model = GPT(GPTConfig(vocab_size=32, context_length=8, d_model=12, n_heads=3, n_layers=1, dropout=0.0))
    with pytest.raises(ValueError, match="3 attention heads cannot be split over 2 ranks"):
        tensor_parallel_gpt(model, rank=0, world_size=2)
    layout = GPT(GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0),
                 attn_implementation="einsum")
    with pytest.raises(ValueError, match="einsum computes its projections from the full weight matrices itself"):
        tensor_parallel_gpt(layout, rank=0, world_size=2)


def test_pipeline_stages_cover_the_layers_and_reject_dropout():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        stage_layers(2, 3)
    config = GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=2, dropout=0.0)
    model = GPT(config)
    first, last = pipeline_stage(model, 0, 2), pipeline_stage(model, 1, 2)
    x = torch.randint(32, (2, 8))
    torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=1e-6)  # the stages compose to the model
    with pytest.raises(ValueError, match="takes activations"):
        last(x)
    with pytest.raises(ValueError, match="dropout=0.0"):
        pipeline_stage(GPT(GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=2)), 0, 2)


def test_fsdp_counts_the_peak_of_the_training_steps_once(chapter_script, monkeypatch):
    """On CUDA the peak is what the steps add above the model, plus the model: never plus the optimizer state the
    steps created, which the peak already holds (that counted AdamW's moments twice)."""
    fsdp = chapter_script("ch07_parallel/fsdp.py")
    memory = {"allocated": 100, "peak": 100}  # a fake CUDA allocator holding a 100-byte model

    def allocate(n: int) -> None:
        memory["allocated"] += n
        memory["peak"] = max(memory["peak"], memory["allocated"])

    def train() -> None:
        allocate(50)  # AdamW's moments: created by the first step, kept
        allocate(30)  # activations and gradients: freed by the end of the step
        allocate(-30)

    def peak_cuda_bytes(fn, device):  # as helpers.measure.memory's: the peak above what was allocated before
        before = memory["peak"] = memory["allocated"]
        fn()
        return memory["peak"] - before

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(fsdp, "peak_cuda_bytes", peak_cuda_bytes)
    assert fsdp.training_peak_bytes(train, torch.device("cuda"), None) == (180, "cuda max_memory_allocated")


def test_experts_are_owned_in_contiguous_blocks():
    assert [list(experts_owned(8, r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(experts_owned(6, 2, 3)) == [4, 5]
    with pytest.raises(ValueError, match="8 experts cannot be split evenly over 3 ranks"):
        experts_owned(8, 0, 3)


def test_expert_parallel_bytes_count_the_slots_that_leave_their_rank():
    """3 ranks, 6 experts (rank r owns 2r and 2r + 1), each rank's tokens with their k=2 experts."""
    routing = [torch.tensor([[0, 2], [4, 5]]), torch.tensor([[2, 3]]), torch.tensor([[0, 1], [2, 4]])]
    assert slots_between_ranks(routing, 6).tolist() == [[1, 1, 2], [0, 2, 0], [2, 1, 1]]
    # rank 0 sends 3 slots away and gets 2, rank 1 sends none and gets 2, rank 2 sends 3 and gets 2; forward also
    # sends each other rank its counts for that rank's 2 experts (int64)
    counts = 2 * 2 * 8
    assert exchange_bytes(routing, 6, row_bytes=10) == [
        {"forward": counts + 50, "backward": 50}, {"forward": counts + 20, "backward": 20},
        {"forward": counts + 50, "backward": 50}]


def test_expert_parallel_layer_keeps_its_experts_and_replicates_the_rest():
    config = GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0,
                       ffn_type="moe", n_experts=4, shared_expert=True)
    model = GPT(config)
    split = expert_parallel_gpt(model, rank=1, world_size=2)
    layer, full = split.blocks[0].mlp, model.blocks[0].mlp
    assert isinstance(layer, ExpertParallelMoE) and list(layer.owned) == [2, 3]
    assert torch.equal(layer.gate_up, full.gate_up[2:]) and torch.equal(layer.down, full.down[2:])
    assert torch.equal(shard_of(split, "blocks.0.mlp.down", full.down), full.down[2:])
    assert torch.equal(layer.router.weight, full.router.weight)  # replicated: each rank routes its own tokens
    shared = "blocks.0.mlp.shared.fc.weight"
    assert shard_of(split, shared, model.get_parameter(shared)) is model.get_parameter(shared)


def test_expert_parallel_refuses_what_it_cannot_split():
    dense = GPT(GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0))
    with pytest.raises(ValueError, match="use ffn_type='moe'"):
        expert_parallel_gpt(dense, rank=0, world_size=2)
    capped = GPT(GPTConfig(vocab_size=32, context_length=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0,
                           ffn_type="moe", n_experts=4, capacity_factor=1.25))
    with pytest.raises(ValueError, match="capacity_factor=None"):
        expert_parallel_gpt(capped, rank=0, world_size=2)
    with pytest.raises(ValueError, match="4 experts cannot be split evenly over 3 ranks"):
        expert_parallel_gpt(GPT(GPTConfig(**{**capped.config.__dict__, "capacity_factor": None})), 0, 3)
