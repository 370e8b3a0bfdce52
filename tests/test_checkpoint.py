"""Checkpoints round-trip, refuse damaged or unsafe files with a clear error, and never leave half a file."""

import hashlib

import pytest
import torch

from helpers.training import checkpoint
from helpers.training.checkpoint import CheckpointError, checksum_path, load_checkpoint, save_checkpoint

FORMATS = [".pt", ".safetensors"]


def tied_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(50, 8)
    return {"tok_emb.weight": emb, "lm_head.weight": emb, "ln.bias": torch.randn(8),
            "half": torch.randn(3, 5, dtype=torch.float16)}


def assert_same_state(loaded, expected):
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_keeps_tied_tensors_shared(tmp_path, suffix, mmap):
    state = tied_state()
    path = save_checkpoint(state, tmp_path / f"model{suffix}")
    loaded = load_checkpoint(path, mmap=mmap)
    assert_same_state(loaded, state)
    assert loaded["lm_head.weight"].data_ptr() == loaded["tok_emb.weight"].data_ptr()  # one copy, as saved


def test_checksum_file_is_sha256sum_format(tmp_path):
    path = save_checkpoint(tied_state(), tmp_path / "model.pt")
    assert checksum_path(path).read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  model.pt\n"
    save_checkpoint(tied_state(), path, checksum=False)
    assert not checksum_path(path).exists()  # a stale checksum would flag the new file as corrupt


def test_training_state_round_trips_as_pt(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "note": "after one step"}
    loaded = load_checkpoint(save_checkpoint(state, tmp_path / "train.pt"))
    assert loaded["step"] == 7 and loaded["note"] == "after one step"
    assert_same_state(loaded["model"], state["model"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_safetensors_refuses_nested_state(tmp_path):
    with pytest.raises(TypeError, match="flat dict of tensors; save other state as .pt"):
        save_checkpoint({"model": {"w": torch.zeros(1)}}, tmp_path / "train.safetensors")
    assert list(tmp_path.iterdir()) == []


def damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "header overwritten":
        path.write_bytes(b"\0" * 64 + data[64:])
    elif how == "not a checkpoint":
        path.write_text("<html>Rate limit exceeded</html>")


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("how", ["truncated", "header overwritten", "not a checkpoint"])
def test_damaged_file_is_a_clear_error_naming_it(tmp_path, suffix, how):
    path = save_checkpoint(tied_state(), tmp_path / f"model{suffix}", checksum=False)
    damage(path, how)
    with pytest.raises(CheckpointError, match=r"model\.(pt|safetensors).*(truncated|corrupt|damaged)") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("suffix", FORMATS)
def test_flipped_data_byte_is_caught_only_by_the_checksum(tmp_path, suffix):
    state = {"w": torch.zeros(1000)}
    path = save_checkpoint(state, tmp_path / f"model{suffix}")
    data = bytearray(path.read_bytes())
    data[-2000] ^= 0xFF  # inside the tensor bytes (the .pt zip directory is at the end; tensor data before it)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match model.*sha256.*the file is corrupt"):
        load_checkpoint(path)
    loaded = load_checkpoint(path, verify=False)  # the formats themselves carry no checksum of tensor data
    assert not torch.equal(loaded["w"], state["w"])


def test_verify_without_checksum_file_says_what_to_do(tmp_path):
    path = save_checkpoint(tied_state(), tmp_path / "model.pt", checksum=False)
    with pytest.raises(CheckpointError, match="no checksum file model.pt.sha256.*verify=False"):
        load_checkpoint(path, verify=True)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint file at .*nothing.pt"):
        load_checkpoint(tmp_path / "nothing.pt")


class Payload:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_pickled_code_is_refused(tmp_path):
    path = tmp_path / "unsafe.pt"
    torch.save({"w": torch.zeros(2), "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="unsafe.pt: weights-only loading refused it.*source you trust"):
        load_checkpoint(path)


@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("interruption", [OSError("No space left on device"), KeyboardInterrupt()])
def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, suffix, interruption):
    path = tmp_path / f"model{suffix}"
    old = tied_state()
    save_checkpoint(old, path)
    before = sorted(p.name for p in tmp_path.iterdir())

    def write_half_then_fail(obj, file, *args, **kwargs):
        with open(file, "wb") as f:
            f.write(b"PK\x03\x04 half of a checkpoint")
        raise interruption

    monkeypatch.setattr(checkpoint.torch, "save", write_half_then_fail)
    monkeypatch.setattr(checkpoint, "save_file", write_half_then_fail)
    new = {name: t + 1 for name, t in old.items()}
    with pytest.raises(type(interruption)):
        save_checkpoint(new, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial file left behind
    assert_same_state(load_checkpoint(path, verify=True), old)
